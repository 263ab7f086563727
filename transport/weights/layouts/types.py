"""The value types of layouts, frozen dataclasses: which slice of which global tensor each
trainer rank holds (:class:`SourceLayout`), what each destination tensor is made of
(:class:`DestTensor` of :class:`Piece`), and what one rank writes of it (:class:`Box`,
:class:`Run`); and :class:`LayoutError`, raised when two layouts do not fit. ``layouts``
re-exports them with the functions that check and plan them (the public home: import from there
or from ``transport.weights``); ``rules`` checks them without importing ``planning``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from transport import LayoutError


@dataclass(frozen=True)
class Slice:
    """``[start, stop)`` of a global tensor along ``dim``; ``dim=None`` is the whole tensor."""

    dim: int | None = None
    start: int = 0
    stop: int = 0

    def box(self, shape: Sequence[int]) -> list[tuple[int, int]]:
        """Per dim, the half-open interval this slice covers of a tensor of ``shape``."""
        return [(self.start, self.stop) if d == self.dim else (0, n) for d, n in enumerate(shape)]


@dataclass(frozen=True)
class SourceTensor:
    """One global tensor of the trainer: its ``shape`` and ``dtype``, and ``held``, the slice
    each rank holds (``{rank: Slice()}`` for every rank when replicated)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    held: Mapping[int, Slice]

    @property
    def replicated(self) -> bool:
        return all(s.dim is None for s in self.held.values())


@dataclass(frozen=True)
class SourceLayout:
    """Every rank's share of every global tensor (``world`` ranks, numbered from 0)."""

    world: int
    tensors: Mapping[str, SourceTensor]

    @classmethod
    def split(
        cls,
        world: int,
        tensors: Mapping[str, tuple[Sequence[int], torch.dtype]],
        dims: Mapping[str, int | None] | None = None,
        sizes: Mapping[str, Sequence[int]] | None = None,
    ) -> SourceLayout:
        """The layout of a trainer whose tensors (name -> (global shape, dtype)) are split
        along ``dims[name]`` (default 0; None: replicated) into ``world`` shards: of
        ``sizes[name]`` rows each when given (uneven), else as ``torch.chunk`` splits them
        (FSDP's rule: ceil(n / world) each, the last ones smaller or empty)."""
        out = {}
        for name, (shape, dtype) in tensors.items():
            dim = (dims or {}).get(name, 0)
            shape = tuple(int(n) for n in shape)
            if dim is None:
                held = {r: Slice() for r in range(world)}
            else:
                n = shape[dim]
                step = math.ceil(n / world) if n else 0
                counts = list((sizes or {}).get(name, ()))
                if not counts:
                    counts = [max(0, min(step, n - r * step)) for r in range(world)]
                held, at = {}, 0
                for r, c in enumerate(counts):
                    held[r] = Slice(dim, at, at + int(c))
                    at += int(c)
            out[name] = SourceTensor(shape, dtype, held)
        return cls(world, out)

    @classmethod
    def single(cls, tensors: Mapping[str, torch.Tensor]) -> SourceLayout:
        """The layout of one rank holding every tensor of ``tensors`` whole (a trainer that
        publishes with a ShardedPublisher so that each subscriber gets only what it declares)."""
        shapes = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
        return cls.split(1, shapes, dict.fromkeys(tensors))

    @classmethod
    def from_placements(
        cls,
        world: int,
        tensors: Mapping[str, tuple[Sequence[int], torch.dtype]],
        placements: Mapping[str, object],
    ) -> SourceLayout:
        """The layout of tensors placed on a 1-D device mesh of ``world`` ranks as torch's
        DTensor places them: ``placements[name]`` is ``Shard(dim)`` or ``Replicate()`` (from
        ``torch.distributed.tensor``; an int dim or None say the same), split as DTensor splits
        (torch.chunk's rule)."""
        dims = {
            n: _placement_dim(placements.get(n), n, len(tuple(s))) for n, (s, _) in tensors.items()
        }
        return cls.split(world, tensors, dims)

    @classmethod
    def from_dtensors(
        cls, named: Mapping[str, torch.Tensor]
    ) -> tuple[SourceLayout, int, dict[str, torch.Tensor]]:
        """(the layout, this process's rank, its local shards) of DTensors on one 1-D device
        mesh, ready for ``ShardedPublisher(transport, shards, layout, rank)``."""
        meshes = {id(t.device_mesh): t.device_mesh for t in named.values()}  # type: ignore[attr-defined]
        if len(meshes) != 1:
            raise LayoutError([f"the tensors are on {len(meshes)} device meshes; one is needed"])
        (mesh,) = meshes.values()
        if mesh.ndim != 1:
            raise LayoutError([f"a {mesh.ndim}-D device mesh: only 1-D meshes are supported"])
        problems, placements = [], {}
        for n, t in named.items():
            (placements[n],) = t.placements  # type: ignore[attr-defined]
            try:
                _placement_dim(placements[n], n, t.dim())
            except LayoutError as e:
                problems += e.problems
        if problems:
            raise LayoutError(problems)
        layout = cls.from_placements(
            mesh.size(), {n: (tuple(t.shape), t.dtype) for n, t in named.items()}, placements
        )
        local = {n: t.to_local().contiguous() for n, t in named.items()}  # type: ignore[attr-defined]
        return layout, mesh.get_local_rank(), local

    def local_shape(self, rank: int, name: str) -> tuple[int, ...]:
        """The shape of the tensor ``rank`` holds of ``name``."""
        t = self.tensors[name]
        return tuple(hi - lo for lo, hi in t.held[rank].box(t.shape))


