"""The inference side: a vLLM weight-transfer engine that receives versions through transport."""

from __future__ import annotations

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

from transport import Transport, WeightSubscriber
from transport.integrations.vllm.checkpoint import checkpoint_spec
from transport.integrations.vllm.reload import load_tied, tied_parameters, unloaded_layers

log = logging.getLogger("transport.vllm")

#: environment variable holding the namespace secret (never sent through vLLM's APIs)
SECRET_ENV = "TRANSPORT_SECRET"
#: the version a worker reports after an update that did not reach every layer
TORN = -2


@dataclass
class TransportInitInfo(WeightTransferInitInfo):
    """Where a vLLM worker finds the trainer (small JSON: it also travels over HTTP).

    ``store`` is the store URL the trainer uses (``tcp://host:port`` or ``redis://...``),
    ``namespace`` and ``group`` those of its WeightPublisher. ``dtype`` is the dtype the
    trainer publishes (default: the model's; vLLM's loader converts). ``staging_device`` is where
    the two staging copies live (default: the worker's device; ``"cpu"`` keeps them out of GPU
    memory, and the load then copies from host memory). ``name`` prefixes this worker's peer name
    (host, pid and rank follow). ``timeout`` bounds joining the store. The
    secret, if the namespace has one, comes from ``$TRANSPORT_SECRET`` in vLLM's environment,
    never from this message."""

    store: str
    namespace: str = "default"
    group: str = "policy"
    dtype: str | None = None
    staging_device: str | None = None
    name: str = "vllm"
    timeout: float = 60.0

    def __post_init__(self) -> None:
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
    bounds the wait for it; past it the update fails and vLLM keeps its weights."""

    version: int | None = None
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.version is not None and (
            not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 0
        ):
            raise ValueError(f"transport update_info: version must be an int >= 0, got {self.version!r}")
        if not isinstance(self.timeout, (int, float)) or self.timeout <= 0:
            raise ValueError(f"transport update_info: timeout must be > 0 s, got {self.timeout!r}")


class TransportEngine(WeightTransferEngine[TransportInitInfo, TransportUpdateInfo]):
    """One vLLM worker's receiver. It owns a Transport and a staging WeightSubscriber of the
    trainer's group whose tensors are the model's checkpoint tensors (names, shapes, dtypes that
    transformers builds from vLLM's config on the meta device): the publisher checks its state
    dict against them before any byte moves and lists every mismatch.

    Rules:

    * A version is loaded only once it is complete, from the staging slot the publisher does not
      write while it is read; nothing of the model changes before that, so an update that finds
      no complete version (timeout) fails and vLLM serves the weights it had.
    * Loading is one worker call: vLLM's layerwise reload starts, ``load_weights`` takes the
      checkpoint-named tensors (vLLM fuses and shards them for its TP rank), and the reload
      finishes, all inside ``update_weights``, so no engine step runs on half-loaded weights.
      ``start_weight_update`` touches nothing; ``finish_weight_update`` records the version.
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
        #: the version the model holds (-1: the weights it started with)
        self.version = -1
        self._loaded: int | None = None
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
                raise ValueError(f"cannot tell the model's dtype from {dtype!r}: pass init_info dtype")
            spec = checkpoint_spec(self.model_config.hf_config, dtype)
            rank = getattr(self.parallel_config, "rank", 0)
            name = f"{init_info.name}-{socket.gethostname()}-{os.getpid()}-r{rank}"
            t = Transport(
                name[:128],
                store=init_info.store,
                namespace=init_info.namespace,
                secret=os.environ.get(SECRET_ENV) or None,
                timeout=init_info.timeout,
            )
            try:
                staging = init_info.staging_device or self.device
                sub = WeightSubscriber(
                    t, spec, group=init_info.group, mode="staging", staging_device=staging
                )
            except BaseException:
                t.close()
                raise
            self.transport, self.subscriber, self.info = t, sub, init_info
            log.info(
                "vLLM worker %s joined group %s of namespace %s (%d tensors)",
                name, init_info.group, init_info.namespace, len(spec),
            )  # fmt: skip

    def start_weight_update(self) -> None:
        self._loaded = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's default synchronizes the accelerator, which a CPU-only torch does not have
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: TransportUpdateInfo) -> None:
        sub = self.subscriber
        if sub is None:
            raise RuntimeError(
                "the transport weight-transfer engine was not initialized: call "
                "init_weight_transfer_engine with the trainer's store, namespace and group first"
            )
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        with sub.read(update_info.version, timeout=update_info.timeout) as snap:
            # the version is complete and held: only now does the model change
            model: Any = self.model  # a vLLM model: it has load_weights
            tied = tied_parameters(model)  # before the reload gives each layer its own tensors
            initialize_layerwise_reload(model)
            try:
                model.load_weights(snap.tensors.items())
                load_tied(model, tied, snap.tensors)
                missing = unloaded_layers(model)
            finally:
                # finish the reload even after a failed load: it started by moving the layers
                # to the meta device
                finalize_layerwise_reload(model, self.model_config)
            if missing:
                self.version = TORN
                raise RuntimeError(
                    f"version {snap.version} of group {sub.group} did not reach every layer of "
                    f"the model: {', '.join(missing[:8])}"
                    + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
                    + " kept their previous weights (vLLM's loader took none of the checkpoint "
                    "tensors for them), so the model now holds no whole version; the next "
                    "update that reaches every layer makes it whole again"
                )
        self._loaded = snap.version
        log.info("vLLM worker loaded version %d of group %s", snap.version, sub.group)

    def finish_weight_update(self) -> None:
        if self._loaded is not None:
            self.version, self._loaded = self._loaded, None

    def shutdown(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        sub, t = self.subscriber, self.transport
        self.subscriber = self.transport = self.info = None
        if sub is not None:
            sub.close()
        if t is not None:
            t.close()


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
