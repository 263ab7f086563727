"""The trainer side of LoRA adapters: a peft model's adapter, published as a named adapter of a
vLLM server (or an in-process ``vllm.LLM``) and installed into its LoRA slots from memory."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from transport import PublishResult, Transport, UpdateError
from transport.integrations.setup import choose_publisher, connect, secret_from_env
from transport.integrations.vllm.infos import TransportInitInfo
from transport.integrations.vllm.lora_spec import (
    AdapterConfig,
    adapter_group,
    adapter_id,
    from_peft,
    proof,
)
from transport.weights import ShardedPublisher, SourceLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterTrainerInfo:
    """Where an adapter goes: the ``store`` and ``namespace`` the vLLM workers join (a tenant's
    own namespace, with its own secret, keeps other tenants out), the ``adapter``'s name as
    requests name it, ``group`` (default ``adapter.<adapter>``), this trainer's peer ``name``
    (default ``lora-<adapter>``), ``timeout`` (seconds a publish and each worker's wait may
    take) and ``peft_adapter``, which adapter of the peft model to publish. ``rank`` of
    ``world``: a trainer whose adapter is sharded over ``world`` ranks (FSDP: every A and B split
    along its first dim as ``torch.chunk`` splits it); every rank publishes its own shards and
    rank 0 has vLLM install each version once every rank's parts landed. ``as_model``: a
    server also serves the adapter under the base model's name (lora_routes.py), so that
    requests for the model get the adapter (an RL rollout that names the model)."""

    store: str
    adapter: str = "policy"
    namespace: str = "default"
    group: str | None = None
    name: str | None = None
    timeout: float = 60.0
    peft_adapter: str = "default"
    rank: int = 0
    world: int = 1
    as_model: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(
                f"transport adapter trainer: rank {self.rank!r} is not one of the {self.world!r} "
                "ranks of the trainer"
            )
        for field in ("store", "adapter", "namespace", "peft_adapter"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise ValueError(f"transport adapter trainer: {field} is a non-empty string")
        if not isinstance(self.timeout, (int, float)) or self.timeout <= 0:
            raise ValueError(f"transport adapter trainer: timeout is > 0 s, got {self.timeout!r}")


class AdapterTrainer:
    """Publishes one LoRA adapter of a peft model into vLLM's LoRA slots.

    It owns a Transport and the publisher of the adapter's group over the adapter's own A and B
    parameters (registered once, read at each publish: nothing of the base model is sent), and
    drives the install through ``client``: :class:`~transport.integrations.vllm.trainer.
    OfflineClient` for an in-process ``vllm.LLM``, or
    :class:`~transport.integrations.vllm.trainer.HTTPClient` for a server (see its
    ``install_adapter``). Each worker declares the slices of A and B its LoRA layers keep, and is
    written only those.

    Sharded (``info.world`` > 1): each rank passes its own model (its parameters, or ``shards``:
    its local shard of each tensor by the names of lora_spec, for a model whose parameters are
    FSDP's shards) and publishes only its shards, so no rank gathers; each worker is written, by
    each rank, the part of its slices that rank holds.

    :meth:`send` of version ``v``: tell the workers the adapter (a no-op where they know it; a
    restarted server joins now), publish ``v`` and wait until every worker holds it complete,
    then have every worker install it. A version that does not reach every worker is not
    installed anywhere (:class:`~transport.integrations.vllm.trainer.UpdateError` says why),
    and vLLM serves the version it had.
    """

    def __init__(
        self,
        model: Any,
        client: Any,
        info: AdapterTrainerInfo,
        shards: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        config, tensors = from_peft(model, info.peft_adapter)
        dtypes = {t.dtype for t in tensors.values()}
        if len(dtypes) != 1:
            raise ValueError(
                f"transport adapter trainer: the adapter's tensors have dtypes {sorted(map(str, dtypes))}; "
                "publish one dtype"
            )
        self.info = info
        self.config: AdapterConfig = config
        self.client = client
        self.dtype = str(dtypes.pop()).removeprefix("torch.")
        self.group = info.group or adapter_group(info.adapter)
        self.version = 0
        self.last_result: PublishResult | None = None
        self.publisher: ShardedPublisher | None = None
        self.layout: SourceLayout | None = None
        if info.world > 1:  # this rank's shards of the adapter's tensors, and every rank's
            shapes = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
            self.layout = SourceLayout.split(info.world, shapes)
            tensors = (
                dict(shards) if shards is not None else _shards(tensors, self.layout, info.rank)
            )
        self.tensors = tensors
        default = f"lora-{info.adapter}" + (f"-r{info.rank}" if info.world > 1 else "")
        self.transport: Transport | None = connect(
            info.name or default,
            store=info.store,
            namespace=info.namespace,
            timeout=info.timeout,
            hint="the store of the adapter trainer's info",
        )
        try:
            self.publisher = choose_publisher(  # type: ignore[assignment]
                self.transport, tensors, group=self.group, layout=self.layout, rank=info.rank
            )
            if info.rank == 0:
                client.init_adapter(self.worker_info())
        except BaseException:
            self.close()
            raise

    @property
    def lora_id(self) -> int:
        """The LoRA id vLLM serves this adapter under."""
        return adapter_id(self.info.namespace, self.info.adapter)

    def worker_info(self) -> dict[str, Any]:
        """What each vLLM worker is told (small JSON: the client's ``init_adapter``), with the
        proof that this trainer holds the namespace's secret (lora_spec.proof)."""
        info: dict[str, Any] = {
            "store": self.info.store,
            "namespace": self.info.namespace,
            "group": self.group,
            "timeout": self.info.timeout,
            "dtype": self.dtype,
            "adapter": self.info.adapter,
            "rank": self.config.rank,
            "alpha": self.config.alpha,
            "targets": list(self.config.targets),
            "rslora": self.config.rslora,
        }
        fields = TransportInitInfo(**info).adapter_fields()
        return {**info, "proof": proof(secret_from_env(self.info.namespace), *fields)}

    def send(self, version: int | None = None) -> PublishResult:
        """Publish the adapter's current values as ``version`` (default: the last one + 1) and
        have vLLM serve it; returns the publish result."""
        pub = self.publisher
        if pub is None:
            raise RuntimeError("this adapter trainer was closed")
        v = self.version + 1 if version is None else version
        timeout = self.info.timeout
        if self.info.rank == 0:
            # workers that hold the adapter already ignore this; a restarted server joins now
            self.client.init_adapter(self.worker_info())
        result = pub.publish(v, timeout=timeout).wait(timeout + 30)
        self.last_result = result
        if self.info.rank != 0:  # rank 0 has vLLM install it
            self.version = v
            return result
        if not result.done or result.excluded:
            raise UpdateError(
                f"version {v} of adapter {self.info.adapter!r} did not reach every vLLM worker "
                f"(done {result.done}, excluded {result.excluded}, lost {result.lost}, reasons "
                f"{dict(result.reasons)}); it was not installed, and vLLM serves the version it "
                "had"
            )
        update = {
            "adapter": self.info.adapter,
            "namespace": self.info.namespace,
            "version": v,
            "timeout": timeout,
        }
        if self.info.as_model:
            update["as_model"] = True
        try:
            installed = self.client.install_adapter(update)
        except Exception as e:
            raise UpdateError(
                f"vLLM did not install version {v} of adapter {self.info.adapter!r} ({e}); the "
                "publish reached every worker"
            ) from e
        if any(x != v for x in installed):
            raise UpdateError(
                f"vLLM's workers installed versions {installed} of adapter "
                f"{self.info.adapter!r}, not {v}"
            )
        self.version = v
        return result

    def remove(self) -> None:
        """vLLM stops serving the adapter (requests naming it are refused) and its workers leave
        its group; the trainer stays open (a later :meth:`send` serves it again)."""
        self.client.remove_adapter(self.info.namespace, self.info.adapter)

    def lora_request(self) -> Any:
        """The ``vllm.lora.request.LoRARequest`` that names this adapter (in-process vLLM)."""
        return adapter_request(self.info.adapter, self.info.namespace)

    def close(self) -> None:
        pub, t = self.publisher, self.transport
        self.publisher = self.transport = None
        if pub is not None:
            pub.close()
        if t is not None:
            t.close()


def adapter_request(adapter: str, namespace: str = "default") -> Any:
    """The ``LoRARequest`` that names adapter ``adapter`` of ``namespace`` in an in-process
    ``vllm.LLM`` (its id is :func:`~transport.integrations.vllm.lora_spec.adapter_id`; its path
    names no folder: vLLM never loads it from one)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(
        lora_name=adapter,
        lora_int_id=adapter_id(namespace, adapter),
        lora_path=f"/transport/{namespace}/{adapter}",
    )


def _shards(
    tensors: Mapping[str, torch.Tensor], layout: SourceLayout, rank: int
) -> dict[str, torch.Tensor]:
    """``rank``'s shard of each tensor: a DTensor's local shard (FSDP2 shards dim 0, as
    ``layout`` says), or a view of the rows ``layout`` gives it of a whole tensor."""
    out = {}
    for name, t in tensors.items():
        held = layout.tensors[name].held[rank]
        local = getattr(t, "to_local", None)
        if local is not None:
            out[name] = local()
        elif held.dim is None:
            out[name] = t
        else:
            out[name] = t.narrow(held.dim, held.start, held.stop - held.start)
    return out
