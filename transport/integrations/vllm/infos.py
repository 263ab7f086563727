"""What a vLLM worker's transport engine is told and what it reports: the init and update infos
(small JSON: they also travel over HTTP), its state, and the store keys it writes for trainers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from transport.integrations.vllm.checkpoint import NAMES
from transport.integrations.vllm.lora_spec import AdapterConfig, check_proof

#: the version a worker reports after an update that did not reach every layer
TORN = -2
#: what a worker may receive: chosen, its TP slice in vLLM's format (staged, or straight into
#: the parameters it computes with), or checkpoint tensors whole
MODES = ("auto", "sharded", "inplace", "streamed", "whole")
#: the values of a worker's update mark (see update_key)
OPEN, CLOSED = b"open", b"closed"


def torn_mark(version: int) -> bytes:
    """The update mark of a worker whose model holds parts of ``version`` and of the version
    before (see update_key)."""
    return f"torn:{version}".encode()


def update_key(namespace: str, group: str, peer: str) -> str:
    """The store key where worker ``peer`` marks (signed) whether vLLM has an update open on it:
    ``open`` from ``start_weight_update`` until a finish succeeds or an update call fails, as
    vLLM's own flag. A trainer reads it before starting: an update its predecessor left open is
    closed first, without provoking vLLM's error (with several workers, vLLM's executor reads
    only the first worker's error reply and hands the others to the calls that follow).
    ``torn:V`` (:func:`torn_mark`) after an update that left the model holding parts of version
    ``V`` and of the one before (in place or streamed; vLLM keeps that update open): the trainer
    finishes it with the weight version ``torn:V``, so that vLLM reports no whole version until
    the next one loads."""
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
    ``finish_weight_update``), ``"streamed"`` the same through two buckets of half the staging
    bound each, part by part, into vLLM's reload inside ``finish_weight_update`` (see
    streamed.py), ``"whole"`` every checkpoint tensor whole (vLLM's loader shards them),
    ``"auto"`` (default) sharded, or when one staging copy would not fit within the bound in
    place where it can and streamed where it cannot; whole when nothing could be mapped.
    ``staging_device`` is where the staging copies live (default: the worker's device;
    ``"cpu"`` keeps them out of GPU memory). ``staging_gb`` bounds them; without it the bound
    is a share of the memory free on that device after vLLM's own allocation, measured when the
    worker joins (room.py). ``staging_slots`` says how many (1 or 2; default: two if they fit
    within the bound, else one): with two, the next version lands while vLLM loads one; with
    one, it waits for that load. A worker whose copies would not fit refuses to join and says
    what they need.
    ``name`` prefixes this worker's peer name (host, pid and rank follow). ``timeout`` bounds
    joining the store. ``names`` says how the trainer names its tensors: ``"model"`` as
    transformers holds the model in memory (experts fused: ``mlp.experts.gate_up_proj``),
    ``"checkpoint"`` as its saved checkpoint does (one tensor per expert matrix); the trainer
    engine tells (see checkpoint.py). ``delta=True`` gives the worker an inbox for a version's
    changes (a quarter of the bytes it receives), so that a trainer publishing with ``delta``
    sends only what changed in this worker's slice (sharded and in place; streamed and whole
    workers take versions whole). The secret, if the namespace has one, comes from
    ``$TRANSPORT_SECRET`` in vLLM's environment, never from this message.

    ``adapter`` makes this the init of one named LoRA adapter instead of the base model's group
    (modes/lora.py): ``rank``, ``alpha``, ``targets`` and ``rslora`` are its config
    (lora_spec.AdapterConfig), ``group`` carries its versions. An init of an adapter joins or
    replaces that adapter alone (the base group and other adapters are left as they are); its
    secret comes from ``$TRANSPORT_SECRET_<NAMESPACE>`` when set (one per tenant), else from
    ``$TRANSPORT_SECRET``; where there is one, ``proof`` must be lora_spec.proof of
    :meth:`adapter_fields` under it (the adapter trainer sends it), so that a caller without the
    secret cannot replace a tenant's adapter."""

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
    names: str = "model"
    delta: bool = False
    adapter: str | None = None
    rank: int = 0
    alpha: float = 0.0
    targets: list[str] = field(default_factory=list)
    rslora: bool = False
    proof: str = ""

    def __post_init__(self) -> None:
        if self.adapter is not None:
            if not isinstance(self.adapter, str) or not self.adapter:
                raise ValueError("transport init_info: adapter must be a non-empty string")
            self.adapter_config()  # refuses a bad rank, alpha or targets, naming it
        if not isinstance(self.delta, bool):
            raise ValueError(f"transport init_info: delta is true or false, got {self.delta!r}")
        if self.names not in NAMES:
            raise ValueError(
                f"transport init_info: names is one of {NAMES} (how the trainer names its "
                f"tensors), got {self.names!r}"
            )
        if self.staging_slots is not None and (
            type(self.staging_slots) is not int or self.staging_slots not in (1, 2)
        ):
            raise ValueError(
                f"transport init_info: staging_slots is 1 or 2, got {self.staging_slots!r}"
            )
        if self.mode not in MODES:
            raise ValueError(f"transport init_info: mode must be one of {MODES}, got {self.mode!r}")
        if self.staging_gb is not None and (not _number(self.staging_gb) or self.staging_gb <= 0):
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
        for name in ("store", "namespace", "group", "name"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"transport init_info: {name} must be a non-empty string")
        if self.dtype is not None and not (
            isinstance(self.dtype, str)
            and isinstance(getattr(torch, self.dtype, None), torch.dtype)
        ):
            raise ValueError(
                f"transport init_info: dtype {self.dtype!r} is not a torch dtype name "
                "(for example 'float32' or 'bfloat16')"
            )
        if not _number(self.timeout) or self.timeout <= 0:
            raise ValueError(f"transport init_info: timeout must be > 0 s, got {self.timeout!r}")
        if (
            type(self.rank) is not int
            or not _number(self.alpha)
            or not isinstance(self.targets, (list, str))
            or not all(isinstance(t, str) for t in self.targets)
            or not isinstance(self.rslora, bool)
            or not isinstance(self.proof, str)
        ):
            raise ValueError(
                "transport init_info: an adapter's rank is an int, alpha a number, targets "
                "module names (a list, or one string), rslora true or false and proof a string"
            )

    def adapter_config(self) -> AdapterConfig:
        """The adapter's config (for an init with ``adapter``)."""
        targets = self.targets if isinstance(self.targets, list) else [self.targets]
        return AdapterConfig(self.rank, self.alpha, tuple(sorted(targets)), bool(self.rslora))

    def adapter_fields(self) -> tuple[Any, ...]:
        """What the proof of an adapter's init covers."""
        c = self.adapter_config()
        return (
            "init",
            self.namespace,
            self.adapter,
            self.group,
            c.rank,
            c.alpha,
            c.targets,
            c.rslora,
        )

    def check_proof(self) -> None:
        """PermissionError unless ``proof`` proves this adapter init under the namespace's
        secret in this process's environment (none to prove without one)."""
        from transport.integrations.setup import secret_from_env

        check_proof(
            secret_from_env(self.namespace),
            self.proof,
            f"the init of adapter {self.adapter!r} of namespace {self.namespace}",
            *self.adapter_fields(),
        )

    def adapter_key(self) -> tuple[Any, ...]:
        """What identifies an adapter's init: the same again is a no-op."""
        return (self.store, self.namespace, self.group, self.timeout, self.adapter_config())


