"""How a stream of ``(name, tensor)`` becomes buckets, and buckets become tensors again.

A bucket is one contiguous run of bytes: the tensors' data, each at a 64-byte aligned offset, then
the **header** (:class:`BucketPiece` records, msgpack) after the data. One put carries both, so the
metadata travels with the bytes it describes and no message has to hold thousands of names.

Sender side, :class:`Packer`: every trainer rank runs the same packing over the same stream (verl's
FSDP engine yields every full tensor on every rank), so every rank knows every bucket's pieces
without talking; a rank copies only the buckets it sends. A tensor larger than a bucket is cut
into chunks, one bucket each at most, in order.

Receiver side, :func:`read_header` checks a header against every rule (names, dtypes, shapes,
bounds, chunk order) and :class:`Assembler` turns pieces into tensors: a whole piece is a view of
the bucket, chunks are merged into a tensor of their own; a name seen in an earlier update must
keep its shape and dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import msgpack
import torch

from transport import WireFormatError
from transport.contract import unpack

#: where each piece starts in a bucket: a multiple of this many bytes (any dtype can be viewed)
ALIGN = 64
MAX_NAME = 1024
MAX_NDIM = 16
#: dtypes that may travel, by their wire name
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}
#: the header of one piece takes at most this many bytes beyond its name and 9 per dimension
PIECE_OVERHEAD = 96


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class BucketPiece:
    """Bytes ``[chunk_at, chunk_at + nbytes)`` of tensor ``name`` (``shape``, ``dtype``), lying
    at ``offset`` in the bucket. A whole tensor is one piece with ``chunk_at == 0`` and
    ``nbytes == total``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    chunk_at: int

    @property
    def total(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    @property
    def whole(self) -> bool:
        return self.chunk_at == 0 and self.nbytes == self.total

    def wire(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes, self.chunk_at]


def header_cost(name: str, ndim: int) -> int:
    """An upper bound of the bytes a piece adds to a header."""
    return len(name.encode()) + PIECE_OVERHEAD + 9 * ndim


def encode_header(pieces: list[BucketPiece]) -> bytes:
    return msgpack.packb([p.wire() for p in pieces])


@dataclass
class Planned:
    """One bucket as the packer closed it: its index, pieces and where its header goes."""

    index: int
    pieces: list[BucketPiece]
    data_bytes: int
    header: bytes

    @property
    def header_at(self) -> int:
        return aligned(self.data_bytes)

    @property
    def nbytes(self) -> int:
        return self.header_at + len(self.header)


class Packer:
    """Cuts a stream of tensors into buckets of at most ``bucket_bytes`` (data and header).

    :meth:`add` takes the next tensor and yields ``(piece, source bytes)`` pairs to copy and the
    buckets it closed on the way; :meth:`finish` closes the last one (possibly empty: the
    receivers learn from it that the update is over). It owns only the bucket being filled."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.index = 0
        self._pieces: list[BucketPiece] = []
        self._used = 0
        self._header = 16  # the msgpack array's own header

    def _room(self, name: str, ndim: int) -> int:
        """Data bytes a piece of ``name`` may take in the open bucket (0 if none)."""
        header = self._header + header_cost(name, ndim)
        cap = self.bucket_bytes // ALIGN * ALIGN
        return max(0, cap - aligned(self._used) - aligned(header))

    def _close(self) -> Planned:
        planned = Planned(self.index, self._pieces, self._used, encode_header(self._pieces))
        assert planned.nbytes <= self.bucket_bytes, (planned.nbytes, self.bucket_bytes)
        self.index += 1
        self._pieces, self._used, self._header = [], 0, 16
        return planned

    def add(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[BucketPiece, torch.Tensor] | Planned]:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise TypeError(
                f"tensor {name}: dtype {tensor.dtype} cannot travel; one of {sorted(DTYPES)}"
            )
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise ValueError(f"a tensor name is a str of 1 to {MAX_NAME} characters, got {name!r}")
        if tensor.dim() > MAX_NDIM:
            raise ValueError(f"tensor {name} has {tensor.dim()} dimensions; at most {MAX_NDIM}")
        flat = tensor.detach().reshape(-1).view(torch.uint8) if tensor.numel() else None
        total = tensor.numel() * tensor.element_size()
        shape = tuple(tensor.shape)
        done = 0
        while True:
            room = self._room(name, len(shape))
            if room <= 0 or (
                room < total - done and self._pieces and room < self.bucket_bytes // 4
            ):
                # no room, or a tensor that would be cut although a fresh bucket nearly holds it
                if not self._pieces:
                    raise ValueError(
                        f"a bucket of {self.bucket_bytes} bytes cannot hold even the metadata of "
                        f"tensor {name}; raise update_weights_bucket_megabytes"
                    )
                yield self._close()
                continue
            take = min(room, total - done)
            offset = aligned(self._used)
            piece = BucketPiece(name, dtype, shape, offset, take, done)
            self._pieces.append(piece)
            self._used = offset + take
            self._header += header_cost(name, len(shape))
            yield (
                piece,
                (
                    flat[done : done + take]
                    if flat is not None
                    else torch.empty(0, dtype=torch.uint8)
                ),
            )
            done += take
            if done >= total:
                return

    def finish(self) -> Planned:
        return self._close()


def read_header(raw: bytes, data_bytes: int, names: set[str] | None = None) -> list[BucketPiece]:
    """The pieces of a header a peer wrote, each checked: a known dtype, a shape of ints >= 0,
    an aligned offset, its bytes inside the bucket's data and inside its tensor."""
    rows = unpack(
        raw, "bucket header", len(raw), max_str=MAX_NAME * 4, max_array=1 << 20, max_map=0
    )
    if not isinstance(rows, list):
        raise WireFormatError("a bucket header is a list of pieces")
    pieces = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 6:
            raise WireFormatError(f"a piece of a bucket header has 6 fields, got {str(row)[:80]}")
        name, dtype, shape, offset, nbytes, chunk_at = row
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise WireFormatError(
                f"a tensor name is a str of 1 to {MAX_NAME} characters, got {str(name)[:80]!r}"
            )
        if dtype not in DTYPES:
            raise WireFormatError(f"tensor {name}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(type(x) is int and x >= 0 for x in shape)
        ):
            raise WireFormatError(
                f"tensor {name}: shape {str(shape)[:80]} is not a list of ints >= 0"
            )
        for field, value in (("offset", offset), ("nbytes", nbytes), ("chunk_at", chunk_at)):
            if type(value) is not int or value < 0:
                raise WireFormatError(f"tensor {name}: {field} must be an int >= 0, got {value!r}")
        piece = BucketPiece(name, dtype, tuple(shape), offset, nbytes, chunk_at)
        if offset % ALIGN or offset + nbytes > data_bytes:
            raise WireFormatError(
                f"tensor {name}: bytes [{offset}, {offset + nbytes}) are not an aligned run inside "
                f"the bucket's {data_bytes} bytes of data"
            )
        if chunk_at + nbytes > piece.total:
            raise WireFormatError(
                f"tensor {name}: chunk [{chunk_at}, {chunk_at + nbytes}) lies outside its "
                f"{piece.total} bytes"
            )
        pieces.append(piece)
    return pieces


class Assembler:
    """Turns the pieces of one worker's buckets into ``(name, tensor)``, in order, and keeps the
    shapes and dtypes of the names it has seen (across updates: a name must keep them).

    Rules: a whole piece becomes a view of the bucket (valid until the bucket is reused); the
    chunks of a tensor must come in order, without another tensor between them, and are merged
    into a tensor of its own on ``device``."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = device
        self.known: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._merging: BucketPiece | None = None
        self._merged: torch.Tensor | None = None
        self._filled = 0

    def begin(self) -> None:
        """A new update: a tensor cut off by an earlier one is dropped."""
        self._merging, self._merged, self._filled = None, None, 0

    def _check_known(self, piece: BucketPiece) -> None:
        seen = self.known.get(piece.name)
        if seen is not None and seen != (piece.dtype, piece.shape):
            raise WireFormatError(
                f"tensor {piece.name} arrived as {piece.dtype}{list(piece.shape)} but was "
                f"{seen[0]}{list(seen[1])} in an earlier update; a tensor keeps its shape and "
                "dtype across updates (restart the rollout workers to load another model)"
            )
        self.known[piece.name] = (piece.dtype, piece.shape)

    def tensors(
        self, bucket: torch.Tensor, pieces: list[BucketPiece]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors that ``pieces`` of ``bucket`` (a uint8 tensor) complete."""
        for piece in pieces:
            dtype = DTYPES[piece.dtype]
            if self._merging is not None and (
                piece.name != self._merging.name or piece.chunk_at != self._filled
            ):
                raise WireFormatError(
                    f"tensor {self._merging.name} stopped at byte {self._filled} of "
                    f"{self._merging.total} and {piece.name} (byte {piece.chunk_at}) came next"
                )
            if piece.whole:
                self._check_known(piece)
                data = bucket[piece.offset : piece.offset + piece.nbytes]
                yield piece.name, data.view(dtype).view(piece.shape)
                continue
            if self._merging is None:
                if piece.chunk_at != 0:
                    raise WireFormatError(
                        f"tensor {piece.name}: its first chunk starts at byte {piece.chunk_at}"
                    )
                self._check_known(piece)
                self._merging = piece
                self._merged = torch.empty(piece.total, dtype=torch.uint8, device=self.device)
            assert self._merged is not None
            self._merged[piece.chunk_at : piece.chunk_at + piece.nbytes] = bucket[
                piece.offset : piece.offset + piece.nbytes
            ]
            self._filled = piece.chunk_at + piece.nbytes
            if self._filled == piece.total:
                yield piece.name, self._merged.view(dtype).view(piece.shape)
                self._merging, self._merged, self._filled = None, None, 0

    def check_complete(self) -> None:
        """At the last bucket: no tensor may be left half merged."""
        if self._merging is not None:
            raise WireFormatError(
                f"the update ended with tensor {self._merging.name} at byte {self._filled} of "
                f"{self._merging.total}"
            )
