"""Where vLLM's loader puts each checkpoint tensor in this worker, learned by replaying it once.

A vLLM worker computes with its own tensor-parallel slice of every column- and row-parallel
weight, q/k/v and gate/up fused, the vocabulary split and padded; the checkpoint holds whole
tensors. :func:`learn` replays the model's own ``load_weights`` over **probe** tensors into
float64 stand-ins of the parameters in the format vLLM's loaders write (its reload bookkeeping
keeps them as meta tensors), filled with -1. Every checkpoint element has a number (float64 is
exact to 2**53); a probe is one line expanded to the tensor's shape, so it costs no memory, and
each tensor goes through the loader once per dim: pass 0 carries its rows (numbered across
tensors, which tells them apart), pass ``d`` its index along dim ``d``. Afterwards the passes
say, for every element of a stand-in, which checkpoint element the loader put there, -1 where
it put nothing, and anything else where it computed something (a padding zero, a scaled value).
A loader that cannot take an expanded probe gets it materialized.

Each parameter is then written as a :class:`~transport.weights.layouts.DestTensor` over the
checkpoint tensors (slices along one dim, stacked: its TP shard, its part of fused q/k/v and
gate/up, a whole replicated copy), and the layout is **checked against the replay**: the map
the pieces describe must equal the map the loader made, element for element, or the
parameter is not mapped. A parameter whose checkpoint elements fill leading rows and whose
remaining rows the loader left unfilled or zero (the vocabulary padding) is the filled rows.
What cannot be mapped (a loader that computes values, fills a parameter partly, writes one
element from two tensors, or raised) is named in :attr:`WorkerLayout.fallback`, and every
checkpoint tensor feeding it travels whole and goes through vLLM's loader: never silently
wrong, only more bytes.

The replay runs one decoder layer at a time (the layer's stand-ins are real, every other
parameter a meta tensor, where a stray write goes nowhere and shows as unmapped), and each map is
judged as soon as its layer is done: it holds one layer's parameters in float64 per pass, once
per worker at init. The live parameters are put back exactly as they were, even after an error.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from transport.weights import DestTensor, Piece, Slice

log = logging.getLogger(__name__)

_LAYER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class Target:
    """One parameter of vLLM's model filled from the checkpoint: ``holders``, the full names
    that hold it (tied parameters: several), its ``shape`` in the format vLLM's loaders write
    and its ``dtype``; the checkpoint fills its first ``rows`` rows (the rest is padding, zero).
    Its destination tensor in the layout is those rows, or the whole parameter viewed with its
    leading dims merged when it is made of tensors of fewer dims (one tensor per expert)."""

    holders: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: int


@dataclass(frozen=True)
class WorkerLayout:
    """What one worker takes of each version: ``dest``, the layout it declares (name ->
    DestTensor over the checkpoint tensors), of which ``targets`` are its own parameters
    (written straight in, by a direct loader) and the rest are checkpoint tensors taken whole
    for vLLM's loader, each named in ``fallback`` with the reason."""

    dest: dict[str, DestTensor]
    targets: dict[str, Target]
    fallback: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of one version this worker receives."""
        return sum(math.prod(d.shape) * d.dtype.itemsize for d in self.dest.values())


def whole(spec: Mapping[str, torch.Tensor], why: str) -> WorkerLayout:
    """Every checkpoint tensor whole, for vLLM's loader (the checkpoint path), with ``why``."""
    dest = {n: DestTensor(tuple(t.shape), t.dtype, (Piece(n),)) for n, t in spec.items()}
    return WorkerLayout(dest, {}, dict.fromkeys(spec, why))


def learn(model: torch.nn.Module, spec: Mapping[str, torch.Tensor]) -> WorkerLayout:
    """Replay ``model.load_weights`` over probes of the checkpoint tensors ``spec`` (meta
    tensors: names, shapes, dtypes) and return this worker's layout (see the module's doc)."""
    params = _loader_format(model)
    if params is None:
        return whole(spec, "vLLM recorded no loader format for this model (no reload metadata)")
    numbering = _Numbering(spec)
    if numbering.total >= 2**53:
        return whole(spec, "the checkpoint has more elements than a float64 probe counts exactly")
    judged = _Judged(spec, numbering.offsets)
    raised: dict[str, str] = {}
    groups: dict[int | None, list[str]] = {}
    for name in spec:
        groups.setdefault(_layer_of(name), []).append(name)
    with _stand_ins(model, params) as stand:
        for group, names in groups.items():
            mine = [p for p in params.firsts if _layer_of(p) == group]
            stand.make_real(mine)
            passes = []
            for dim in range(max(max(spec[n].dim(), 1) for n in names)):
                stand.reset(mine)
                for name in names:
                    if dim == 0 or spec[name].dim() > dim:
                        _replay(model, name, numbering.probe(name, dim), raised)
                passes.append({p: stand.values(p) for p in mine})
            for p in mine:
                judged.add(p, numbering.numbers([x[p] for x in passes]), params)
            stand.make_meta(mine)
    return judged.layout(raised)


