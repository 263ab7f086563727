"""The LoRA mode: versions of one named adapter into vLLM's LoRA slots, from memory.

vLLM loads an adapter from a folder (``/v1/load_lora_adapter``, ``LoRARequest.lora_path``) into
its LoRA manager, a registry of ``LoRAModel`` objects by LoRA id that it copies into its LoRA
slots (the stacked A and B buffers its kernels read) when a request names the id. This mode puts
each version there itself: it receives the adapter into staging copies, builds the
``LoRAModel`` from them with vLLM's own constructor (``LoRAModel.from_lora_tensors``: packing of
q/k/v and gate/up, scaling, its dtype), and replaces the one registered under the adapter's id
(lora_spec.adapter_id), so a request naming that id is served by the new version from its next
step. No file, no pickle, no restart; the base model is not touched.

**Slices.** Under tensor parallelism vLLM's LoRA layers keep a slice of A (row-parallel layers:
their inputs) or of B (column-parallel layers: their outputs, per q/k/v or gate/up part) per
worker. :func:`learn_slices` asks each LoRA layer which slice it keeps (its own ``slice_lora_a``
and ``slice_lora_b`` over numbered probes), and the worker declares only those slices: the
trainer writes it nothing else. At install the slice is put back at its place in a tensor of
the full shape, whose other elements vLLM's slicing drops.

Rules:

* A version is installed whole or not at all, inside one worker call (vLLM runs no engine step
  meanwhile): never A of one version with B of another. It is installed only once complete.
* The adapter must fit: its rank at most vLLM's ``max_lora_rank``, its targets modules vLLM
  applies LoRA to, a free place in vLLM's adapter registry (``max_cpu_loras``); else the install
  fails naming the limit and the adapter keeps its previous version.
* vLLM removes every adapter at the end of one of its weight updates (it assumes the base
  changed): a server that serves these adapters takes base updates through transport only with
  the adapters published again after (see the README).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from transport import WeightSubscriber
from transport.integrations.vllm.checkpoint import checkpoint_spec
from transport.integrations.vllm.infos import AdapterState, TransportInitInfo, TransportUpdateInfo
from transport.integrations.vllm.lora_spec import AdapterConfig, adapter_id, lora_spec
from transport.integrations.vllm.modes.base import Held, Staging, Worker
from transport.integrations.vllm.room import Room
from transport.integrations.vllm.shards import WorkerLayout, spec_of
from transport.weights import DestTensor, Piece, Slice


def lora_manager(model: Any) -> Any:
    """vLLM's LoRA manager of ``model`` (it sets ``model.lora_manager`` when LoRA is on)."""
    manager = getattr(model, "lora_manager", None)
    if manager is None:
        raise ValueError(
            "transport adapter: this vLLM serves without LoRA; start it with --enable-lora "
            "(LLM(enable_lora=True)) and a --max-lora-rank at least the adapter's rank"
        )
    return manager


def learn_slices(model: Any, spec: Mapping[str, torch.Tensor]) -> WorkerLayout:
    """The layout this worker declares for the adapter tensors ``spec``: of each, the slice its
    LoRA layer keeps (whole where it keeps all, or where the layer is not tensor-parallel).
    ValueError naming a tensor no LoRA layer of vLLM takes."""
    manager = lora_manager(model)
    dest: dict[str, DestTensor] = {}
    for module, layer in manager.modules.items():
        subs = manager.packed_modules.get(module, [module])
        a = [_probe(spec.get(f"{s}.lora_A.weight")) for s in subs]
        b = [_probe(spec.get(f"{s}.lora_B.weight")) for s in subs]
        if all(x is None for x in a):
            continue
        if getattr(layer, "tp_size", 1) > 1:  # vLLM slices what it is given per worker
            if len(subs) > 1:
                a, b = list(layer.slice_lora_a(a)), list(layer.slice_lora_b(b))
            else:
                a, b = [layer.slice_lora_a(a[0])], [layer.slice_lora_b(b[0])]
        for sub, kept_a, kept_b in zip(subs, a, b, strict=True):
            for ab, kept in (("A", kept_a), ("B", kept_b)):
                name = f"{sub}.lora_{ab}.weight"
                if name in spec and kept is not None:
                    dest[name] = _slice(name, spec[name], kept)
    missing = [n for n in spec if n not in dest]
    if missing:
        raise ValueError(
            f"transport adapter: vLLM applies no LoRA to {missing[:4]}"
            + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            + " in this model; target only the modules vLLM adapts (its linear layers)"
        )
    ordered = {n: dest[n] for n in spec}
    return WorkerLayout(ordered, {}, {})


