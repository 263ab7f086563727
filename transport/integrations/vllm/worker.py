"""The inference side: a vLLM weight-transfer engine that receives versions through transport."""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from transport import TornModelError, Transport, TransportError, VersionGoneError
from transport.integrations.setup import connect
from transport.integrations.vllm import experts
from transport.integrations.vllm.checkpoint import checkpoint_spec
from transport.integrations.vllm.infos import (
    CLOSED,
    OPEN,
    TORN,
    EngineState,
    TransportInitInfo,
    TransportUpdateInfo,
    mode_key,
    parse,
    torn_mark,
    update_key,
)
from transport.integrations.vllm.modes.base import Mode, Worker
from transport.integrations.vllm.modes.choice import choose
from transport.integrations.vllm.modes.inplace import InPlace
from transport.integrations.vllm.modes.lora import Adapters
from transport.integrations.vllm.reload import tied_parameters
from transport.integrations.vllm.room import staging_room

log = logging.getLogger(__name__)


class TransportEngine(WeightTransferEngine[TransportInitInfo, TransportUpdateInfo]):
    """One vLLM worker's receiver. It owns a Transport and one mode (modes/), chosen at init and
    logged with why, which owns the subscriber of the trainer's group:

    * **sharded** (modes/staged.py): this worker's own parameters in vLLM's format into staging
      copies (its TP slice of every column- and row-parallel weight, its part of fused q/k/v and
      gate/up, whole replicated tensors), declared as a layout over the checkpoint tensors that
      shards.py learned by replaying vLLM's loader once; checkpoint tensors the replay could not
      map travel whole and go through vLLM's loader (named in the log).
    * **inplace** (modes/inplace.py): the sharded layout straight into the parameters vLLM
      computes with, only where every parameter is used as stored.
    * **streamed** (modes/streamed.py): the sharded layout in parts through two buckets of half
      the staging bound, loaded into one layerwise reload inside ``finish_weight_update``.
    * **whole** (modes/staged.py): every checkpoint tensor whole; vLLM's loader fuses and shards
      them.

    Rules:

    * A version is loaded only once it is complete, from where the publisher does not write
      while it is held; ``update_weights`` waits for it and holds it, and
      ``finish_weight_update`` loads it: the model and the version vLLM reports change in the
      same call, so a trainer that dies between the two leaves vLLM serving the weights it
      reports. An update that finds no complete version (timeout) fails and changes nothing.
    * Loading is vLLM's layerwise reload inside one worker call, so no engine step sees
      half-loaded weights. A version that reached only part of the model (a layer the loader
      missed, a trainer that died mid-stream or mid-write in place) fails the finish naming it,
      and the worker reports ``TORN`` (-2) until a whole version loads.
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
        self.info: TransportInitInfo | None = None
        #: how this worker receives versions of its group, once initialized
        self.receiver: Mode | None = None
        #: the version the model holds (-1: the weights it started with)
        self.version = -1
        #: per MoE layer, the experts this worker receives (see experts.received)
        self._experts: dict[str, list[int]] = {}
        #: the LoRA adapters this worker serves from memory (modes/lora.py), by name
        rank = getattr(self.parallel_config, "rank", 0)
        self.adapters = Adapters(
            model, self.model_config, device, f"vllm-{socket.gethostname()}-{os.getpid()}-r{rank}"
        )
        self._lock = threading.Lock()

    @property
    def mode(self) -> str | None:
        """The mode's name (``sharded``, ``inplace``, ``streamed`` or ``whole``), once joined."""
        return None if self.receiver is None else self.receiver.said.partition(":")[0]

    @property
    def subscriber(self) -> Any:
        """The subscriber of the mode (the first part's, streamed), None before init."""
        return None if self.receiver is None else self.receiver.subscriber

    def parse_init_info(self, init_dict: dict[str, Any]) -> TransportInitInfo:
        return parse(TransportInitInfo, init_dict, "init_info")

    def parse_update_info(self, update_dict: dict[str, Any]) -> TransportUpdateInfo:
        return parse(TransportUpdateInfo, update_dict, "update_info")

    def init_transfer_engine(self, init_info: TransportInitInfo) -> None:
        if init_info.adapter is not None:
            raise ValueError(
                "transport init_info: an adapter joins through the adapter calls (the adapter "
                "trainer's client: lora_routes.py on a server), not vLLM's weight-transfer init"
            )
        with self._lock:
            if self.info == init_info and self.receiver is not None:
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
            choice = choose(self.model, init_info, spec, room)
            rank = getattr(self.parallel_config, "rank", 0)
            name = f"{init_info.name}-{socket.gethostname()}-{os.getpid()}-r{rank}"
            t = connect(
                name,
                store=init_info.store,
                namespace=init_info.namespace,
                timeout=init_info.timeout,
                hint="the store of init_info",
            )
            # which names are one tensor: learned before a reload (it gives each layer its own
            # tensors while it runs, and puts the shared ones back after)
            worker = Worker(
                t,
                init_info,
                self.model,
                self.model_config,
                self.device,
                staging,
                room,
                spec,
                tied_parameters(self.model),
            )
            receiver: Mode | None = None
            try:
                receiver = choice.mode(worker, choice.layout)
                # the trainer reads it (mode_key); signed: only this worker's holder writes it
                key = mode_key(init_info.namespace, init_info.group, t.name)
                t.core.signed.set(key, receiver.said.encode())
            except BaseException:
                if receiver is not None:
                    receiver.close()
                t.close()
                raise
            self.transport, self.receiver, self.info = t, receiver, init_info
            self._experts = experts.received(choice.layout, spec)
            layout = choice.layout
            parts = receiver.held().parts
            log.info(
                "vLLM worker %s joined group %s of namespace %s in the %s mode (%s): %d tensors, "
                "%.1f MiB per version%s; %.1f MiB of staging on %s",
                name,
                init_info.group,
                init_info.namespace,
                self.mode,
                choice.why,
                len(layout.dest),
                layout.nbytes / 2**20,
                f" in {parts} parts" if parts > 1 else "",
                receiver.need / 2**20,
                staging,
            )

    def init_adapter(self, init_info: dict[str, Any]) -> str:
        """Join (or replace) the adapter ``init_info`` names (see TransportInitInfo); returns
        what happened. Called through the worker extension (extension.adapter_call)."""
        info = self.parse_init_info(init_info)
        if info.adapter is None:
            raise ValueError("transport init_info: name the adapter to join")
        with self._lock:
            how = self.adapters.join(info)
        if how != "unchanged":
            log.info(
                "vLLM worker: adapter %s of namespace %s (group %s) %s",
                info.adapter,
                info.namespace,
                info.group,
                how,
            )
        return how

    def update_adapter(self, update_info: dict[str, Any]) -> int | None:
        """Install the version of the adapter ``update_info`` names (``adapter``, ``version``,
        ``timeout``) once it is complete; returns that version. Called through the worker
        extension (extension.py), outside vLLM's update phases, whose end drops every adapter."""
        update = self.parse_update_info(update_info)
        if update.adapter is None:
            raise ValueError("transport update_info: name the adapter to install")
        with self._lock:
            version = self.adapters.update(update)
        log.info("vLLM worker installed version %s of adapter %s", version, update.adapter)
        return version

    def remove_adapter(self, namespace: str, adapter: str) -> bool:
        """Take ``adapter`` of ``namespace`` out of vLLM and leave its group (False: this
        worker has none)."""
        with self._lock:
            return self.adapters.remove(namespace, adapter)

    def start_weight_update(self) -> None:
        if self.receiver is not None:
            self.receiver.drop()
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
        """Wait for the version and hold it where it landed, or note the version the finish
        receives (nothing of the model changes); ``finish_weight_update`` loads it."""
        receiver = self.receiver
        if update_info.abandon:
            held = None if receiver is None else receiver.drop()
            if held is not None:
                log.warning(
                    "vLLM worker dropped version %d of an update that was never finished; the "
                    "model keeps version %d",
                    held,
                    self.version,
                )
            return
        if receiver is None:
            raise RuntimeError(
                "the transport weight-transfer engine was not initialized: call "
                "init_weight_transfer_engine with the trainer's store, namespace and group first"
            )
        receiver.receive(update_info)

    def finish_weight_update(self) -> None:
        receiver = self.receiver
        if receiver is None:
            self._mark(CLOSED)
            return
        try:
            loaded = receiver.finish()
        except TornModelError as e:
            self.version = TORN
            self._mark(torn_mark(e.version))
            raise
        except VersionGoneError:
            if isinstance(receiver, InPlace) and receiver.overtaken is not None:
                self.version = receiver.overtaken  # a newer version landed whole in its place
            raise
        if loaded is not None:
            self.version = loaded
            log.info("vLLM worker loaded version %d of group %s", loaded, receiver.group)
        self._mark(CLOSED)

    def state(self) -> EngineState:
        receiver, t = self.receiver, self.transport
        held = None if receiver is None else receiver.held()
        layout = None if receiver is None else receiver.layout
        return EngineState(
            peer=None if t is None else t.name,
            mode=self.mode,
            version=self.version,
            held=None if held is None else held.held,
            complete=None if held is None else held.complete,
            incomplete=None if held is None else held.incomplete,
            version_bytes=0 if layout is None else layout.nbytes,
            staging_slots=0 if held is None else held.slots,
            staging_bytes=0 if held is None else held.nbytes,
            fallback={} if layout is None else dict(layout.fallback),
            staging_bound=0 if receiver is None else receiver.worker.room.bound,
            experts=dict(self._experts),
            parts=0 if held is None else held.parts,
            adapters=self.adapters.state(),
        )

    def shutdown(self) -> None:
        with self._lock:
            self._close()
            self.adapters.close()

    def _close(self) -> None:
        receiver, t = self.receiver, self.transport
        self.receiver = self.transport = self.info = None
        if receiver is not None:
            receiver.close()
        if t is not None:
            t.close()
