"""The interface every mode of a vLLM worker implements, and what the engine hands each one."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from transport import Transport
from transport.integrations.vllm.infos import TransportInitInfo, TransportUpdateInfo
from transport.integrations.vllm.room import Room
from transport.integrations.vllm.shards import WorkerLayout


@dataclass
class Worker:
    """What a mode works with, from the engine of one vLLM worker: its Transport (the mode's
    subscribers live on it; the engine closes it), the init info it joined with, vLLM's model of
    this worker and its config, the worker's device and staging device, the staging bound, the
    checkpoint tensors' spec (names, shapes, dtypes), and ``tied``, which parameter names are one
    tensor (reload.tied_parameters: learned before any reload)."""

    transport: Transport
    info: TransportInitInfo
    model: Any
    model_config: Any
    device: torch.device
    staging: torch.device
    room: Room
    spec: Mapping[str, torch.Tensor]
    tied: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Held:
    """What a mode holds in memory, for the engine's state: ``held``, a version an update holds
    until the finish loads it; ``complete`` and ``incomplete``, the newest of each in staging;
    ``slots`` and ``nbytes``, its staging copies and the bytes they take (counted from its
    buffers); ``parts``, the groups one version comes in."""

    held: int | None = None
    complete: int | None = None
    incomplete: int | None = None
    slots: int = 0
    nbytes: int = 0
    parts: int = 1


class Mode(ABC):
    """One way a vLLM worker receives versions of its group. It owns its subscriber(s) and
    staging memory (never the Transport). Rules every mode keeps:

    * nothing of the model changes before :meth:`finish`; what :meth:`receive` waits for it
      holds (the publisher does not write it meanwhile) until :meth:`finish` or :meth:`drop`;
    * :meth:`finish` returns the version now in the model (None: nothing was loaded), raises
      :class:`TornModelError` when part of a version reached the model and the rest did not, and any
      other error when nothing reached it;
    * :meth:`close` lets go of every subscriber and buffer; the mode is not used after."""

    #: the mode's name as the init info and the worker's state say it
    name: ClassVar[str]
    #: its subscriber (the first part's, streamed), made by the subclass
    subscriber: Any

    def __init__(self, worker: Worker, layout: WorkerLayout) -> None:
        self.worker = worker
        self.layout = layout

    @property
    def written_in_finish(self) -> bool:
        """Whether its publisher writes only inside ``finish_weight_update`` (the trainer
        publishes while it drives the update, not before)."""
        return False

    @property
    def said(self) -> str:
        """What this worker tells trainers in the store about its mode (infos.mode_key)."""
        return self.name

    @property
    @abstractmethod
    def group(self) -> str:
        """The weight group it receives (its first part's, streamed)."""

    @abstractmethod
    def receive(self, update: TransportUpdateInfo) -> None:
        """``update_weights``: wait for the version ``update`` names and hold it, or note which
        version the finish receives."""

    @abstractmethod
    def finish(self) -> int | None:
        """``finish_weight_update``: the held or named version into the model."""

    def drop(self) -> int | None:
        """Let go of what an update holds (the publisher may write it again); returns the version
        that was held (None: none)."""
        return None

    @abstractmethod
    def held(self) -> Held:
        """What it holds, for the engine's state."""

    @property
    @abstractmethod
    def need(self) -> int:
        """Staging bytes it took at init."""

    @abstractmethod
    def close(self) -> None:
        """Close its subscribers; its buffers go with them."""


#: the function that makes a mode (the mode's class): what choice.py returns
ModeFactory = Callable[[Worker, WorkerLayout], Mode]


class Staging(Mode):
    """A mode whose versions land in staging copies while vLLM serves: :meth:`receive` waits for
    the version in ``self.subscriber`` (a staging WeightSubscriber the subclass makes) and holds
    its slot, so the publisher does not write it; :meth:`drop` lets go of it."""

    _stack: contextlib.ExitStack | None = None
    _snapshot: Any = None

    @property
    def group(self) -> str:
        return str(self.subscriber.group)

    @property
    def snapshot(self) -> Any:
        """The version held (a Snapshot: ``version``, ``tensors``), None when none is."""
        return self._snapshot

    def receive(self, update: TransportUpdateInfo) -> None:
        self.drop()
        stack = contextlib.ExitStack()
        self._snapshot = stack.enter_context(
            self.subscriber.read(update.version, timeout=update.timeout)
        )
        self._stack = stack

    def drop(self) -> int | None:
        stack, snap = self._stack, self._snapshot
        self._stack = self._snapshot = None
        if stack is not None:
            stack.close()
        return None if snap is None else int(snap.version)


class WrittenInFinish(Mode):
    """A mode whose publisher writes only inside ``finish_weight_update``: :meth:`receive`
    notes the version (it must be named), :meth:`finish` of the subclass receives it
    (:meth:`take` hands it over once)."""

    _wanted: TransportUpdateInfo | None = None

    @property
    def written_in_finish(self) -> bool:
        return True

    def receive(self, update: TransportUpdateInfo) -> None:
        if update.version is None:
            raise ValueError(
                f"transport update_info: a worker {self.name} is written inside "
                "finish_weight_update and needs the version named (the trainer engine does)"
            )
        self._wanted = update

    def take(self) -> TransportUpdateInfo | None:
        """The update the finish receives (None: none was named), once."""
        wanted, self._wanted = self._wanted, None
        return wanted

    def drop(self) -> int | None:
        self._wanted = None
        return None