def _probe(meta: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor of ``meta``'s shape numbering its elements (float64: exact below 2**53)."""
    if meta is None:
        return None
    n = meta.numel()
    return torch.arange(n, dtype=torch.float64).view(meta.shape)


def _slice(name: str, meta: torch.Tensor, kept: torch.Tensor) -> DestTensor:
    """The DestTensor of the elements of ``name`` that ``kept`` (a probe, sliced) holds: the
    whole tensor, or one range along one dim."""
    rows, cols = meta.shape
    flat = kept.to(torch.int64)
    r0, c0 = divmod(int(flat[0, 0]), cols) if flat.numel() else (0, 0)
    h, w = flat.shape
    box = (torch.arange(r0, r0 + h).unsqueeze(1) * cols + torch.arange(c0, c0 + w)).to(torch.int64)
    if flat.shape != box.shape or not torch.equal(flat, box):
        raise ValueError(f"transport adapter: vLLM keeps a slice of {name} that is not one box")
    if (h, w) == (rows, cols):
        return DestTensor((rows, cols), meta.dtype, (Piece(name),))
    if w == cols:
        return DestTensor((h, cols), meta.dtype, (Piece(name, Slice(0, r0, r0 + h)),))
    if h == rows:
        return DestTensor((rows, w), meta.dtype, (Piece(name, Slice(1, c0, c0 + w)),), dim=1)
    raise ValueError(f"transport adapter: vLLM keeps a slice of {name} along both dims")


class Adapter(Staging):
    """One named adapter of this worker: a staging WeightSubscriber of its group (two slots: the
    next version lands while one is held) and the adapter's place in vLLM's LoRA manager. Rules:
    :meth:`receive` waits for a complete version and holds it; :meth:`finish` installs it (the
    previous version stays registered until the new one replaces it in one call);
    :meth:`remove` takes the adapter out of vLLM."""

    name = "lora"

    def __init__(
        self, worker: Worker, layout: WorkerLayout, adapter: str, config: AdapterConfig
    ) -> None:
        super().__init__(worker, layout)
        self.adapter = adapter
        self.config = config
        self.id = adapter_id(worker.info.namespace, adapter)
        #: the version vLLM serves under the adapter's id (None: none yet)
        self.version: int | None = None
        self._full = {n: tuple(t.shape) for n, t in worker.spec.items()}
        self.subscriber = WeightSubscriber(
            worker.transport,
            spec_of(layout),
            group=worker.info.group,
            mode="staging",
            staging_device="cpu",
            layout=layout.dest,
            source_shapes=self._full,
            slots=2,
        )

    @property
    def need(self) -> int:
        return 2 * self.layout.nbytes

    def finish(self) -> int | None:
        snap = self.snapshot
        if snap is None:
            return None
        try:
            self._install(snap.tensors)
        finally:
            self.drop()
        self.version = snap.version
        return snap.version

    def _install(self, tensors: Mapping[str, torch.Tensor]) -> None:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = lora_manager(self.worker.model)
        if manager.get_adapter(self.id) is None and len(manager) >= manager.capacity:
            raise RuntimeError(
                f"transport adapter {self.adapter!r}: vLLM's adapter registry is full "
                f"({len(manager)} of --max-cpu-loras {manager.capacity}); raise --max-cpu-loras "
                "or remove an adapter"
            )
        helper = PEFTHelper.from_dict({**self.config.peft(), "vllm_max_position_embeddings": None})
        helper.validate_legal(manager.lora_config)
        full = {}
        for name, got in tensors.items():  # copies: the staging slot takes later versions
            piece = self.layout.dest[name].pieces[0].take
            if piece.dim is None:
                whole = got.clone()
            else:
                whole = torch.zeros(self._full[name], dtype=got.dtype)
                whole.narrow(piece.dim, piece.start, piece.stop - piece.start).copy_(got)
            full[f"base_model.model.{name}"] = whole
        mapper = getattr(self.worker.model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            self.id,
            full,
            helper,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=getattr(manager, "vocab_size", None),
            weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        )
        # one call of vLLM's worker: no engine step sees the adapter half replaced
        manager.remove_adapter(self.id)
        manager.add_adapter(lora)
        if self.worker.device.type == "cuda":
            torch.cuda.synchronize(self.worker.device)

    def remove(self) -> None:
        """Take the adapter out of vLLM's registry and slots (requests naming it then fail)."""
        manager = getattr(self.worker.model, "lora_manager", None)
        if manager is not None:
            manager.remove_adapter(self.id)
        self.version = None

    def held(self) -> Held:
        sub, snap = self.subscriber, self.snapshot
        return Held(
            held=None if snap is None else snap.version,
            complete=sub.version,
            incomplete=sub.incomplete,
            slots=len(sub.staging),
            nbytes=2 * self.layout.nbytes,
        )

    def close(self) -> None:
        self.drop()
        self.subscriber.close()


def adapter_key(namespace: str, adapter: str) -> str:
    """How a worker names an adapter: tenants' namespaces may use the same adapter names."""
    return f"{namespace}/{adapter}"


class Adapters:
    """The LoRA adapters of one vLLM worker, by namespace and name (:func:`adapter_key`). It owns each adapter's mode and one
    Transport per store and namespace they use (a tenant's namespace, with its own secret: see
    setup.secret_from_env), closed with the last adapter on it. Rules: an init of an adapter
    joins it, is a no-op when nothing changed, and otherwise replaces that adapter's receiver
    (saying what changed: rank, alpha, targets, group) while vLLM keeps serving the version it
    installed until a version of the new config installs; the base model's group and other
    adapters are never touched. Two adapters whose LoRA ids collide are refused."""

    def __init__(self, model: Any, model_config: Any, device: torch.device, prefix: str) -> None:
        self.model = model
        self.model_config = model_config
        self.device = device
        self.prefix = prefix
        self.modes: dict[str, Adapter] = {}
        self._keys: dict[str, tuple[Any, ...]] = {}
        self._transports: dict[tuple[str, str], Any] = {}

    def join(self, info: TransportInitInfo) -> str:
        """Join (or replace) adapter ``info.adapter``; returns what happened, for the log."""
        from transport.integrations.setup import connect

        assert info.adapter is not None
        info.check_proof()
        name = adapter_key(info.namespace, info.adapter)
        key = info.adapter_key()
        if self._keys.get(name) == key:
            return "unchanged"
        config = info.adapter_config()
        lora_id = adapter_id(info.namespace, info.adapter)
        clash = [n for n, m in self.modes.items() if n != name and m.id == lora_id]
        if clash:
            raise ValueError(
                f"transport adapter {name!r} would be served under the LoRA id of adapter "
                f"{clash[0]!r}; rename one of them"
            )
        lora_manager(self.model)  # refuses a vLLM without LoRA, saying how to turn it on
        dtype = getattr(torch, info.dtype) if info.dtype else torch.float32
        base = checkpoint_spec(self.model_config.hf_config, dtype)
        spec = lora_spec(base, config, dtype)
        layout = learn_slices(self.model, spec)
        old = self.modes.pop(name, None)
        self._keys.pop(name, None)
        why = "joined"
        if old is not None:
            changed = config.differences(old.config) + (
                [f"group {old.group} -> {info.group}"] if old.group != info.group else []
            )
            why = f"replaced ({', '.join(changed) or 'store or timeout'})"
            old.close()  # its group's channel first: the new receiver may take the same group
        where = (info.store, info.namespace)
        t = self._transports.get(where)
        if t is None:
            t = connect(
                f"{self.prefix}-{info.namespace}",
                store=info.store,
                namespace=info.namespace,
                timeout=info.timeout,
                hint="the store of the adapter's init_info",
            )
            self._transports[where] = t
        room = Room(2 * layout.nbytes, "two staging copies of an adapter's slices")
        worker = Worker(
            t, info, self.model, self.model_config, self.device, torch.device("cpu"), room, spec
        )
        try:
            mode = Adapter(worker, layout, info.adapter, config)
        except BaseException:
            self._release(where)
            raise
        finally:
            if old is not None:  # its Transport, unless the new receiver uses it
                self._release((old.worker.info.store, old.worker.info.namespace), keep=where)
        # vLLM serves the version it installed until a version of this config lands
        mode.version = None if old is None else old.version
        self.modes[name], self._keys[name] = mode, key
        return why

    def update(self, update: TransportUpdateInfo) -> int | None:
        """Install the version ``update`` names of adapter ``update.adapter`` (waiting for it
        to be complete); returns it."""
        name = adapter_key(update.namespace, update.adapter or "")
        mode = self.modes.get(name)
        if mode is None:
            raise RuntimeError(
                f"transport adapter {name!r} was not initialized on this worker: call "
                "init_weight_transfer_engine with its adapter, rank, alpha and targets first"
            )
        mode.receive(update)
        return mode.finish()

    def remove(self, namespace: str, adapter: str) -> bool:
        """Take ``adapter`` of ``namespace`` out of vLLM and leave its group; False when there is
        none."""
        name = adapter_key(namespace, adapter)
        mode = self.modes.get(name)
        if mode is None:
            return False
        mode.remove()
        self._drop(name)
        return True

    def state(self) -> dict[str, AdapterState]:
        manager = getattr(self.model, "lora_manager", None)
        out = {}
        for name, m in self.modes.items():
            held = m.held()
            out[name] = AdapterState(
                namespace=m.worker.info.namespace,
                group=m.group,
                lora_id=m.id,
                version=m.version,
                registered=manager is not None and manager.get_adapter(m.id) is not None,
                complete=held.complete,
                version_bytes=m.layout.nbytes,
                rank=m.config.rank,
                alpha=m.config.alpha,
                targets=m.config.targets,
            )
        return out

    def close(self) -> None:
        for name in list(self.modes):
            self._drop(name)

    def _drop(self, name: str) -> None:
        mode = self.modes.pop(name)
        self._keys.pop(name, None)
        mode.close()
        info = mode.worker.info
        self._release((info.store, info.namespace))

    def _release(self, where: tuple[str, str], keep: tuple[str, str] | None = None) -> None:
        """Close the Transport of ``where`` once no adapter uses it (and it is not ``keep``)."""
        if where == keep or any(
            (m.worker.info.store, m.worker.info.namespace) == where for m in self.modes.values()
        ):
            return
        t = self._transports.pop(where, None)
        if t is not None:
            t.close()
