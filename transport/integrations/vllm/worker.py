"""The inference side: a vLLM weight-transfer engine that receives versions through transport."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from transport import Transport, TransportError, VersionGoneError, WeightSubscriber
from transport.integrations.vllm.checkpoint import checkpoint_spec
from transport.integrations.vllm.inplace import live_tensors, refusals
from transport.integrations.vllm.reload import (
    direct_loaders,
    load_direct,
    load_tied,
    tied_parameters,
    unloaded_layers,
)
from transport.integrations.vllm.shards import WorkerLayout, learn, spec_of, whole
from transport.weights import Snapshot, WindowedSubscriber

log = logging.getLogger("transport.vllm")

#: environment variable holding the namespace secret (never sent through vLLM's APIs)
SECRET_ENV = "TRANSPORT_SECRET"
#: the version a worker reports after an update that did not reach every layer
TORN = -2
#: what a worker may receive: chosen, its TP slice in vLLM's format (staged, or straight into
#: the parameters it computes with), or checkpoint tensors whole
MODES = ("auto", "sharded", "inplace", "whole")
#: the values of a worker's update mark (see update_key)
OPEN, CLOSED = b"open", b"closed"


def update_key(namespace: str, group: str, peer: str) -> str:
    """The store key where worker ``peer`` marks (signed) whether vLLM has an update open on it:
    ``open`` from ``start_weight_update`` until a finish succeeds or an update call fails, as
    vLLM's own flag. A trainer reads it before starting: an update its predecessor left open is
    closed first, without provoking vLLM's error (with several workers, vLLM's executor reads
    only the first worker's error reply and hands the others to the calls that follow)."""
    return f"transport/{namespace}/groups/{group}/vllm-update/{peer}"


def mode_key(namespace: str, group: str, peer: str) -> str:
    """The store key where worker ``peer`` says (signed, at init) the mode it chose: a trainer
    publishes to workers in place while it drives their update (they are written only inside
    ``finish_weight_update``), to the others before."""
    return f"transport/{namespace}/groups/{group}/vllm-mode/{peer}"


