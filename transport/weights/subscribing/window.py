"""WindowedSubscriber: versions written straight into the tensors an engine computes with, and
only while the engine waits for one."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from transport import ClosedError, TransferTimeout, Transport, VersionGoneError
from transport.weights.layouts import DestTensor
from transport.weights.subscribing.subscriber import WeightSubscriber


class WindowedSubscriber(WeightSubscriber):
    """Receives versions of ``group`` in place, into ``named_tensors`` themselves (no staging
    memory), and only inside :meth:`receive`: an engine that computes between two receives never
    reads a half-written version from publishers that keep the protocol (what one that does not
    leaves behind is named: :attr:`torn`).

    It owns the **window** (shut, or open for one version) on top of what a
    :class:`WeightSubscriber` in place owns. Rules:

    * Publishers see a one-slot staging subscriber whose slot is the live tensors, so they write
      it only when it is credited; it is credited only while ``receive(v)`` waits and no version
      has completed since it opened. The window shuts when one completes, at the deadline, at
      :meth:`shut` (another thread gives up the wait) and at :meth:`close`.
    * Writing is not atomic: a version that began and did not complete (its publisher died or
      missed its deadline) leaves the tensors **torn**, parts of two versions; :attr:`torn` names
      it until a later version completes (every byte of that one written). A publisher that began
      after the window shut (a withdrawn credit still on its way) tears them too, and is named
      the same way.
    * ``receive(v)`` returns ``v`` once complete. Another version completing in its place raises
      VersionGoneError (the tensors hold that one: :attr:`version`); the deadline raises
      TransferTimeout saying whether the tensors are torn.
    * No relay, no :meth:`read` or :meth:`pull` (they would read or write outside the window);
      ``layout`` and ``source_shapes`` as for WeightSubscriber.
    """

    JOINS_AS = "staging"  # publishers write only the slots it credits

    def __init__(
        self,
        transport: Transport,
        named_tensors: Mapping[str, torch.Tensor],
        group: str = "policy",
        on_update: Callable[[int], object] | None = None,
        poll_interval: float | None = None,
        layout: Mapping[str, DestTensor] | None = None,
        source_shapes: Mapping[str, Sequence[int]] | None = None,
        delta: bool | int = False,
    ) -> None:
        self._window: int | None = None  # while open: the version held when it opened
        self._receiving = threading.Lock()
        self._shut = False  # shut() was called on the open window
        super().__init__(
            transport,
            named_tensors,
            group,
            mode="inplace",
            on_update=on_update,
            poll_interval=poll_interval,
            relay=False,
            layout=layout,
            source_shapes=source_shapes,
            delta=delta,
        )

    def _free_slots(self) -> list[int]:
        window = self._window  # open until any version completes in it
        return [0] if window is not None and self.version == window and not self._closed else []

    @property
    def torn(self) -> int | None:
        """The version that began writing the live tensors and did not complete (they hold parts
        of it and of :attr:`version`), or None when they hold :attr:`version` whole."""
        with self._lock:
            return self.begun if self.begun > self.version else None

    def receive(self, version: int, timeout: float) -> int:
        """Open the window for ``version``, wait until it is complete in the live tensors (at most
        ``timeout`` seconds, or until :meth:`shut`) and shut it; returns ``version``. See the
        class's rules."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        if not self._receiving.acquire(blocking=False):
            raise RuntimeError("a receive() is in progress here: one at a time")
        try:
            with self._lock:
                if self._closed:
                    raise ClosedError("the subscriber was closed")
                opened = self.version
                if opened != version:
                    self._window, self._shut = opened, False
            if self._window is not None:
                self._credit_publishers()
                try:
                    self.wait_for_version(opened + 1, timeout)  # versions only move forward
                except TransferTimeout:
                    torn, held = self.torn, self.version
                    why = "its window was shut" if self._shut else f"not within {timeout:.3g} s"
                    raise TransferTimeout(
                        f"version {version} of group {self.group!r} was not received ({why}); "
                        + (
                            f"the live tensors are torn (version {torn} began writing them and "
                            "did not complete); the next complete version makes them whole"
                            if torn is not None
                            else f"nothing was written: they hold version {held} whole"
                        )
                    ) from None
                finally:
                    with self._lock:
                        self._window = None
                    self._credit_publishers()  # withdrawn
            with self._lock:
                got = self.version
        finally:
            self._receiving.release()
        if got != version:
            raise VersionGoneError(
                f"version {got} of group {self.group!r} was written in place of version "
                f"{version}: the live tensors hold version {got}"
            )
        return got

    def _check_waiting(self, min_version: int) -> None:
        super()._check_waiting(min_version)
        if self._shut:
            raise TransferTimeout("its window was shut")  # receive() says which version

    def shut(self) -> None:
        """Shut the window a :meth:`receive` holds open now: it raises TransferTimeout at once
        (a publisher already writing goes on until its deadline, and tears the tensors)."""
        with self._lock:
            if self._window is not None:
                self._shut = True
                self._lock.notify_all()

    def pull(self, publisher: str, timeout: float | None = None) -> int:
        raise ValueError(
            "a WindowedSubscriber is written only inside receive(): pull() would write its live "
            "tensors outside the window"
        )
