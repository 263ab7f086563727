"""The trainer side: publishes with a WeightPublisher and drives vLLM's four update phases."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from transport import PublishResult, Transport, UpdateError, WeightPublisher
from transport.integrations.setup import choose_publisher, connect
from transport.integrations.vllm.checkpoint import NAMES
from transport.integrations.vllm.infos import OPEN, mode_key, update_key
from transport.integrations.vllm.modes.streamed import part_group
from transport.integrations.vllm.plugin import BACKEND
from transport.weights import ShardedPublisher, SourceLayout

log = logging.getLogger(__name__)


@dataclass
class TransportTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of the ``transport`` backend: its store, namespace, weight group and
    peer name; ``timeout`` bounds a publish and each worker's wait for the version;
    ``fanout``/``degree`` as for :class:`~transport.WeightPublisher`: with ``"direct"`` (the
    default) the trainer writes each worker only what it keeps; a chain or a tree relays whole
    checkpoints (its workers are told ``mode="whole"``). The workers get the store, namespace and
    group through ``init_weight_transfer_engine``, and ``dtype``, the dtype this trainer
    publishes (default: its tensors' dtype when they share one), ``mode``, ``staging_device``,
    ``staging_gb`` and ``staging_slots`` when given (see TransportInitInfo), and ``names``, how
    the source names its tensors (default: told from them, see :func:`names_of`). The secret, if any, comes from
    ``$TRANSPORT_SECRET`` on both sides.

    ``layout`` (a :class:`~transport.weights.SourceLayout` of the checkpoint tensors, the same on
    every rank) makes a sharded trainer: every rank passes its own shards as the source and
    publishes them (peer ``<name>-r<rank>``), each writing only its part of every worker's
    checkpoint tensors; rank 0 also drives vLLM's update once every rank's parts landed.

    ``delta`` (``True`` or ``"auto"``, as for :class:`~transport.WeightPublisher`) sends each
    version as the changes against the one before, into every worker that holds it: each worker
    receives the changes of only its own slice (the workers are told to keep an inbox);
    workers that receive streamed or whole checkpoints through a relay take versions whole."""

    backend: ClassVar[str] = BACKEND

    store: str
    namespace: str = "default"
    group: str = "policy"
    name: str = "trainer"
    timeout: float = 60.0
    dtype: str | None = None
    staging_device: str | None = None
    fanout: str = "direct"
    degree: int = 2
    layout: SourceLayout | None = None
    mode: str = "auto"
    staging_gb: float | None = None
    staging_slots: int | None = None
    names: str | None = None
    delta: bool | str = False

    def worker_info(self) -> dict[str, Any]:
        """What each vLLM worker is told (small JSON)."""
        info: dict[str, Any] = {
            "store": self.store,
            "namespace": self.namespace,
            "group": self.group,
            "timeout": self.timeout,
        }
        if self.dtype is not None:
            info["dtype"] = self.dtype
        if self.staging_device is not None:
            info["staging_device"] = self.staging_device
        if self.staging_gb is not None:
            info["staging_gb"] = self.staging_gb
        if self.staging_slots is not None:
            info["staging_slots"] = self.staging_slots
        if self.names not in (None, "model"):
            info["names"] = self.names
        if self.delta:
            info["delta"] = True
        mode = "whole" if self.fanout != "direct" and self.layout is None else self.mode
        if mode != "auto":
            info["mode"] = mode
        return info


@dataclass(frozen=True)
class SendTimes:
    """Where one ``send_weights`` spent its time (seconds): publishing the version into the
    workers' staging memory (vLLM serves meanwhile), then vLLM's start / update / finish and the
    prefix-cache reset (vLLM is busy loading)."""

    publish_s: float
    update_s: float