def _placement_dim(p: object, name: str, ndim: int) -> int | None:
    """The shard dim a placement says (None: replicated)."""
    if p is None or type(p).__name__ == "Replicate":
        return None
    dim = p if isinstance(p, int) and not isinstance(p, bool) else None
    if type(p).__name__ == "Shard" and isinstance(getattr(p, "dim", None), int):
        dim = p.dim  # type: ignore[attr-defined]
    if dim is None or not -ndim <= dim < ndim:
        raise LayoutError(
            [
                f"source {name!r}: placement {p!r} is not Shard(dim) of one of its {ndim} dims or "
                "Replicate() (Partial, strided and 2-D placements are not supported)"
            ]
        )
    return dim % ndim


@dataclass(frozen=True)
class Piece:
    """A slice (``take``) of source tensor ``source``, placed at ``at`` along the destination's
    stacking dim."""

    source: str
    take: Slice = field(default_factory=Slice)
    at: int = 0


@dataclass(frozen=True)
class Quant:
    """How a destination is quantized to fp8 e4m3: its scales go to destination tensor
    ``scale``, one per ``block`` (rows, cols) of a 2-D tensor, or one for the whole tensor
    (``block=None``); see transport/weights/layouts/convert.py for the convention."""

    scale: str
    block: tuple[int, int] | None = (128, 128)


@dataclass(frozen=True)
class DestTensor:
    """A destination tensor of ``shape`` and ``dtype``: its ``pieces`` stacked along ``dim``;
    ``quant`` when it is fp8 with scales. A tensor of scales has no pieces and names the
    quantized tensor it belongs to (``scale_of``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]
    dim: int = 0
    quant: Quant | None = None
    scale_of: str = ""


@dataclass(frozen=True)
class Run:
    """``count`` elements from element ``src_at`` of this rank's local tensor ``source`` to
    element ``dst_at`` of destination tensor ``dest`` (contiguous tensors, flat indices: in
    elements, so a run holds whatever the dtypes of its two ends)."""

    source: str
    src_at: int
    dest: str
    dst_at: int
    count: int


@dataclass(frozen=True)
class Box:
    """What one rank holds of one destination piece: ``extent`` elements per dim, from
    ``src_at`` of its local tensor ``source`` (of shape ``local``) to ``dst_at`` of ``dest``."""

    source: str
    local: tuple[int, ...]
    src_at: tuple[int, ...]
    dest: str
    dst_at: tuple[int, ...]
    extent: tuple[int, ...]