def _replay(model: Any, name: str, probe: torch.Tensor, raised: dict[str, str]) -> None:
    """One checkpoint tensor through the model's loader; a loader that cannot take an expanded
    probe (a view of one line) gets it materialized; one that raises makes it fall back."""
    try:
        model.load_weights([(name, probe)])
        return
    except Exception:  # some loaders reshape with view(), which an expanded probe refuses
        pass
    try:
        model.load_weights([(name, probe.contiguous())])
    except Exception as e:
        raised.setdefault(name, f"vLLM's loader raised {type(e).__name__}: {e}")


class _Numbering:
    """The numbers the probes carry. Checkpoint element ``i`` of tensor ``n`` is number
    ``offsets[n] + i`` (from 1: 0 and -1 are never an element). A probe is one line expanded to
    the tensor's shape (no memory): pass 0 carries ``rows[n] + index along dim 0`` (which also
    tells the tensors apart), pass ``d`` carries ``index along dim d + 1``; :meth:`numbers`
    puts an element's number together from the passes."""

    def __init__(self, spec: Mapping[str, torch.Tensor]) -> None:
        self.names = list(spec)
        self.offsets: dict[str, int] = {}
        self.rows: dict[str, int] = {}
        at = row = 1
        for name, t in spec.items():
            self.offsets[name], self.rows[name] = at, row
            at += t.numel()
            row += t.shape[0] if t.dim() else 1
        self.total = at
        self.ndim = max([t.dim() for t in spec.values()] + [1])
        shapes = [tuple(t.shape) or (1,) for t in spec.values()]
        self.sizes = np.array([list(s) + [1] * (self.ndim - len(s)) for s in shapes], np.int64)
        self.strides = np.array([_strides(s) for s in self.sizes.tolist()], np.int64)
        self.dims = np.array([t.dim() for t in spec.values()], np.int64)
        self.row_at = np.array([self.rows[n] for n in self.names], np.int64)
        self.at = np.array([self.offsets[n] for n in self.names], np.int64)
        self.spec = spec

    def probe(self, name: str, dim: int) -> torch.Tensor:
        shape = tuple(self.spec[name].shape)
        if not shape:
            return torch.tensor(float(self.rows[name]), dtype=torch.float64)
        line = torch.arange(shape[dim], dtype=torch.float64) + (self.rows[name] if dim == 0 else 1)
        view = [1] * len(shape)
        view[dim] = shape[dim]
        return line.view(view).expand(shape)

    def numbers(self, passes: list[torch.Tensor]) -> torch.Tensor:
        """A stand-in's element numbers from its passes: -1 where nothing was written, the
        loader's own value where pass 0 holds no element (0: padding), 0.5 where the passes
        disagree or hold values no probe carries (the loader computed them)."""
        first = passes[0].reshape(-1).numpy()
        out = first.copy()
        idx = np.nonzero(first >= 1)[0]
        v = first[idx]
        ok = v == np.floor(v)
        src = np.clip(np.searchsorted(self.row_at, v.astype(np.int64), side="right") - 1, 0, None)
        index = v.astype(np.int64) - self.row_at[src]
        ok &= index < self.sizes[src, 0]
        number = self.at[src] + index * self.strides[src, 0]
        for d in range(1, self.ndim):
            has = self.dims[src] > d
            if d < len(passes):
                c = passes[d].reshape(-1).numpy()[idx] - 1
            else:
                c = np.full(len(idx), -1.0)
            ok &= ~has | ((c == np.floor(c)) & (c >= 0) & (c < self.sizes[src, d]))
            number += np.where(has & ok, c.astype(np.int64), 0) * self.strides[src, d]
        out[idx] = np.where(ok, number, 0.5)
        for later in passes[1:]:  # written only by a later pass: not a copy of one element
            out[(first < 1) & (later.reshape(-1).numpy() >= 1)] = 0.5
        return torch.from_numpy(out).view(passes[0].shape)