@dataclass
class TransportInitInfo(WeightTransferInitInfo):
    """Where a vLLM worker finds the trainer (small JSON: it also travels over HTTP).

    ``store`` is the store URL the trainer uses (``tcp://host:port`` or ``redis://...``),
    ``namespace`` and ``group`` those of its publisher. ``dtype`` is the dtype the trainer
    publishes (default: the model's; the sharded mode receives in the model's own dtype, the
    whole mode in this one). ``mode`` says what this worker receives: ``"sharded"`` only what it
    keeps (its TP slice of every parameter, in vLLM's format) into staging memory,
    ``"inplace"`` the same straight into the parameters vLLM computes with (no staging; only
    where every parameter is used as stored, see inplace.py; written only inside
    ``finish_weight_update``), ``"whole"`` every checkpoint tensor whole (vLLM's loader shards
    them), ``"auto"`` (default) sharded, or in place when one staging copy would not fit
    within ``staging_gb``, or whole when nothing of the model could be mapped. ``staging_device`` is where the staging copies live
    (default: the worker's device; ``"cpu"`` keeps them out of GPU memory). ``staging_gb`` bounds
    them, ``staging_slots`` says how many (1 or 2; default: two if they fit within
    ``staging_gb``, else one): with two, the next version lands while vLLM loads one; with one,
    it waits for that load. A worker whose copies would not fit refuses to join and says what
    they need.
    ``name`` prefixes this worker's peer name (host, pid and rank follow). ``timeout`` bounds
    joining the store. The secret, if the namespace has one, comes from ``$TRANSPORT_SECRET`` in
    vLLM's environment, never from this message."""

    store: str
    namespace: str = "default"
    group: str = "policy"
    dtype: str | None = None
    staging_device: str | None = None
    name: str = "vllm"
    timeout: float = 60.0
    mode: str = "auto"
    staging_gb: float | None = None
    staging_slots: int | None = None

    def __post_init__(self) -> None:
        if self.staging_slots not in (None, 1, 2):
            raise ValueError(
                f"transport init_info: staging_slots is 1 or 2, got {self.staging_slots!r}"
            )
        if self.mode not in MODES:
            raise ValueError(f"transport init_info: mode must be one of {MODES}, got {self.mode!r}")
        if self.staging_gb is not None and (
            not isinstance(self.staging_gb, (int, float)) or self.staging_gb <= 0
        ):
            raise ValueError(
                f"transport init_info: staging_gb must be > 0, got {self.staging_gb!r}"
            )
        if self.staging_device is not None:
            try:
                torch.device(self.staging_device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(
                    f"transport init_info: staging_device {self.staging_device!r} is not a device "
                    "(for example 'cpu' or 'cuda:0')"
                ) from e
        for field in ("store", "namespace", "group", "name"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise ValueError(f"transport init_info: {field} must be a non-empty string")
        if self.dtype is not None and not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(
                f"transport init_info: dtype {self.dtype!r} is not a torch dtype name "
                "(for example 'float32' or 'bfloat16')"
            )
        if not isinstance(self.timeout, (int, float)) or self.timeout <= 0:
            raise ValueError(f"transport init_info: timeout must be > 0 s, got {self.timeout!r}")


@dataclass
class TransportUpdateInfo(WeightTransferUpdateInfo):
    """Which version an update loads: ``version`` exactly (every TP rank then loads the same
    one; the trainer side always names it), or the newest complete one when None. ``timeout``
    bounds the wait for it; past it the update fails and vLLM keeps its weights.
    ``abandon=True`` drops a version an earlier update call held whose ``finish_weight_update``
    never came (its trainer died): the finish that follows then loads nothing."""

    version: int | None = None
    timeout: float = 60.0
    abandon: bool = False

    def __post_init__(self) -> None:
        if self.version is not None and (
            not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 0
        ):
            raise ValueError(
                f"transport update_info: version must be an int >= 0, got {self.version!r}"
            )
        if not isinstance(self.timeout, (int, float)) or self.timeout <= 0:
            raise ValueError(f"transport update_info: timeout must be > 0 s, got {self.timeout!r}")


@dataclass(frozen=True)
class EngineState:
    """What one worker's engine holds: its ``peer`` name and ``mode``; ``version``, the version
    the model holds (-1: the weights it started with, -2: none whole); ``held``, a version an
    update holds until ``finish_weight_update`` loads it; the newest ``complete`` and any
    ``incomplete`` version in staging; ``version_bytes``, the bytes of one version this worker
    receives; ``staging_slots`` and ``staging_bytes``, its staging copies and the memory they
    hold (counted from its buffers); ``fallback``, the checkpoint tensors that travel whole, with why."""

    peer: str | None
    mode: str | None
    version: int
    held: int | None
    complete: int | None
    incomplete: int | None
    version_bytes: int
    staging_slots: int
    staging_bytes: int
    fallback: dict[str, str]


class TransportEngine(WeightTransferEngine[TransportInitInfo, TransportUpdateInfo]):
    """One vLLM worker's receiver. It owns a Transport and a staging WeightSubscriber of the
    trainer's group, whose tensors depend on the mode (chosen at init and logged with why):

    * **sharded**: this worker's own parameters in vLLM's format (its TP slice of every column-
      and row-parallel weight, its part of fused q/k/v and gate/up, whole replicated tensors),
      declared as a layout over the checkpoint tensors that :mod:`.shards` learned by replaying
      vLLM's loader once; the trainer writes it only those bytes. Checkpoint tensors the replay
      could not map travel whole and go through vLLM's loader (named in the log).
    * **inplace**: the sharded layout, received straight into the parameters vLLM computes
      with (a :class:`~transport.weights.WindowedSubscriber`: no staging memory), only where
      every parameter is used as stored (:mod:`.inplace`: vLLM's GPU builds, unquantized).
    * **whole**: every checkpoint tensor whole (names, shapes, dtypes that transformers builds
      from vLLM's config on the meta device); vLLM's loader fuses and shards them.

    Rules:

    * A version is loaded only once it is complete, from the staging slot the publisher does not
      write while it is held; ``update_weights`` waits for it and holds it, and
      ``finish_weight_update`` loads it: the model and the version vLLM reports change in the
      same call, so a trainer that dies between the two leaves vLLM serving the weights it
      reports. An update that finds no complete version (timeout) fails and changes nothing.
    * Loading is vLLM's layerwise reload (each layer materialized, loaded, processed as after
      vLLM's own load, copied into the tensors the model computes with), inside one worker call,
      so no engine step sees half-loaded weights. If it cannot reach every layer, finish fails
      naming them and the worker reports ``TORN`` (-2) until a whole version loads.
    * Staging is one or two copies of what the worker receives, within ``staging_gb``; with one,
      the next version is written only after the last one was loaded (or dropped).
    * In place, publishers write the parameters only inside ``finish_weight_update`` (no engine
      step runs meanwhile), for the version ``update_weights`` named; the model and the version
      reported change in that call. A version that does not complete there (its trainer died
      mid-write) leaves the model torn: finish fails saying so and the worker reports ``TORN``
      (-2) until a later version lands whole. vLLM's ``/weight_info`` keeps naming the last
      finished version meanwhile (vLLM gives a worker no way to change it).
    * From ``start_weight_update`` until a finish succeeds or an update call fails (vLLM's own
      flag), the worker marks an update open in the store (:func:`update_key`), so that a
      trainer can close one its predecessor left open without provoking vLLM's error.
    * ``init_transfer_engine`` with the same info again is a no-op; with another, the engine
      leaves the old group first (if joining the new one fails, it is in none: updates say so
      until an init succeeds). ``shutdown`` leaves the group and closes the Transport.
    """

    init_info_cls = TransportInitInfo
    update_info_cls = TransportUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.transport: Transport | None = None
        self.subscriber: WeightSubscriber | None = None
        self.info: TransportInitInfo | None = None
        self.layout: WorkerLayout | None = None
        #: "sharded" or "whole", once initialized
        self.mode: str | None = None
        #: the version the model holds (-1: the weights it started with)
        self.version = -1
        self._held: contextlib.ExitStack | None = None
        self._snapshot: Snapshot | None = None
        self._tied: dict[str, str] = {}
        #: in place: the update a finish receives
        self._wanted: TransportUpdateInfo | None = None
        self._lock = threading.Lock()

    def parse_init_info(self, init_dict: dict[str, Any]) -> TransportInitInfo:
        return _parse(TransportInitInfo, init_dict, "init_info")

    def parse_update_info(self, update_dict: dict[str, Any]) -> TransportUpdateInfo:
        return _parse(TransportUpdateInfo, update_dict, "update_info")

    def init_transfer_engine(self, init_info: TransportInitInfo) -> None:
        with self._lock:
            if self.info == init_info and self.subscriber is not None:
                return
            self._close()
            dtype = getattr(torch, init_info.dtype) if init_info.dtype else self.model_config.dtype
            if not isinstance(dtype, torch.dtype):  # vLLM resolves "auto" before workers start
                raise ValueError(
                    f"cannot tell the model's dtype from {dtype!r}: pass init_info dtype"
                )
            spec = checkpoint_spec(self.model_config.hf_config, dtype)
            layout, mode, why = self._choose(init_info, spec)
            staging = init_info.staging_device or self.device
            slots, why_slots = (0, "in place") if mode == "inplace" else _slots(init_info, layout)
            need = slots * layout.nbytes
            rank = getattr(self.parallel_config, "rank", 0)
            name = f"{init_info.name}-{socket.gethostname()}-{os.getpid()}-r{rank}"
            t = Transport(
                name[:128],
                store=init_info.store,
                namespace=init_info.namespace,
                secret=os.environ.get(SECRET_ENV) or None,
                timeout=init_info.timeout,
            )
            shapes = {n: tuple(x.shape) for n, x in spec.items()}
            sub: WeightSubscriber | None = None
            try:
                if mode == "inplace":
                    sub = WindowedSubscriber(
                        t, live_tensors(self.model, layout), group=init_info.group,
                        layout=layout.dest, source_shapes=shapes,
                    )  # fmt: skip
                else:
                    sub = WeightSubscriber(
                        t, spec_of(layout), group=init_info.group, mode="staging",
                        staging_device=staging, layout=layout.dest if layout.targets else None,
                        source_shapes=shapes, slots=slots,
                    )  # fmt: skip
                # the trainer reads it (mode_key); signed: only this worker's holder writes it
                t.core.signed.set(
                    mode_key(init_info.namespace, init_info.group, t.name), mode.encode()
                )
            except BaseException:
                if sub is not None:
                    sub.close()
                t.close()
                raise
            self.transport, self.subscriber, self.info = t, sub, init_info
            self.layout, self.mode = layout, mode
            # which names are one tensor: learned before a reload (it gives each layer its own
            # tensors while it runs, and puts the shared ones back after)
            self._tied = tied_parameters(self.model)
            log.info(
                "vLLM worker %s joined group %s of namespace %s in the %s mode (%s): %d tensors, "
                "%.1f MiB per version; %d staging slot(s) (%s), %.1f MiB on %s",
                name, init_info.group, init_info.namespace, self.mode, why, len(layout.dest),
                layout.nbytes / 2**20, slots, why_slots, need / 2**20, staging,
            )  # fmt: skip

    def _choose(
        self, info: TransportInitInfo, spec: dict[str, torch.Tensor]
    ) -> tuple[WorkerLayout, str, str]:
        """The layout this worker declares, its mode, and why that mode."""
        if info.mode == "whole":
            return whole(spec, "asked for by init_info"), "whole", "asked for by init_info mode"
        layout = learn(self.model, spec)
        if not layout.targets:
            if info.mode in ("sharded", "inplace"):
                raise ValueError(
                    f"transport init_info: mode {info.mode!r}, but no parameter of this model "
                    "could be mapped to the checkpoint "
                    f"({next(iter(layout.fallback.values()), '')}); use mode 'whole' or 'auto'"
                )
            return whole(spec, "nothing mapped"), "whole", "no parameter could be mapped, so whole"
        mapped = len(spec) - len(layout.fallback)
        why = f"{mapped} of {len(spec)} checkpoint tensors mapped to this worker's parameters"
        bound = None if info.staging_gb is None else info.staging_gb * 2**30
        if info.mode == "inplace" or (info.mode == "auto" and bound and layout.nbytes > bound):
            refused = refusals(self.model, layout)
            if not refused:
                asked = info.mode == "inplace"
                return layout, "inplace", why + (
                    ", asked for by init_info mode" if asked else
                    f"; one staging copy ({layout.nbytes / 2**30:.3f} GiB) would not fit within "
                    "staging_gb, and vLLM computes with every parameter as stored"
                )  # fmt: skip
            names = ", ".join(f"{n} ({w})" for n, w in list(refused.items())[:4])
            raise ValueError(
                "transport init_info: this worker cannot receive in place: "
                f"{len(refused)} of its tensors are not used as stored, for example {names}"
                + ("" if info.mode == "inplace" else
                   f"; and one staging copy ({layout.nbytes / 2**30:.3f} GiB) would not fit "
                   f"within staging_gb={info.staging_gb}")
                + "; raise staging_gb (mode 'sharded'), or serve with more tensor-parallel ranks"
            )  # fmt: skip
        return (
            layout,
            "sharded",
            why if info.mode == "auto" else why + ", asked for by init_info mode",
        )

    def start_weight_update(self) -> None:
        self._drop()
        self._mark(OPEN)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's default synchronizes the accelerator, which a CPU-only torch does not have
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self._mark(CLOSED)  # vLLM ends an update whose update call raised
            raise

    def _mark(self, value: bytes) -> None:
        """Say in the store whether vLLM has an update open here (see update_key)."""
        t, info = self.transport, self.info
        if t is None or info is None:
            return
        try:
            t.core.signed.set(update_key(info.namespace, info.group, t.name), value)
        except TransportError as e:  # a hint for the next trainer: the update goes on
            log.warning("vLLM worker could not mark its update %s: %s", value.decode(), e)

    def receive_weights(self, update_info: TransportUpdateInfo) -> None:
        """Wait for the version and hold it where it landed (nothing of the model changes);
        ``finish_weight_update`` loads it."""
        if update_info.abandon:
            held, self._wanted = self._snapshot, None
            self._drop()
            if held is not None:
                log.warning(
                    "vLLM worker dropped version %d of an update that was never finished; the "
                    "model keeps version %d", held.version, self.version,
                )  # fmt: skip
            return
        sub = self.subscriber
        if sub is None:
            raise RuntimeError(
                "the transport weight-transfer engine was not initialized: call "
                "init_weight_transfer_engine with the trainer's store, namespace and group first"
            )
        self._drop()
        if isinstance(sub, WindowedSubscriber):  # written inside finish_weight_update
            if update_info.version is None:
                raise ValueError(
                    "transport update_info: a worker in place is written inside "
                    "finish_weight_update and needs the version named (the trainer engine does)"
                )
            self._wanted = update_info
            return
        stack = contextlib.ExitStack()
        self._snapshot = stack.enter_context(
            sub.read(update_info.version, timeout=update_info.timeout)
        )
        self._held = stack

    def finish_weight_update(self) -> None:
        if isinstance(self.subscriber, WindowedSubscriber):
            self._receive_in_place(self.subscriber)
            return
        snap, sub = self._snapshot, self.subscriber
        if snap is None or sub is None:
            self._mark(CLOSED)
            return
        try:
            self._load(snap, sub.group)
        finally:
            self._drop()
        self._mark(CLOSED)
        self.version = snap.version
        log.info("vLLM worker loaded version %d of group %s", snap.version, sub.group)

    def _receive_in_place(self, sub: WindowedSubscriber) -> None:
        """The version the update named lands in the parameters now, while vLLM runs this
        call (no engine step runs meanwhile); the version the worker reports moves with it."""
        wanted, self._wanted = self._wanted, None
        if wanted is not None:
            assert wanted.version is not None
            try:
                sub.receive(wanted.version, wanted.timeout)
            except VersionGoneError:
                self.version = sub.version  # a newer version landed whole in its place
                raise
            except (TransportError, RuntimeError) as e:
                torn = sub.torn
                if torn is None:
                    raise  # nothing was written: the model keeps its version
                self.version = TORN
                raise RuntimeError(
                    f"version {wanted.version} of group {sub.group} did not complete in place "
                    f"({e}): the model holds parts of versions {torn} and {sub.version} and "
                    f"reports version {TORN} until a version lands whole (the next update)"
                ) from e
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.version = wanted.version
            log.info(
                "vLLM worker received version %d of group %s in place", self.version, sub.group
            )
        self._mark(CLOSED)

    def _load(self, snap: Snapshot, group: str) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model: Any = self.model  # a vLLM model: it has load_weights
        layout = self.layout
        assert layout is not None
        targets = layout.targets
        with direct_loaders(model, targets):
            initialize_layerwise_reload(model)
            try:
                load_direct(model, targets, snap.tensors)
                rest = {n: snap.tensors[n] for n in layout.fallback}
                if rest:
                    model.load_weights(rest.items())
                    load_tied(model, self._tied, rest)
                missing = unloaded_layers(model)
            finally:
                # finish the reload even after a failed load: it started by moving the layers
                # to the meta device
                finalize_layerwise_reload(model, self.model_config)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if missing:
            self.version = TORN
            raise RuntimeError(
                f"version {snap.version} of group {group} did not reach every layer of "
                f"the model: {', '.join(missing[:8])}"
                + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
                + " kept their previous weights (vLLM's loader took none of the checkpoint "
                "tensors for them), so the model now holds no whole version; the next "
                "update that reaches every layer makes it whole again"
            )

    def _drop(self) -> None:
        """Let go of a held version (the publisher may write its slot again)."""
        held, self._held, self._snapshot = self._held, None, None
        if held is not None:
            held.close()

    def state(self) -> EngineState:
        sub, t, layout, snap = self.subscriber, self.transport, self.layout, self._snapshot
        storages = {}
        for slot in [] if sub is None or self.mode == "inplace" else sub.staging:
            for x in slot.values():
                storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return EngineState(
            peer=None if t is None else t.name,
            mode=self.mode,
            version=self.version,
            held=None if snap is None else snap.version,
            complete=None if sub is None else sub.version,
            incomplete=None if sub is None else sub.incomplete,
            version_bytes=0 if layout is None else layout.nbytes,
            staging_slots=0 if sub is None or self.mode == "inplace" else len(sub.staging),
            staging_bytes=sum(storages.values()),
            fallback={} if layout is None else dict(layout.fallback),
        )

    def shutdown(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        self._drop()
        sub, t = self.subscriber, self.transport
        self.subscriber = self.transport = self.info = self.layout = None
        if sub is not None:
            sub.close()
        if t is not None:
            t.close()


def _slots(info: TransportInitInfo, layout: WorkerLayout) -> tuple[int, str]:
    """How many staging copies of ``layout``'s version this worker keeps, and why; ValueError
    (naming the need) when the bound does not allow what is asked, or even one."""
    bound = None if info.staging_gb is None else info.staging_gb * 2**30
    one = layout.nbytes
    mode = "sharded" if layout.targets else "whole"

    def refuse(slots: int) -> ValueError:
        return ValueError(
            f"transport init_info: {slots} staging slot(s) of the {mode} mode need "
            f"{slots * one / 2**30:.3f} GiB ({one / 2**30:.3f} GiB each), more than "
            f"staging_gb={info.staging_gb}; raise staging_gb, use one slot, or serve with more "
            "tensor-parallel ranks"
        )

    if info.staging_slots is not None:
        if bound is not None and info.staging_slots * one > bound:
            raise refuse(info.staging_slots)
        return info.staging_slots, "asked for by init_info staging_slots"
    if bound is None or 2 * one <= bound:
        return 2, "two fit" if bound is not None else "no staging_gb bound"
    if one <= bound:
        return 1, f"two would need {2 * one / 2**30:.3f} GiB, more than staging_gb"
    raise refuse(1)


def _parse(cls: Any, given: Any, what: str) -> Any:
    if not isinstance(given, dict):
        raise ValueError(f"transport {what} must be a JSON object, got {type(given).__name__}")
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(
            f"transport {what}: unknown fields {unknown}; the fields are {sorted(known)}"
        )
    try:
        return cls(**given)
    except TypeError as e:
        raise ValueError(f"transport {what}: {e}") from e
