"""The delta codec (transport/weights/delta/codec.py and decoder.py): a version's changes
encoded against its base and applied onto a copy of the base give the version bit for bit, for
every dtype and density, each chunk in its smallest encoding; a blob that breaks any rule is
refused before a byte is written, whatever its bytes."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transport import DeltaError
from transport.weights import flat_like
from transport.weights.delta.codec import CHUNK, MASK, SPARSE, WHOLE, ChangeSet, DeltaLayout, encode
from transport.weights.delta.decoder import apply, decode

pytestmark = [pytest.mark.unit, pytest.mark.delta]


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.bf16": torch.randn(300, 1000, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(70001, generator=g),
        "c.bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "d.fp8": torch.randn(100000, generator=g).to(torch.float8_e4m3fn),
        "e.i64": torch.arange(10),
        "f.scalar": torch.tensor(3.0),
        "g.empty": torch.empty(0, 4),
        "h.bool": torch.rand(1000, generator=g) > 0.5,
        "i.c128": torch.randn(100, dtype=torch.complex128, generator=g),
        "j.f16": torch.randn(3 * CHUNK + 7, generator=g).to(torch.float16),
    }


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def changed(base: dict[str, torch.Tensor], share: float, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in base.items():
        v = v.clone()
        if v.numel():
            bits = raw(v)
            pick = torch.rand(bits.numel(), generator=g) < share
            bits[pick] ^= 0x5A  # any bits, NaNs included
        out[k] = v
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(raw(a[k]), raw(b[k])) for k in a)


def roundtrip(base, cur, targets):
    layout = DeltaLayout(cur)
    copy = {k: v.clone() for k, v in base.items()}
    enc = encode(layout, cur, copy, 7, 6)
    assert enc is not None
    assert same(copy, cur)  # the encoder's copy is the next version's base
    apply(decode(layout, enc.blob, 7, 6), targets)
    return enc


@pytest.mark.parametrize("share", [0.0, 0.0005, 0.02, 0.1, 0.5, 1.0])
def test_every_density_applies_bit_exact_onto_separate_tensors_and_a_flat_slot(share):
    base = tensors()
    cur = changed(base, share)
    apart = {k: v.clone() for k, v in base.items()}
    enc = roundtrip(base, cur, apart)
    assert same(apart, cur)
    flat = flat_like(base)
    for k in flat:
        flat[k].copy_(base[k])
    roundtrip(base, cur, flat)
    assert same(flat, cur)
    if share == 0.0:
        assert enc.changed == 0 and enc.blob.numel() < 200


def test_chunks_of_every_density_side_by_side_apply_bit_exact():
    """Each chunk its own density (none, sparse, mask, whole, in a shuffled order, some across
    two tensors): every encoding sits next to every other, so that neither side can take the
    mask chunks' values as lying together, and the version lands bit for bit."""
    g = torch.Generator().manual_seed(4)
    base = {
        "a.bf16": torch.randn(9 * CHUNK + 123, generator=g).to(torch.bfloat16),
        "b.bf16": torch.randn(5 * CHUNK - 77, generator=g).to(torch.bfloat16),
        "c.f32": torch.randn(7 * CHUNK + 5, generator=g),
    }
    cur = {k: v.clone() for k, v in base.items()}
    shares = torch.tensor([0.0, 0.001, 0.02, 0.2, 0.6, 1.0])
    for v in cur.values():
        ints = v.view(torch.int16 if v.element_size() == 2 else torch.int32)
        for at in range(0, ints.numel(), CHUNK // 2):  # chunk halves: edges fall mid-chunk
            part = ints[at : at + CHUNK // 2]
            share = shares[torch.randint(len(shares), (1,), generator=g)]
            part[torch.rand(part.numel(), generator=g) < share] ^= 1
    apart = {k: v.clone() for k, v in base.items()}
    enc = roundtrip(base, cur, apart)
    assert same(apart, cur)
    kinds = _kinds(enc.blob)  # of the first width group
    masks = [i for i, k in enumerate(kinds) if k == MASK]
    assert set(kinds) == {SPARSE, MASK, WHOLE}, kinds
    assert masks != list(range(masks[0], masks[0] + len(masks))), kinds  # others between


@pytest.mark.parametrize("share", [0.0, 0.02, 0.5, 1.0])
def test_changes_gathered_piece_by_piece_make_the_same_blob_and_leave_the_rest(share):
    """A sharded trainer's rank compares only the pieces it writes, in its own order: the blob
    applies as the one the whole-tensor encoder makes of the same changes (is the same, unless
    dense), and elements of no piece keep the base's bytes at the subscriber."""
    base = tensors()
    cur = changed(base, share)
    layout = DeltaLayout(cur)
    pieces = []
    for k, v in cur.items():
        n = v.numel()
        pieces += [(k, 0, n // 3), (k, n // 3, n)] if n > 2 else [(k, 0, n)]
    pieces = pieces[::-1]  # not in the layout's order
    left_out = pieces.pop(0)  # one piece no rank of this test writes
    copy = {k: raw(v.clone()) for k, v in base.items()}
    found = ChangeSet(layout)
    for k, lo, hi in pieces:
        flat = cur[k].contiguous().reshape(-1)
        base_of = copy[k].view(flat.dtype)
        found.compare(k, lo, flat[lo:hi], base_of[lo:hi])
    enc = found.encode(7, 6)
    assert enc is not None
    want = {k: raw(v.clone()) for k, v in base.items()}  # only the written pieces change
    for k, a, b in pieces:  # as bytes: a bool's bytes may be any bits
        size = cur[k].element_size()
        want[k][a * size : b * size] = raw(cur[k])[a * size : b * size]
    assert all(torch.equal(copy[k], want[k]) for k in want)
    want = {k: v.view(base[k].dtype).view(base[k].shape) for k, v in want.items()}
    targets = {k: v.clone() for k, v in base.items()}
    apply(decode(layout, enc.blob, 7, 6), targets)
    assert same(targets, want)
    # every piece: the blob the whole-tensor encoder makes (which may also send a dense chunk
    # whole, unchanged values with it, where a rank sends only what changed)
    every = ChangeSet(layout)
    again = {k: raw(v.clone()) for k, v in base.items()}
    for k, lo, hi in [left_out, *pieces]:
        flat = cur[k].contiguous().reshape(-1)
        every.compare(k, lo, flat[lo:hi], again[k].view(flat.dtype)[lo:hi])
    ref = encode(layout, cur, {k: v.clone() for k, v in base.items()}, 7, 6)
    whole = every.encode(7, 6)
    assert ref is not None and whole is not None
    assert torch.equal(ref.blob, whole.blob) or share > 0.1
    targets = {k: v.clone() for k, v in base.items()}
    apply(decode(layout, whole.blob, 7, 6), targets)
    assert same(targets, cur)
    with pytest.raises(ValueError, match="past its end"):
        found.compare("c.bf16", 4, cur["c.bf16"][:2], base["c.bf16"][:2].clone())


def test_each_chunk_takes_its_smallest_encoding():
    """bfloat16 chunks: 1% changed travels as offsets (4 bytes a change), 30% as a mask and the
    values, 95% whole; the blob is at most those sizes plus tables."""
    n = 3 * CHUNK
    base = {"w": torch.zeros(n, dtype=torch.bfloat16)}
    cur = {"w": base["w"].clone()}
    cur["w"][0:CHUNK:100] = 1  # 656 changes
    cur["w"][CHUNK : 2 * CHUNK : 3] = 1  # a third
    cur["w"][2 * CHUNK : 2 * CHUNK + int(0.95 * CHUNK)] = 1
    layout = DeltaLayout(cur)
    enc = encode(layout, cur, {"w": base["w"].clone()}, 1, 0)
    assert enc is not None
    groups = decode(layout, enc.blob, 1, 0).groups
    (g,) = groups
    sparse = 656 * 4
    mask = CHUNK // 8 + len(range(CHUNK, 2 * CHUNK, 3)) * 2
    whole = CHUNK * 2
    assert enc.blob.numel() <= sparse + mask + whole + 256
    kinds = _kinds(enc.blob)
    assert kinds == [SPARSE, MASK, WHOLE]
    target = {"w": base["w"].clone()}
    apply(decode(layout, enc.blob, 1, 0), target)
    assert same(target, cur)


def _kinds(blob: torch.Tensor) -> list[int]:
    n = struct.unpack_from("<IIQQ", bytes(blob[32:56].numpy()))[1]
    at = 56 + -(-n * 4 // 8) * 8
    return blob[at : at + n].tolist()


def test_a_limit_gives_none_and_still_brings_the_base_up_to_date():
    base = tensors()
    cur = changed(base, 0.5)
    copy = {k: v.clone() for k, v in base.items()}
    assert encode(DeltaLayout(cur), cur, copy, 2, 1, limit=1000) is None
    assert same(copy, cur)


def test_a_blob_for_other_tensors_another_version_or_base_is_refused():
    base = tensors()
    cur = changed(base, 0.01)
    layout = DeltaLayout(cur)
    enc = encode(layout, cur, {k: v.clone() for k, v in base.items()}, 7, 6)
    assert enc is not None
    other = DeltaLayout({**cur, "b.f32": torch.zeros(70002)})
    with pytest.raises(DeltaError, match="other tensors"):
        decode(other, enc.blob, 7, 6)
    with pytest.raises(DeltaError, match="version 7 on base 6"):
        decode(layout, enc.blob, 8, 6)
    with pytest.raises(DeltaError, match="version 7 on base 6"):
        decode(layout, enc.blob, 7, 5)
    with pytest.raises(DeltaError, match="runs past its end"):
        decode(layout, enc.blob[:-8], 7, 6)
    with pytest.raises(DeltaError, match="past its last section"):
        decode(layout, torch.cat([enc.blob, torch.zeros(8, dtype=torch.uint8)]), 7, 6)


def _one_chunk_blob() -> tuple[DeltaLayout, torch.Tensor]:
    base = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    cur = {"w": base["w"].clone()}
    cur["w"][[3, 50, 700]] = 1
    layout = DeltaLayout(cur)
    enc = encode(layout, cur, base, 1, 0)
    assert enc is not None
    return layout, enc.blob


def _patched(blob: torch.Tensor, at: int, fmt: str, value: int) -> torch.Tensor:
    b = bytearray(blob.numpy().tobytes())
    struct.pack_into(fmt, b, at, value)
    return torch.frombuffer(b, dtype=torch.uint8)


# the one-chunk blob: header 32, group header 24, ids at 56, kinds at 64, counts at 72,
# offsets at 80 (3 x 2 bytes), values at 88
@pytest.mark.parametrize(
    "at, fmt, value, rule",
    [
        (0, "<I", 0, "not a delta"),
        (32, "<I", 4, "width"),
        (36, "<I", 99, "more chunks"),
        (56, "<i", 5, "chunk ids"),
        (56, "<i", -1, "chunk ids"),
        (64, "<B", 0, "chunk kind"),
        (64, "<B", 9, "chunk kind"),
        (64, "<B", WHOLE, "whole chunk"),
        (72, "<i", 0, "count"),
        (72, "<i", 2000, "count"),
        (80, "<H", 1000, "past the end of its chunk"),
        (82, "<H", 3, "increase strictly"),
    ],
)
def test_every_rule_of_the_format_is_checked(at, fmt, value, rule):
    layout, blob = _one_chunk_blob()
    with pytest.raises(DeltaError, match=rule):
        decode(layout, _patched(blob, at, fmt, value), 1, 0)


def test_a_mask_that_disagrees_with_its_count_or_marks_past_the_end_is_refused():
    base = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    cur = {"w": base["w"].clone()}
    cur["w"][::4] = 1  # a quarter: a mask
    layout = DeltaLayout(cur)
    enc = encode(layout, cur, base, 1, 0)
    assert enc is not None and _kinds(enc.blob) == [MASK]
    masks_at = 56 + 8 + 8 + 8  # ids, kinds, counts; no offsets
    with pytest.raises(DeltaError, match="match its chunk's count"):
        decode(layout, _patched(enc.blob, masks_at, "<B", 0), 1, 0)
    with pytest.raises(DeltaError, match="past the end of its chunk"):
        decode(layout, _patched(enc.blob, masks_at + 200, "<B", 1), 1, 0)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_corruption_is_refused_or_applies_within_the_tensors(data):
    """Bytes of a blob changed at random: decode refuses (DeltaError) or gives changes that
    apply within the tensors; nothing else ever happens."""
    layout, blob = _one_chunk_blob()
    b = bytearray(blob.numpy().tobytes())
    for _ in range(data.draw(st.integers(1, 4))):
        b[data.draw(st.integers(0, len(b) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        b = b[: data.draw(st.integers(0, len(b)))]
    try:
        decoded = decode(
            layout, torch.frombuffer(bytearray(b) or bytearray(1), dtype=torch.uint8), 1, 0
        )
    except DeltaError:
        return
    target = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    apply(decoded, target)