@dataclass
class _Params:
    """The model's parameters in loader format: per distinct parameter (its first name), the
    (module, attribute) of every name holding it and the template tensor (vLLM's meta copy)."""

    holders: dict[str, list[tuple[torch.nn.Module, str]]]
    names: dict[str, list[str]]
    template: dict[str, torch.Tensor]

    @property
    def firsts(self) -> list[str]:
        return list(self.template)


def _loader_format(model: torch.nn.Module) -> _Params | None:
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    first: dict[int, str] = {}
    out = _Params({}, {}, {})
    for mod_name, module in model.named_modules():
        live = dict(module.named_parameters(recurse=False))
        if not live:
            continue
        recorded, _ = get_layerwise_info(module).restore_metadata
        for attr, param in live.items():
            template = recorded.get(attr)
            if template is None:
                if attr != "bias":  # vLLM records every parameter but the bias (built later)
                    return None
                template = param
            else:
                template = restore_layer_refs(template, module)
            full = f"{mod_name}.{attr}" if mod_name else attr
            key = first.setdefault(id(param), full)
            out.holders.setdefault(key, []).append((module, attr))
            out.names.setdefault(key, []).append(full)
            out.template.setdefault(key, template)
    return out


class _StandIns:
    """Float64 stand-ins registered in place of the live parameters (real for the layer being
    replayed, meta for the rest); remembers the live ones to put back."""

    def __init__(self, params: _Params) -> None:
        self.params = params
        self.live: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
        self.real: dict[str, torch.Tensor] = {}

    def _stand_in(self, key: str, device: str) -> torch.Tensor:
        template = self.params.template[key]
        t = torch.full(tuple(template.shape), -1.0, dtype=torch.float64, device=device)
        t.__class__ = template.__class__  # vLLM's parameter classes load through their methods
        t.__dict__ = template.__dict__.copy()
        loader = getattr(t, "weight_loader", None)  # an attribute, or a property of vLLM's
        if loader is not None and loader is not original_loader(loader):
            t.weight_loader = original_loader(loader)  # type: ignore[attr-defined]
        return t

    def _register(self, key: str, tensor: torch.Tensor) -> None:
        for module, attr in self.params.holders[key]:
            module.register_parameter(attr, tensor)  # type: ignore[arg-type]

    def make_real(self, keys: list[str]) -> None:
        for key in keys:
            self.real[key] = self._stand_in(key, "cpu")
            self._register(key, self.real[key])

    def make_meta(self, keys: list[str]) -> None:
        for key in keys:
            self.real.pop(key, None)
            self._register(key, self._stand_in(key, "meta"))

    def reset(self, keys: list[str]) -> None:
        with torch.no_grad():
            for key in keys:
                self.real[key].fill_(-1.0)

    def values(self, key: str) -> torch.Tensor:
        return self.real[key].detach().as_subclass(torch.Tensor).clone()


@contextmanager
def _stand_ins(model: torch.nn.Module, params: _Params) -> Iterator[_StandIns]:
    stand = _StandIns(params)
    for holders in params.holders.values():
        for module, attr in holders:
            stand.live.append((module, attr, getattr(module, attr)))
    try:
        stand.make_meta(params.firsts)
        yield stand
    finally:
        for module, attr, param in stand.live:
            module.register_parameter(attr, param)


def original_loader(loader: Any) -> Any:
    """``loader`` without vLLM's layerwise-reload wrappers (which a reload leaves on its
    bookkeeping tensors, and which load nothing outside a reload)."""
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def _strides(shape: list[int]) -> tuple[int, ...]:
    """The element strides of a contiguous tensor of ``shape``."""
    return torch.empty(shape, device="meta").stride()


def _layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


# -- from the replay's maps to a layout ----------------------------------------------------------


def _layout(
    spec: Mapping[str, torch.Tensor],
    offsets: dict[str, int],
    params: _Params,
    maps: dict[str, torch.Tensor],
    raised: dict[str, str],
) -> WorkerLayout:
    """The layout that the replay's ``maps`` (parameter -> element numbers) describe."""
    judged = _Judged(spec, offsets)
    for key, m in maps.items():
        judged.add(key, m, params)
    return judged.layout(raised)