class TransportTrainer(TrainerWeightTransferEngine[TransportTrainerInitInfo]):
    """Publishes the trainer's weights into vLLM's workers and drives the update.

    It owns a Transport and a WeightPublisher over the source's tensors (the module's own
    parameters: registered once, read at each publish; a source that yields other tensors each
    time, such as gathered shards, is copied into buffers of this engine). Rank 0 sends; other
    ranks do nothing, unless the init info has a ``layout``: then every rank publishes its own
    shards with a :class:`~transport.weights.ShardedPublisher` and rank 0 drives the update.

    :meth:`send_weights` of version ``v``: tell the workers where to listen (a no-op for workers
    that already do, a rejoin for a restarted server), publish ``v`` and wait until it landed,
    then ``start_weight_update``, ``update_weights({"version": v})`` and
    ``finish_weight_update(str(v))`` through the client, and reset vLLM's prefix cache when the
    client can. vLLM's workers change nothing before ``v`` is complete in their staging memory;
    if it never is, ``UpdateError`` says why and vLLM serves its old weights. Workers that
    receive in place or streamed (each says its mode in the store: ``infos.mode_key``) are
    written only inside their ``finish_weight_update``: for them the publish (of every part's
    group, streamed: see streamed.py) runs while the update is driven.
    """

    init_info_cls = TransportTrainerInitInfo

    def __init__(
        self,
        *,
        client: Any,
        source: Any = None,
        is_sender: bool = True,
        info: TransportTrainerInitInfo | None = None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.transport: Transport | None = None
        self.publisher: WeightPublisher | ShardedPublisher | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.version = 0
        self.last_result: PublishResult | None = None
        self.last_times: SendTimes | None = None
        #: streamed versions: the publishers of parts 1, 2, ... (part 0 is the group's)
        self._part_publishers: list[ShardedPublisher] = []

    @classmethod
    def trainer_init(
        cls, init_info: TransportTrainerInitInfo, *, client: Any, source: Any = None
    ) -> TransportTrainer:
        sharded = init_info.layout is not None
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if not engine.is_sender and not sharded:
            return engine
        if source is None:
            raise ValueError(
                "the transport trainer publishes a source of weights: pass source=ModuleSource(model) "
                "(or a mapping of checkpoint names to tensors)"
            )
        engine.tensors = {n: _own(t) for n, t in _items(source)}
        if init_info.names is None:
            init_info = replace(init_info, names=names_of(engine.tensors))
            engine.info = init_info
        elif init_info.names not in NAMES:
            raise ValueError(
                f"transport trainer: names is one of {NAMES} (how the source names its "
                f"tensors), got {init_info.names!r}"
            )
        if init_info.dtype is None:
            layout = init_info.layout
            dtypes = (
                {x.dtype for x in layout.tensors.values()}
                if layout is not None
                else {t.dtype for t in engine.tensors.values()}
            )
            if len(dtypes) == 1:
                init_info = replace(init_info, dtype=str(dtypes.pop()).removeprefix("torch."))
                engine.info = init_info
        t = connect(
            f"{init_info.name}-r{init_info.rank}" if sharded else init_info.name,
            store=init_info.store,
            namespace=init_info.namespace,
            timeout=init_info.timeout,
            hint="the store of the trainer's init info",
        )
        try:
            engine.publisher = choose_publisher(
                t,
                engine.tensors,
                group=init_info.group,
                layout=init_info.layout,
                rank=init_info.rank,
                fanout=init_info.fanout,
                degree=init_info.degree,
                delta=init_info.delta,
            )
            engine.transport = t
            if engine.is_sender:
                client.init_weight_transfer_engine(init_info.worker_info())
        except BaseException:
            if engine.publisher is not None:
                engine.publisher.close()
            t.close()
            raise
        return engine

    # vLLM's signature takes nothing and returns nothing: this one accepts a version and returns
    # the publish result too, and is called as vLLM calls it
    def send_weights(self, version: int | None = None) -> PublishResult | None:  # type: ignore[override]
        """Publish the source's current values as ``version`` (default: the last one + 1) and
        have vLLM load it; returns the publish result (None on a rank that does not send). A
        sharded trainer calls it on every rank with the same versions: each rank publishes its
        shards and returns once the workers completed the version (or its deadline passed); rank
        0 then drives the update."""
        pub, info = self.publisher, self.info
        if info is None or (not self.is_sender and info.layout is None):
            return None
        if pub is None:
            raise RuntimeError("this trainer engine was shut down (or never initialized)")
        v = self.version + 1 if version is None else version
        self._refresh_sources()
        if self.is_sender:
            # workers that listen already ignore this; a restarted server joins the group now
            self.client.init_weight_transfer_engine(info.worker_info())
        if self.is_sender:
            # an update a dead trainer left open holds a version in the workers' staging (with
            # one slot, the slot this version needs): close it first
            self._close_open_update()
        else:
            pub.refresh()  # the group's workers and the modes they chose, before a first publish
        parts = self._finish_parts()
        if parts:
            return self._send_during_update(v, parts)
        t0 = time.perf_counter()
        result = pub.publish(v, timeout=info.timeout).wait(info.timeout + 30)
        self.last_result = result
        t1 = time.perf_counter()
        if not self.is_sender:
            self.version = v
            self.last_times = SendTimes(t1 - t0, 0.0)
            return result
        missing = sorted(set(result.excluded) - set(result.suspects))
        if not result.done or missing:
            # every live worker must load the same version, and one that raises leaves vLLM's
            # executor (several workers) out of step: never ask for what cannot load. A worker
            # lost or suspect (no heartbeat: the workers of a server that was killed) is not
            # one that will be asked.
            raise UpdateError(
                f"version {v} did not reach every vLLM worker (done {result.done}, excluded "
                f"{result.excluded}, lost {result.lost}, reasons {dict(result.reasons)}); vLLM "
                "was not asked to load it and keeps serving the weights it had"
            )
        self.client.start_weight_update()
        try:
            self.client.update_weights({"version": v, "timeout": info.timeout})
        except Exception as e:
            raise UpdateError(
                f"vLLM did not load version {v} ({e}); the publish reported: "
                f"done {result.done}, excluded {result.excluded}, lost {result.lost}, reasons "
                f"{dict(result.reasons)}; vLLM keeps serving the weights it had"
            ) from e
        self.client.finish_weight_update(weight_version=str(v))
        self._reset_prefix_cache()
        self.version = v
        self.last_times = SendTimes(t1 - t0, time.perf_counter() - t1)
        return result

    def _send_during_update(self, v: int, parts: int) -> PublishResult:
        """Workers in place or streamed are written only inside their ``finish_weight_update``:
        publish (every part's group of a streamed version, see streamed.py), and on the sending
        rank drive the update while the version is on its way (workers in staging take it
        meanwhile and load it in the same finish). Returns the result of the worker's group."""
        info = self.info
        assert info is not None
        t0 = time.perf_counter()
        handles = [p.publish(v, timeout=info.timeout) for p in self._publishers(parts)]
        failed: Exception | None = None
        if self.is_sender:
            self.client.start_weight_update()
            try:
                self.client.update_weights({"version": v, "timeout": info.timeout})
                self.client.finish_weight_update(weight_version=str(v))
            except Exception as e:
                failed = e
        results = [h.wait(info.timeout + 30) for h in handles]
        self.last_result = results[0]
        if failed is not None:
            said = "; ".join(
                f"part {k}: done {r.done}, excluded {r.excluded}, lost {r.lost}, reasons "
                f"{dict(r.reasons)}"
                for k, r in enumerate(results)
            )
            raise UpdateError(
                f"vLLM did not take version {v} ({failed}); the publish reported {said}; "
                f"{self._name_torn()}; a worker that reports a torn model (transport_state) is "
                "made whole by the next version"
            ) from failed
        if self.is_sender:
            self._reset_prefix_cache()
        self.version = v
        # nothing lands while vLLM serves: it is busy from the first byte to the reset
        self.last_times = SendTimes(0.0, time.perf_counter() - t0)
        return results[0]

    def _publishers(self, parts: int) -> list[WeightPublisher | ShardedPublisher]:
        """The group's publisher, then one per further part of a streamed version (made at
        first use, over the same tensors: registered once)."""
        pub, t, info = self.publisher, self.transport, self.info
        assert pub is not None and t is not None and info is not None
        for k in range(len(self._part_publishers) + 1, parts):
            layout = info.layout or SourceLayout.single(self.tensors)
            rank = info.rank if info.layout is not None else 0
            self._part_publishers.append(
                ShardedPublisher(t, self.tensors, layout, rank, group=part_group(info.group, k))
            )
        return [pub, *self._part_publishers[: parts - 1]]

    def _finish_parts(self) -> int:
        """How many parts the group's workers receive inside ``finish_weight_update`` (each says
        its mode in the store, signed: worker.mode_key): 1 for workers in place, the most of any
        streamed worker's parts; 0 when every worker takes versions into staging before."""
        pub, t, info = self.publisher, self.transport, self.info
        if pub is None or t is None or info is None:
            return 0
        parts = 0
        for peer in pub.subscribers():
            key = mode_key(info.namespace, info.group, peer)
            value = t.core.signed.read(key, f"the mode {key}", writer=peer)
            said = b"" if value is None else value.body
            if said == b"inplace":
                parts = max(parts, 1)
            elif said.startswith(b"streamed:") and said[9:].isdigit() and len(said) < 20:
                parts = max(parts, int(said[9:]))
        return parts

    def _close_open_update(self) -> None:
        """If a trainer before us left vLLM in an update (it died between start and finish, or
        mid-write), close it without loading what it held: the weights vLLM serves and the
        version it reports stay those of the last finished update, or, where a worker says its
        model is torn, vLLM reports ``torn:V`` until our version loads. Whether one is open,
        each worker says in the store (infos.update_key), so nothing here provokes an error
        from vLLM."""
        pub = self.publisher
        if pub is not None:
            pub.refresh()  # the group's workers, before a first publish of this trainer
        marks = self._update_marks()
        if marks:
            torn = _torn(marks)
            log.warning(
                "vLLM is still in an update that its trainer never finished: dropping the "
                "version it held and finishing it%s, then starting ours",
                f" (its model is torn: vLLM reports weight version {torn})" if torn else "",
            )
            self.client.update_weights({"abandon": True})
            self.client.finish_weight_update(weight_version=torn)

    def _update_marks(self) -> dict[str, bytes]:
        """The group's workers that mark an update open or torn, with their (signed) marks."""
        pub, t, info = self.publisher, self.transport, self.info
        if pub is None or t is None or info is None:
            return {}
        out = {}
        for peer in pub.subscribers():
            key = update_key(info.namespace, info.group, peer)
            value = t.core.signed.read(key, f"the update mark {key}", writer=peer)
            if value is not None and (value.body == OPEN or value.body.startswith(b"torn:")):
                out[peer] = value.body
        return out

    def _name_torn(self) -> str:
        """After an update that failed inside finish: if a worker says its model is torn, finish
        vLLM's update (left open) with the weight version ``torn:V``, so that it reports no
        whole version; what vLLM now reports, for the error message."""
        try:
            torn = _torn(self._update_marks())
            if torn is None:
                return "vLLM keeps reporting the version before"
            self.client.finish_weight_update(weight_version=torn)
        except Exception as e:  # vLLM's executor may answer out of step after a failed call
            return f"vLLM could not be told that its model is torn ({e})"
        return f"vLLM reports weight version {torn!r} until a version loads whole"

    def _reset_prefix_cache(self) -> None:
        reset = getattr(self.client, "reset_prefix_cache", None)
        if reset is not None:
            reset()
        else:
            log.warning(
                "the client cannot reset vLLM's prefix cache: cached prompts keep KV values of the "
                "old weights (use transport.integrations.vllm.trainer.HTTPClient or OfflineClient)"
            )

    def _refresh_sources(self) -> None:
        """A source that yields new tensors each time (gathered shards) is copied in; the
        module's own parameters are the published tensors already."""
        if self.source is None or isinstance(self.source, Mapping):
            return
        for name, t in self.source:
            mine = self.tensors.get(name)
            if mine is not None and mine.data_ptr() != t.data_ptr():
                mine.copy_(t)

    def shutdown(self) -> None:
        pub, t = self.publisher, self.transport
        self.publisher = self.transport = None
        for part in self._part_publishers:
            part.close()
        self._part_publishers = []
        if pub is not None:
            pub.close()
        if t is not None:
            t.close()


#: a tensor of one expert, as a saved checkpoint names it (``...mlp.experts.7.down_proj.weight``)
_ONE_EXPERT = re.compile(r"\.experts\.[0-9]+\.")


def names_of(tensors: Mapping[str, torch.Tensor]) -> str:
    """How a source names its tensors (checkpoint.NAMES): ``"checkpoint"`` when it holds
    experts one tensor per expert matrix, as a saved checkpoint does; else ``"model"``, as
    transformers holds the model in memory (experts fused, or no experts: then both agree)."""
    return "checkpoint" if any(_ONE_EXPERT.search(n) for n in tensors) else "model"


def _items(source: Any) -> Iterable[tuple[str, torch.Tensor]]:
    return source.items() if isinstance(source, Mapping) else iter(source)


def _own(t: torch.Tensor) -> torch.Tensor:
    """The tensor to publish: the parameter's own memory when it is contiguous."""
    t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


class OfflineClient:
    """vLLM's weight-sync client protocol over an in-process ``vllm.LLM`` (whose methods take
    ``{"init_info": ...}`` and ``{"update_info": ...}``), plus ``reset_prefix_cache``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def init_adapter(self, init_info: dict[str, Any]) -> None:
        """Every worker joins the adapter ``init_info`` names (a no-op where nothing changed)."""
        self._adapter("init", init_info)

    def install_adapter(self, update_info: dict[str, Any]) -> list[int | None]:
        """Every worker installs the adapter version ``update_info`` names; then the prefix
        cache is reset (its blocks under the adapter's id hold the previous version's keys and
        values). The versions each worker installed."""
        if update_info.get("as_model"):
            raise ValueError(
                "as_model serves an adapter under the model's name on a server; an in-process "
                "vLLM names the adapter in each request (AdapterTrainer.lora_request())"
            )
        results = self._adapter("install", update_info)
        self.llm.reset_prefix_cache()
        return [r["version"] for r in results]

    def remove_adapter(self, namespace: str, adapter: str) -> None:
        """Every worker takes the adapter out of vLLM and leaves its group."""
        self._adapter("remove", {"namespace": namespace, "adapter": adapter})

    def _adapter(self, action: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
        from transport.integrations.vllm.extension import adapter_call, adapter_results

        results = self.llm.collective_rpc(adapter_call, args=(action, payload))
        return adapter_results(list(results), f"the adapter {action} of {payload.get('adapter')!r}")


class HTTPClient(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP weight-sync client plus ``reset_prefix_cache`` (the server runs with
    ``VLLM_SERVER_DEV_MODE=1``, as the weight-update routes need)."""

    def reset_prefix_cache(self) -> None:
        import requests

        response = requests.post(f"{self.base_url}/reset_prefix_cache", timeout=self.timeout)
        response.raise_for_status()

    def pause(self, mode: str = "keep") -> None:
        """vLLM schedules nothing until :meth:`resume`; ``mode`` says what becomes of running
        requests: ``"keep"`` freezes them (they go on after the resume, on whatever weights
        vLLM then holds), ``"wait"`` lets them finish first (each is served by one version)."""
        import requests

        if mode not in ("keep", "wait"):
            raise ValueError(f"pause mode is 'keep' or 'wait', got {mode!r}")
        params = {"mode": mode, "clear_cache": "false"}
        response = requests.post(f"{self.base_url}/pause", params=params, timeout=self.timeout)
        response.raise_for_status()

    def resume(self) -> None:
        import requests

        response = requests.post(f"{self.base_url}/resume", timeout=self.timeout)
        response.raise_for_status()

    def weight_version(self) -> str | None:
        """The weight version vLLM reports (the last ``finish_weight_update`` named)."""
        import requests

        response = requests.get(f"{self.base_url}/weight_info", timeout=self.timeout)
        response.raise_for_status()
        return response.json().get("weight_version")

    def init_adapter(self, init_info: dict[str, Any]) -> None:
        """The server's workers join the adapter ``init_info`` names (lora_routes.py: the server
        runs with its middleware and the worker extension)."""
        self._adapter_route("init", init_info, init_info.get("timeout", 60) + 60)

    def install_adapter(self, update_info: dict[str, Any]) -> list[int | None]:
        """The server installs the adapter version ``update_info`` names in every worker and
        serves it under the adapter's name; the versions each worker installed."""
        answer = self._adapter_route("install", update_info, update_info["timeout"] + 60)
        return list(answer["installed"])

    def remove_adapter(self, namespace: str, adapter: str) -> None:
        """The server stops serving the adapter and every worker leaves its group."""
        self._adapter_route("remove", {"namespace": namespace, "adapter": adapter}, 120)

    def _adapter_route(self, action: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        import requests

        from transport.integrations.setup import secret_from_env
        from transport.integrations.vllm.lora_routes import PREFIX, install_fields
        from transport.integrations.vllm.lora_spec import proof

        ns, adapter, version = body["namespace"], body["adapter"], body.get("version", 0)
        signed = body  # an init carries its own proof
        if action != "init":
            fields = install_fields(action, ns, adapter, version, body.get("as_model", False))
            signed = {**body, "proof": proof(secret_from_env(ns), *fields)}
        response = requests.post(f"{self.base_url}{PREFIX}{action}", json=signed, timeout=timeout)
        if response.status_code == 404 and "error" not in response.text:
            raise RuntimeError(
                f"the vLLM server at {self.base_url} has no transport adapter routes: start it "
                "with --middleware transport.integrations.vllm.lora_routes.AdapterRoutes and "
                "--worker-extension-cls transport.integrations.vllm.extension.TransportState"
            )
        answer = response.json()
        if response.status_code != 200:
            raise RuntimeError(
                f"the vLLM server refused to {action} adapter {adapter!r} "
                f"({response.status_code}): {answer.get('error')}"
            )
        return dict(answer)


def _torn(marks: dict[str, bytes]) -> str | None:
    """The weight version that names a torn model (``torn:V``, the newest V any worker marks),
    or None when no worker's model is torn."""
    versions = [m[5:] for m in marks.values() if m.startswith(b"torn:") and m[5:].isdigit()]
    return f"torn:{max(int(x) for x in versions)}" if versions else None
