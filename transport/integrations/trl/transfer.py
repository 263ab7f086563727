"""TRL's weight-transfer protocol (``AsyncGRPOTrainer(weight_transfer=...)``) over transport.

TRL calls, on its main process: ``init_weight_transfer()`` once at the start of training, then
for every sync ``pause()``, ``send_weights(iterator of (name, tensor))``, ``resume()``, and
``destroy()`` at the end. Its default sends every byte over NCCL with no deadline; this one
publishes through transport into the vLLM server's workers (the server runs the ``transport``
weight-transfer backend), with a deadline on every step, on GPUs or CPUs.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback

from transport import SyncError
from transport.integrations.vllm.lora_trainer import AdapterTrainer, AdapterTrainerInfo
from transport.integrations.vllm.server import wait_healthy
from transport.integrations.vllm.trainer import (
    HTTPClient,
    TransportTrainer,
    TransportTrainerInitInfo,
)

log = logging.getLogger(__name__)

#: what becomes of the server's running requests while a version loads (HTTPClient.pause)
PAUSE_MODES = ("keep", "wait")


@dataclass(frozen=True)
class SyncRecord:
    """One sync: its version, the seconds ``send_weights`` took in all, and of them the
    seconds spent publishing into the workers' staging memory while vLLM served
    (``publish_s``) and loading with generation paused (``load_s``)."""

    version: int
    seconds: float
    publish_s: float
    load_s: float


class PausingClient(HTTPClient):
    """vLLM's HTTP client that pauses the server's generation only when a version starts to
    load: TRL asks for the pause before it sends (``wanted``), and the pause begins just before
    ``start_weight_update``, so the server goes on generating while the version's bytes move
    into its workers' staging memory. :meth:`release` resumes a pause that began. It owns
    whether the server is paused by it; it never resumes a pause it did not make."""

    def __init__(self, base_url: str, timeout: float, mode: str) -> None:
        super().__init__(base_url, timeout)
        self.mode = mode
        self.wanted = False
        self.paused = False

    def start_weight_update(self) -> None:
        if self.wanted and not self.paused:
            self.pause(self.mode)
            self.paused = True
        super().start_weight_update()

    def release(self) -> None:
        self.wanted = False
        if self.paused:
            self.paused = False
            self.resume()


class TransportWeightTransfer(TrainerCallback):
    """TRL's ``WeightTransferProtocol`` for ``AsyncGRPOTrainer``: its syncs go through
    transport into the vLLM server at ``server_url``.

    Whole models (the default): the first sync registers the tensors TRL yields (the trainer's
    own parameters: registered once and read at each sync; tensors that are new at each sync,
    such as FSDP's gathered ones, are copied into the first sync's) and publishes each version
    with a :class:`~transport.integrations.vllm.trainer.TransportTrainer` (``mode``, ``delta``
    and the rest as its init info says). A version loads only once it is complete in every
    worker's staging memory; until then vLLM serves the one before. TRL's pause begins only
    when the version starts to load (:class:`PausingClient`; ``pause`` says what becomes of
    running requests).

    LoRA adapters (``adapter="<name>"``, for a trainer given a ``peft_config``): only the
    adapter's A and B go, into vLLM's LoRA slots through
    :class:`~transport.integrations.vllm.lora_trainer.AdapterTrainer`, served under the base
    model's name (TRL's rollouts name the model). The transfer needs the peft model, which TRL
    builds itself: pass the transfer as a callback too (``callbacks=[transfer]``); TRL then
    hands it the model when training begins.

    Versions count the syncs from 1, as TRL's ``model_version`` does after each. Every failure
    raises :class:`SyncError` naming the server within ``timeout`` seconds (plus the HTTP
    round trips), after resuming a pause it made. :meth:`destroy` closes everything (vLLM goes
    on serving the last version it loaded, an adapter under the model's name included); a
    later sync opens it again. Secrets come from the environment (``$TRANSPORT_SECRET`` or the
    namespace's own), on both sides.
    """

    def __init__(
        self,
        server_url: str,
        *,
        store: str,
        namespace: str = "default",
        group: str = "policy",
        name: str = "trainer",
        timeout: float = 120.0,
        mode: str = "auto",
        delta: bool | str = False,
        pause: str = "keep",
        adapter: str | None = None,
        client: Any = None,
    ) -> None:
        if pause not in PAUSE_MODES:
            raise ValueError(f"transport weight transfer: pause is one of {PAUSE_MODES}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"transport weight transfer: timeout is > 0 s, got {timeout!r}")
        self.server_url = server_url.rstrip("/")
        self.info = TransportTrainerInitInfo(
            store=store,
            namespace=namespace,
            group=group,
            name=name,
            timeout=float(timeout),
            mode=mode,
            delta=delta,
            rank=0,  # TRL calls its weight transfer on its main process only
        )
        self.adapter = adapter
        # an update waits up to the timeout for the version: the HTTP calls wait longer
        self.client = client or PausingClient(self.server_url, timeout + 30, pause)
        self.model: Any = None
        self.engine: TransportTrainer | None = None
        self.adapter_trainer: AdapterTrainer | None = None
        self.version = 0
        self.history: deque[SyncRecord] = deque(maxlen=10_000)

    # -- TRL's protocol ---------------------------------------------------------------------

    def init_weight_transfer(self) -> None:
        """Waits (up to the timeout) until the server answers; SyncError naming it if not."""
        if not wait_healthy(self.server_url, self.info.timeout):
            raise SyncError(
                f"the vLLM server at {self.server_url} did not answer /health within "
                f"{self.info.timeout:g} s; start it with --weight-transfer-config "
                '\'{"backend": "transport"}\' (and VLLM_SERVER_DEV_MODE=1)'
            )

    def pause(self) -> None:
        """Whole models: the server pauses once the version starts to load (PausingClient).
        Adapters: the server's install pauses by itself (lora_routes.py)."""
        if self.adapter is None:
            self._pausing().wanted = True

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Sends the trainer's weights as the next version and has vLLM load it."""
        v = self.version + 1
        t0 = time.perf_counter()
        try:
            if self.adapter is not None:
                publish_s = self._send_adapter(iter(iterator), v)
            else:
                publish_s = self._send_model(iter(iterator), v)
        except (ValueError, TypeError):  # the caller's: names the rule
            self._release_quietly()
            raise
        except Exception as e:
            self._release_quietly()
            raise SyncError(
                f"weight sync of version {v} to the vLLM server at {self.server_url} failed: {e}"
            ) from e
        seconds = time.perf_counter() - t0
        self.version = v
        self.history.append(SyncRecord(v, seconds, publish_s, seconds - publish_s))

    def resume(self) -> None:
        if self.adapter is None:
            self._pausing().release()

    def destroy(self) -> None:
        """Closes the publishers and this trainer's Transport (a later sync opens them again)."""
        self._release_quietly()
        engine, adapter = self.engine, self.adapter_trainer
        self.engine = self.adapter_trainer = None
        if engine is not None:
            engine.shutdown()
        if adapter is not None:
            adapter.close()

    # -- the callback that hands over the model ---------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if model is not None:
            self.model = model

    # -- internals --------------------------------------------------------------------------

    def _send_model(self, iterator: Iterator[tuple[str, torch.Tensor]], v: int) -> float:
        if self.engine is None:
            tensors = dict(iterator)
            if not tensors:
                raise ValueError("transport weight transfer: TRL sent no weights to register")
            self.engine = TransportTrainer.trainer_init(
                self.info, client=self.client, source=tensors
            )
        else:
            _refresh(self.engine.tensors, iterator)
        self.engine.send_weights(v)
        times = self.engine.last_times
        return times.publish_s if times is not None else 0.0

    def _send_adapter(self, iterator: Iterator[tuple[str, torch.Tensor]], v: int) -> float:
        for _ in iterator:  # TRL's merged weights are not sent; FSDP's ranks gather in step
            pass
        if self.model is None:
            raise ValueError(
                "transport weight transfer: adapter mode needs the peft model; pass the "
                "transfer to the trainer as a callback too: AsyncGRPOTrainer(..., "
                "weight_transfer=transfer, callbacks=[transfer])"
            )
        if self.adapter_trainer is None:
            info = AdapterTrainerInfo(
                store=self.info.store,
                adapter=self.adapter or "policy",
                namespace=self.info.namespace,
                name=f"{self.info.name}-lora",
                timeout=self.info.timeout,
                peft_adapter=self.model.active_adapters[0],
                as_model=True,
            )
            self.adapter_trainer = AdapterTrainer(self.model, self.client, info)
        t0 = time.perf_counter()
        self.adapter_trainer.send(v)
        return time.perf_counter() - t0

    def _pausing(self) -> PausingClient:
        if not isinstance(self.client, PausingClient):
            raise TypeError("transport weight transfer: pause and resume need its PausingClient")
        return self.client

    def _release_quietly(self) -> None:
        """Resume a pause this transfer made (after a failure: the server serves on)."""
        if isinstance(self.client, PausingClient):
            try:
                self.client.release()
            except Exception as e:  # a dead server cannot be resumed; the sync error says why
                log.warning("could not resume the vLLM server at %s: %s", self.server_url, e)


def _refresh(mine: dict[str, torch.Tensor], iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy what TRL yields into the first sync's tensors where it is other memory; the names
    and shapes are those of the first sync."""
    seen = set()
    for name, t in iterator:
        dst = mine.get(name)
        if dst is None:
            raise ValueError(
                f"transport weight transfer: TRL sent {name!r}, which the first sync did not "
                "have; the weights a trainer syncs are fixed at its first sync"
            )
        if tuple(dst.shape) != tuple(t.shape):
            raise ValueError(
                f"transport weight transfer: {name!r} has shape {tuple(t.shape)}, at the "
                f"first sync {tuple(dst.shape)}"
            )
        if dst.data_ptr() != t.data_ptr():
            dst.copy_(t)
        seen.add(name)
    missing = sorted(set(mine) - seen)
    if missing:
        raise ValueError(
            f"transport weight transfer: TRL did not send {missing[:5]} (of {len(missing)} "
            "missing), which the first sync had"
        )