class _Judged:
    """What the replay said of each parameter so far (its map is judged as it comes, then let
    go: only the verdicts stay): the tensors that filled it, and its DestTensor and Target or
    why it is not mapped."""

    def __init__(self, spec: Mapping[str, torch.Tensor], offsets: dict[str, int]) -> None:
        self.spec, self.offsets = spec, offsets
        self.names = list(spec)
        self.starts = np.array([offsets[n] for n in self.names], dtype=np.int64)
        self.fed_by: dict[str, set[str]] = {}
        self.made: dict[str, tuple[DestTensor, Target]] = {}
        self.bad: dict[str, str] = {}  # parameter -> why it is not mapped

    def add(self, key: str, m: torch.Tensor, params: _Params) -> None:
        flat = m.reshape(-1).numpy()
        written = flat >= 1
        if not written.any():
            return
        ids = np.searchsorted(self.starts, flat[written].astype(np.int64), side="right") - 1
        self.fed_by[key] = {self.names[i] for i in np.unique(ids)}
        fed = {self.spec[n].dim() for n in self.fed_by[key]}
        try:
            self.made[key] = _derive(
                key, m, self.spec, self.names, self.starts, self.offsets, params, fed
            )
        except _Unmapped as e:
            self.bad[key] = str(e)

    def layout(self, raised: dict[str, str]) -> WorkerLayout:
        fallback = dict(raised)
        fed = set().union(*self.fed_by.values()) if self.fed_by else set()
        for name in self.spec:
            if name not in fed and name not in fallback:
                fallback[name] = "vLLM's loader put none of it into a parameter of this worker"
        for key, why in self.bad.items():
            for s in sorted(self.fed_by.get(key, ())):
                fallback.setdefault(s, f"it fills {key}, which {why}")
        dest = {key: d for key, (d, _) in self.made.items() if key not in self.bad}
        targets = {key: t for key, (_, t) in self.made.items() if key not in self.bad}
        return fall_back(WorkerLayout(dest, targets), self.spec, fallback)


def fall_back(
    layout: WorkerLayout, spec: Mapping[str, torch.Tensor], reasons: Mapping[str, str]
) -> WorkerLayout:
    """``layout`` with the checkpoint tensors of ``reasons`` (name -> why) taken whole for
    vLLM's loader: a parameter one of them fills goes through the loader too, and so does every
    other tensor that fills it (a parameter loads one way), until nothing changes."""
    fallback = {**layout.fallback, **reasons}
    dest, targets = dict(layout.dest), dict(layout.targets)
    changed = True
    while changed:
        changed = False
        for key in list(targets):
            sources = {p.source for p in dest[key].pieces}
            whole_ones = sorted(sources & set(fallback))
            if not whole_ones:
                continue
            del targets[key], dest[key]
            for s in sorted(sources - set(fallback)):
                fallback[s] = f"it fills {key} with {whole_ones[0]}, which travels whole"
            changed = True
    for name, why in sorted(fallback.items()):
        if name in targets:  # a checkpoint name that is also a parameter's: keep both apart
            raise RuntimeError(f"checkpoint tensor {name!r} and a parameter share a name ({why})")
        t = spec[name]
        dest[name] = DestTensor(tuple(t.shape), t.dtype, (Piece(name),))
        log.info("vLLM worker: checkpoint tensor %s travels whole (%s)", name, why)
    return WorkerLayout(dest, targets, fallback)


class _Unmapped(Exception):
    """A parameter whose replay map no layout of slices describes (the message says why)."""


def _derive(
    key: str,
    m: torch.Tensor,
    spec: Mapping[str, torch.Tensor],
    names: list[str],
    starts: np.ndarray,
    offsets: dict[str, int],
    params: _Params,
    fed: set[int],
) -> tuple[DestTensor, Target]:
    """The parameter ``key`` (its replay map ``m``) as a stack of checkpoint slices along one
    dim; fed by tensors of fewer dims (``fed``: their dims), such as one tensor per expert
    matrix into vLLM's 3-D experts, as that stack over the parameter with its leading dims
    merged (``[experts * 2 x intermediate, hidden]``): the same memory, received as that view."""
    template = params.template[key]
    shape = tuple(m.shape)
    if not shape:
        raise _Unmapped("is a scalar")
    flat = m.view(-1)
    if (
        not torch.equal(flat, flat.round())
        or flat.max().item() >= starts[-1] + spec[names[-1]].numel()
    ):
        raise _Unmapped("holds values the loader computed rather than copied")
    filled = (m >= 1).reshape(shape[0], -1)
    rows = int(filled.all(dim=1).sum().item())
    if not filled[:rows].all() or filled[rows:].any():
        raise _Unmapped("is filled partly (not whole leading rows)")
    rest = m[rows:]
    if rest.numel() and not bool(((rest == 0) | (rest == -1)).all()):
        raise _Unmapped("has rows past the checkpoint's that the loader filled")
    body = m[:rows].to(torch.int64)
    views = [body]
    if len(fed) == 1 and 0 < min(fed) < body.dim() and rows == shape[0]:
        k = min(fed)
        views.append(body.reshape(-1, *shape[len(shape) - k + 1 :]))
    # slabs of sources along one dim first; then whole sources cut along another dim
    for cut in (False, True):
        for view in views:
            for dim in range(view.dim()):
                pieces = _pieces(view, dim, spec, names, starts, offsets, cut)
                if pieces is not None:
                    d = DestTensor(tuple(view.shape), template.dtype, tuple(pieces), dim)
                    return d, Target(tuple(params.names[key]), shape, template.dtype, rows)
    raise _Unmapped("is no stack of checkpoint slices along one dim")


