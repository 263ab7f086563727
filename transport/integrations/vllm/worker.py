"""The inference side: a vLLM weight-transfer engine that receives versions through transport."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from transport import Transport, TransportError, VersionGoneError, WeightSubscriber
from transport.integrations.vllm import experts
from transport.integrations.vllm.checkpoint import checkpoint_spec
from transport.integrations.vllm.infos import (
    CLOSED,
    OPEN,
    SECRET_ENV,
    TORN,
    EngineState,
    TransportInitInfo,
    TransportUpdateInfo,
    mode_key,
    parse,
    torn_mark,
    update_key,
)
from transport.integrations.vllm.inplace import live_tensors, refusals
from transport.integrations.vllm.reload import (
    direct_loaders,
    load_direct,
    load_tied,
    tied_parameters,
    unloaded_layers,
)
from transport.integrations.vllm.room import Room, staging_room
from transport.integrations.vllm.shards import WorkerLayout, learn, spec_of, whole
from transport.integrations.vllm.streamed import Stream
from transport.weights import Snapshot, WindowedSubscriber

log = logging.getLogger("transport.vllm")


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
    * **streamed**: the sharded layout in parts through two buckets of half the staging bound
      (:mod:`.streamed`), loaded into one layerwise reload inside ``finish_weight_update``.
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
    * Staging is one or two copies of what the worker receives, within ``staging_gb``, or
      without it within the memory free on the staging device after vLLM's own (room.py); with one,
      the next version is written only after the last one was loaded (or dropped).
    * In place and streamed, publishers write only inside ``finish_weight_update`` (no engine
      step runs meanwhile), the version ``update_weights`` named; the model and the version
      reported change in that call. A version that does not complete there after part of it
      reached the model (its trainer died mid-write) leaves the model torn: finish fails saying
      so and the worker reports ``TORN`` (-2) until a later version lands whole. vLLM's ``/weight_info`` keeps naming the last
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
        #: the staging bound chosen at init
        self.room: Room | None = None
        self.layout: WorkerLayout | None = None
        #: "sharded" or "whole", once initialized
        self.mode: str | None = None
        #: the version the model holds (-1: the weights it started with)
        self.version = -1
        self._held: contextlib.ExitStack | None = None
        self._snapshot: Snapshot | None = None
        self._tied: dict[str, str] = {}
        #: per MoE layer, the experts this worker receives (see experts.received)
        self._experts: dict[str, list[int]] = {}
        self.stream: Stream | None = None
        #: in place or streamed: the update a finish receives
        self._wanted: TransportUpdateInfo | None = None
        self._lock = threading.Lock()

    def parse_init_info(self, init_dict: dict[str, Any]) -> TransportInitInfo:
        return parse(TransportInitInfo, init_dict, "init_info")

    def parse_update_info(self, update_dict: dict[str, Any]) -> TransportUpdateInfo:
        return parse(TransportUpdateInfo, update_dict, "update_info")

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
            spec = checkpoint_spec(self.model_config.hf_config, dtype, init_info.names)
            staging = torch.device(init_info.staging_device or self.device)
            room = staging_room(init_info.staging_gb, staging)
            layout, mode, why = self._choose(init_info, spec, room)
            if mode in ("inplace", "streamed"):
                slots, why_slots = 0, "in place" if mode == "inplace" else "two buckets"
            else:
                slots, why_slots = _slots(init_info, layout, room)
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
            stream: Stream | None = None
            try:
                if mode == "inplace":
                    sub = WindowedSubscriber(
                        t,
                        live_tensors(self.model, layout),
                        group=init_info.group,
                        layout=layout.dest,
                        source_shapes=shapes,
                        delta=init_info.delta,
                    )
                elif mode == "streamed":
                    bucket = room.bound // 2
                    stream = Stream(t, layout, init_info.group, staging, shapes, bucket)
                    sub = stream.subscribers[0]
                else:
                    sub = WeightSubscriber(
                        t,
                        spec_of(layout),
                        group=init_info.group,
                        mode="staging",
                        staging_device=staging,
                        layout=layout.dest if layout.targets else None,
                        source_shapes=shapes,
                        slots=slots,
                        delta=init_info.delta,
                    )
                # the trainer reads it (mode_key); signed: only this worker's holder writes it
                said = f"streamed:{len(stream.names)}" if stream is not None else mode
                t.core.signed.set(
                    mode_key(init_info.namespace, init_info.group, t.name), said.encode()
                )
            except BaseException:
                if stream is not None:
                    stream.close()
                elif sub is not None:
                    sub.close()
                t.close()
                raise
            self.transport, self.subscriber, self.info, self.room = t, sub, init_info, room
            self.layout, self.mode, self.stream = layout, mode, stream
            self._experts = experts.received(layout, spec)
            need = stream.nbytes if stream is not None else slots * layout.nbytes
            # which names are one tensor: learned before a reload (it gives each layer its own
            # tensors while it runs, and puts the shared ones back after)
            self._tied = tied_parameters(self.model)
            log.info(
                "vLLM worker %s joined group %s of namespace %s in the %s mode (%s): %d tensors, "
                "%.1f MiB per version%s; %d staging slot(s) (%s), %.1f MiB on %s",
                name,
                init_info.group,
                init_info.namespace,
                self.mode,
                why,
                len(layout.dest),
                layout.nbytes / 2**20,
                f" in {len(stream.names)} parts" if stream else "",
                slots,
                why_slots,
                need / 2**20,
                staging,
            )

    def _choose(
        self, info: TransportInitInfo, spec: dict[str, torch.Tensor], room: Room
    ) -> tuple[WorkerLayout, str, str]:
        """The layout this worker declares, its mode, and why that mode."""
        refused = experts.refusals(self.model)
        if refused:  # no mode helps: every update reloads these layers
            first = "; ".join(f"{n}: {why}" for n, why in list(refused.items())[:2])
            raise ValueError(
                f"transport: {len(refused)} mixture-of-experts layer(s) of this model cannot "
                f"take a weight update exactly, so this worker does not join ({first})"
            )
        asked = ", asked for by init_info mode"
        if info.mode == "whole":
            return whole(spec, "asked for by init_info"), "whole", asked[2:]
        layout = learn(self.model, spec)
        if layout.targets:
            mapped = len(spec) - len(layout.fallback)
            mode, why = (
                "sharded",
                f"{mapped} of {len(spec)} checkpoint tensors mapped to this worker's parameters",
            )
        elif info.mode in ("sharded", "inplace"):
            raise ValueError(
                f"transport init_info: mode {info.mode!r}, but no parameter of this model could be "
                f"mapped to the checkpoint ({next(iter(layout.fallback.values()), '')}); use mode "
                "'whole' or 'auto'"
            )
        else:
            layout = whole(spec, "nothing mapped")
            mode, why = "whole", "no parameter could be mapped, so whole"
        if info.mode == "streamed":
            return layout, "streamed", why + asked
        if info.mode != "inplace" and (info.mode != "auto" or layout.nbytes <= room.bound):
            return layout, mode, why + ("" if info.mode == "auto" else asked)
        # in place, asked for, or no staging copy fits
        copy = (
            f"one staging copy ({layout.nbytes / 2**30:.3f} GiB) would not fit within "
            f"{room.bound / 2**30:.3f} GiB ({room.how})"
        )
        refused = refusals(self.model, layout)
        if not refused:
            return (
                layout,
                "inplace",
                why
                + (
                    asked
                    if info.mode == "inplace"
                    else f"; {copy}, and vLLM computes with every parameter as stored"
                ),
            )
        first = ", ".join(f"{n} ({w})" for n, w in list(refused.items())[:4])
        if info.mode == "inplace":
            raise ValueError(
                "transport init_info: this worker cannot receive in place: "
                f"{len(refused)} of its tensors are not used as stored, for example {first}; use "
                "mode 'sharded' (with room for one staging copy) or 'streamed'"
            )
        return (
            layout,
            "streamed",
            (
                f"{why}; {copy}, and it cannot be written in place ({len(refused)} tensors are not "
                f"used as stored, for example {first}): streamed in parts of half of that bound"
            ),
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
                    "model keeps version %d",
                    held.version,
                    self.version,
                )
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
                    f"transport update_info: a worker {self.mode} is written inside "
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
        if self.stream is not None and self.subscriber is not None:
            self._stream_in(self.stream, self.subscriber.group)
            return
        if isinstance(self.subscriber, WindowedSubscriber):
            self._receive_in_place(self.subscriber)
            return
        snap, sub = self._snapshot, self.subscriber
        if snap is None or sub is None:
            self._mark(CLOSED)
            return
        try:
            self._load([snap.tensors], snap.version, sub.group)
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
                self._mark(torn_mark(torn))
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

    def _stream_in(self, stream: Stream, group: str) -> None:
        """The parts of the version the update named, loaded as each lands (see streamed.py),
        while vLLM runs this call; the version the worker reports moves with the model."""
        wanted, self._wanted = self._wanted, None
        if wanted is not None:
            assert wanted.version is not None
            with stream.parts(wanted.version, wanted.timeout) as parts:
                self._load(parts, wanted.version, group, len(stream.names))
            self.version = wanted.version
            log.info(
                "vLLM worker loaded version %d of group %s, streamed in %d parts",
                self.version,
                group,
                len(stream.names),
            )
        self._mark(CLOSED)

    def _load(
        self, parts: Iterable[Mapping[str, torch.Tensor]], version: int, group: str, count: int = 1
    ) -> None:
        """Load ``parts`` (``count`` of them, as they come) in one layerwise reload."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model: Any = self.model  # a vLLM model: it has load_weights
        layout = self.layout
        assert layout is not None
        targets = layout.targets
        loaded, failed = 0, None
        with direct_loaders(model, targets):
            initialize_layerwise_reload(model)
            try:
                for tensors in parts:
                    load_direct(model, {n: targets[n] for n in tensors if n in targets}, tensors)
                    rest = {n: tensors[n] for n in tensors if n in layout.fallback}
                    if rest:
                        model.load_weights(rest.items())
                        load_tied(model, self._tied, rest)
                    loaded += 1
                missing = unloaded_layers(model)
            except BaseException as e:
                failed = e
            finally:
                # finish the reload even after a failed load: it started by moving the layers
                # to the meta device; then prepare the experts vLLM leaves unprepared
                prepared = experts.reloaded(model)
                finalize_layerwise_reload(model, self.model_config)
                experts.redo(model, prepared)
        if failed is not None:
            if loaded == 0:
                raise failed  # nothing of it reached the model
            self.version = TORN
            self._mark(torn_mark(version))
            raise RuntimeError(
                f"version {version} of group {group} stopped after {loaded} of its {count} parts "
                f"({failed}): the layers of those parts hold it, the others the version before, "
                f"so the model holds no whole version and reports {TORN} until the next update "
                "loads one whole"
            ) from failed
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if missing:
            self.version = TORN
            self._mark(torn_mark(version))
            raise RuntimeError(
                f"version {version} of group {group} did not reach every layer of "
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
        for slot in [] if sub is None or self.mode in ("inplace", "streamed") else sub.staging:
            for x in slot.values():
                storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        for bucket in [] if self.stream is None else self.stream.buckets:
            storages[bucket.untyped_storage().data_ptr()] = bucket.untyped_storage().nbytes()
        return EngineState(
            peer=None if t is None else t.name,
            mode=self.mode,
            version=self.version,
            held=None if snap is None else snap.version,
            complete=None if sub is None else sub.version,
            incomplete=None if sub is None else sub.incomplete,
            version_bytes=0 if layout is None else layout.nbytes,
            staging_slots=0
            if sub is None or self.mode in ("inplace", "streamed")
            else len(sub.staging),
            staging_bytes=sum(storages.values()),
            fallback={} if layout is None else dict(layout.fallback),
            staging_bound=0 if self.room is None else self.room.bound,
            experts=dict(self._experts),
            parts=len(self.stream.names) if self.stream is not None else int(sub is not None),
        )

    def shutdown(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        self._drop()
        sub, t, stream = self.subscriber, self.transport, self.stream
        self.subscriber = self.transport = self.info = self.layout = self.stream = None
        self._wanted = None
        if stream is not None:
            stream.close()
        if sub is not None:
            sub.close()
        if t is not None:
            t.close()


def _slots(info: TransportInitInfo, layout: WorkerLayout, room: Room) -> tuple[int, str]:
    """How many staging copies of ``layout``'s version this worker keeps, and why; ValueError
    (naming the need) when the bound does not allow what is asked, or even one."""
    bound = room.bound
    one = layout.nbytes
    mode = "sharded" if layout.targets else "whole"

    def refuse(slots: int) -> ValueError:
        return ValueError(
            f"transport init_info: {slots} staging slot(s) of the {mode} mode need "
            f"{slots * one / 2**30:.3f} GiB ({one / 2**30:.3f} GiB each), more than "
            f"{bound / 2**30:.3f} GiB ({room.how}); raise staging_gb, use one slot, or serve with "
            "more tensor-parallel ranks"
        )

    if info.staging_slots is not None:
        if info.staging_slots * one > bound:
            raise refuse(info.staging_slots)
        return info.staging_slots, "asked for by init_info staging_slots"
    if 2 * one <= bound:
        return 2, f"two fit within {bound / 2**30:.3f} GiB ({room.how})"
    if one <= bound:
        return 1, f"two would need {2 * one / 2**30:.3f} GiB, more than {room.how}"
    raise refuse(1)