@dataclass
class TransportUpdateInfo(WeightTransferUpdateInfo):
    """Which version an update loads: ``version`` exactly (every TP rank then loads the same
    one; the trainer side always names it), or the newest complete one when None. ``timeout``
    bounds the wait for it; past it the update fails and vLLM keeps its weights.
    ``abandon=True`` drops a version an earlier update call held whose ``finish_weight_update``
    never came (its trainer died): the finish that follows then loads nothing. ``adapter``
    names the LoRA adapter (of ``namespace``) whose version is installed (through the worker
    extension's ``transport_adapter_update``, not vLLM's update phases: see modes/lora.py)."""

    version: int | None = None
    timeout: float = 60.0
    abandon: bool = False
    adapter: str | None = None
    namespace: str = "default"

    def __post_init__(self) -> None:
        if self.version is not None and (
            not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 0
        ):
            raise ValueError(
                f"transport update_info: version must be an int >= 0, got {self.version!r}"
            )
        if not _number(self.timeout) or self.timeout <= 0:
            raise ValueError(f"transport update_info: timeout must be > 0 s, got {self.timeout!r}")
        if not isinstance(self.abandon, bool):
            raise ValueError(
                f"transport update_info: abandon is true or false, got {self.abandon!r}"
            )
        if not (self.adapter is None or (isinstance(self.adapter, str) and self.adapter)):
            raise ValueError("transport update_info: adapter is a non-empty string or null")
        if not (isinstance(self.namespace, str) and self.namespace):
            raise ValueError("transport update_info: namespace must be a non-empty string")


@dataclass(frozen=True)
class EngineState:
    """What one worker's engine holds: its ``peer`` name and ``mode``; ``version``, the version
    the model holds (-1: the weights it started with, -2: none whole); ``held``, a version an
    update holds until ``finish_weight_update`` loads it; the newest ``complete`` and any
    ``incomplete`` version in staging; ``version_bytes``, the bytes of one version this worker
    receives; ``staging_slots`` and ``staging_bytes``, its staging copies and the memory they
    hold (counted from its buffers); ``fallback``, the checkpoint tensors that travel whole, with
    why; ``parts``, the groups a version comes in (more than one: streamed, see streamed.py);
    ``staging_bound``, the most bytes it may stage (``staging_gb``, or the free memory it
    measured at init: room.py); ``experts``, per mixture-of-experts layer (its experts'
    checkpoint prefix), the experts it receives: all of them under tensor parallelism (a slice
    of each), its own under expert parallelism."""

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
    parts: int
    staging_bound: int = 0
    experts: dict[str, list[int]] = field(default_factory=dict)
    adapters: dict[str, AdapterState] = field(default_factory=dict)


@dataclass(frozen=True)
class AdapterState:
    """One LoRA adapter of a worker: its ``namespace`` and ``group``, the LoRA ``lora_id`` vLLM
    serves it under, ``version``, the version installed (None: none yet), ``registered``,
    whether vLLM's registry holds it now (vLLM drops every adapter at the end of its own weight
    updates), the newest ``complete`` version in staging, ``version_bytes`` (what this worker
    receives of a version: its TP slices) and its ``rank``, ``alpha`` and ``targets``."""

    namespace: str
    group: str
    lora_id: int
    version: int | None
    registered: bool
    complete: int | None
    version_bytes: int
    rank: int
    alpha: float
    targets: tuple[str, ...]


def _number(value: object) -> bool:
    """Whether a JSON value is a number (true and false are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse(cls: Any, given: Any, what: str) -> Any:
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