def _pieces(
    body: torch.Tensor,
    dim: int,
    spec: Mapping[str, torch.Tensor],
    names: list[str],
    starts: np.ndarray,
    offsets: dict[str, int],
    cut: bool = False,
) -> list[Piece] | None:
    """The pieces along ``dim`` that make ``body`` (checkpoint element numbers), checked
    element for element; None when no such pieces make it. A piece is a run of a source's
    slabs along ``dim``, or (``cut``) a whole source cut along one other dim (a
    tensor-parallel slice of one expert's matrix, stacked with the other experts' along
    ``dim``)."""
    slabs = body.movedim(dim, 0).reshape(body.shape[dim], -1)
    heads = slabs[:, 0].numpy()
    ids = np.searchsorted(starts, heads, side="right") - 1
    pieces: list[Piece] = []
    k = 0
    while k < len(heads):
        src = names[int(ids[k])]
        shape = tuple(spec[src].shape)
        if len(shape) != body.dim():
            return None
        cuts = [
            j for j, (a, b) in enumerate(zip(shape, body.shape, strict=True)) if j != dim and a != b
        ]
        if cuts and not cut:
            return None
        if cuts:
            piece = _cut_piece(src, shape, body, dim, cuts, int(heads[k]) - offsets[src], k)
            if piece is None or k + shape[dim] > len(heads):
                return None
            pieces.append(piece)
            k += shape[dim]
            continue
        stride = math.prod(shape[dim + 1 :])
        row, within = divmod(int(heads[k]) - offsets[src], stride)
        if within or row >= shape[dim]:
            return None  # the slab does not start a slab of the source along ``dim``
        n = 1
        while (
            k + n < len(heads)
            and ids[k + n] == ids[k]
            and row + n < shape[dim]
            and heads[k + n] == heads[k] + n * stride
        ):
            n += 1
        # a whole source says so (Slice()): the publisher then checks its shape, not a range
        take = Slice() if (row, n) == (0, shape[dim]) else Slice(dim, row, row + n)
        pieces.append(Piece(src, take, k))
        k += n
    expect = torch.cat([_numbers(p, spec, offsets) for p in pieces], dim=dim)
    return pieces if torch.equal(expect, body) else None


def _cut_piece(
    src: str,
    shape: tuple[int, ...],
    body: torch.Tensor,
    dim: int,
    cut: list[int],
    first: int,
    at: int,
) -> Piece | None:
    """The piece of ``src`` that starts at its element ``first``: the whole source along
    ``dim``, cut along the one other dim (``cut``) where it is larger than ``body``."""
    if len(cut) != 1:
        return None
    (t,) = cut
    coord = np.unravel_index(first, shape) if 0 <= first < math.prod(shape) else None
    if coord is None or any(int(c) for j, c in enumerate(coord) if j != t):
        return None
    lo = int(coord[t])
    hi = lo + int(body.shape[t])
    return Piece(src, Slice(t, lo, hi), at) if hi <= shape[t] else None


def _numbers(p: Piece, spec: Mapping[str, torch.Tensor], offsets: dict[str, int]) -> torch.Tensor:
    """The checkpoint element numbers piece ``p`` stands for, in its shape (built for the
    slice alone: never the size of its whole source)."""
    shape = [int(n) for n in spec[p.source].shape]
    out = torch.tensor(offsets[p.source], dtype=torch.int64)
    for k, (n, stride) in enumerate(zip(shape, _strides(shape), strict=True)):
        lo, hi = (p.take.start, p.take.stop) if p.take.dim == k else (0, n)
        view = [1] * len(shape)
        view[k] = hi - lo
        out = out + (torch.arange(lo, hi, dtype=torch.int64) * stride).view(view)
    return out


def spec_of(layout: WorkerLayout) -> dict[str, Any]:
    """Meta tensors of the layout's destination tensors (what the worker's subscriber takes)."""
    return {n: torch.empty(d.shape, dtype=d.dtype, device="meta") for n, d in layout.dest.items()}
