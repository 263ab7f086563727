"""A weight-sync member (a WeightSubscriber or a WeightPublisher) in a child process, driven over a
pipe, like :mod:`helpers.peer`.

Tensors are described by a :data:`Spec` (name -> shape and dtype) and, in every test, every element
of every tensor of version N holds the value N; the child reports per tensor the smallest and the
largest element, so ``(N, N)`` for every tensor means that every byte of version N arrived. Every
call has a deadline; nothing here sleeps.

A subscriber child also watches the group's control messages as they arrive (the same channel the
subscriber listens on) and checks the staging rule of the protocol: a ``begin`` never names the
slot that holds the newest complete version, nor the slot ``apply()`` is copying from.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from typing import Any

import torch

from helpers import internals
from helpers.child import START_TIMEOUT, ChildError, ChildProcess, serve

Spec = dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype name)

MiB = 1 << 20


def spec_of(n: int, numel: int, dtype: str = "float32", prefix: str = "w") -> Spec:
    """``n`` tensors of ``numel`` elements: ``{prefix}0`` ... ``{prefix}{n-1}``."""
    return {f"{prefix}{i}": ((numel,), dtype) for i in range(n)}


def make_tensors(spec: Spec, value: float = 0.0) -> dict[str, torch.Tensor]:
    return {
        n: torch.full(shape, value, dtype=getattr(torch, dt)) for n, (shape, dt) in spec.items()
    }


def extremes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Per tensor, (smallest, largest) element: equal to (v, v) iff every element is v."""
    out = {}
    for n, t in tensors.items():
        lo, hi = torch.aminmax(t)
        out[n] = (float(lo), float(hi))
    return out


class _Watch:
    """What a subscriber child has seen: control messages, on_update calls, rule violations."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.messages: list[tuple[str, int | None, int | None]] = []  # (kind, version, slot)
        self.senders: list[str] = []  # who sent each message
        self.updates: list[int] = []
        self.violations: list[str] = []
        self.snapshots = 0  # taken so far by the running snapshot loop

    def on_update(self, version: int) -> None:
        with self.cond:
            self.updates.append(version)
            self.cond.notify_all()

    def wait(self, pred: Any, timeout: float, what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(pred, timeout):
                raise TimeoutError(f"{what} did not happen within {timeout} s")


def publish_served(pub: Any, tensors: dict[str, torch.Tensor], version: int, subs: Any) -> None:
    """Fill every tensor with ``version``, publish it and check that every subscriber process
    of ``subs`` is done, has it applied and holds it whole (every element equal to it)."""
    for t in tensors.values():
        t.fill_(version)
    r = pub.publish(version, timeout=20).wait(30)
    assert r.status == {s.name: "done" for s in subs}, r.reasons
    for s in subs:
        assert s.call("wait_for_version", version, 10) == version
        assert s.call("apply") == version
        assert s.call("live") == {n: (float(version), float(version)) for n in tensors}


def _sub_child(
    conn: Any,
    name: str,
    store: str,
    spec: Spec,
    group: str,
    mode: str,
    relay: bool,
    kwargs: dict[str, Any],
    slots: int = 2,
) -> None:
    import transport
    from transport.weights.group.messages import Begin, decode
    from transport.weights.group.region_names import channel

    watch = _Watch()
    try:
        t = transport.Transport(name, store=store, **kwargs)
        if mode == "window":  # in place, written only inside receive()
            sub = transport.weights.WindowedSubscriber(
                t, make_tensors(spec), group=group, on_update=watch.on_update
            )
        else:
            sub = transport.WeightSubscriber(
                t,
                make_tensors(spec),
                group=group,
                mode=mode,
                on_update=watch.on_update,
                relay=relay,
                **({"slots": slots} if mode == "staging" else {}),
            )

        def spy(original: Any, peer: str, payload: bytes) -> None:
            try:
                m = decode(payload)
            except Exception:
                m = None
            if isinstance(m, Begin) and mode == "staging":
                newest, held, forwarding, _ = internals.slot_state(sub)
                if m.slot in (newest, held) or m.slot in forwarding:
                    with watch.cond:
                        watch.violations.append(
                            f"begin of version {m.version} in slot {m.slot} from {peer} while the "
                            f"newest complete version is in slot {newest}, apply() holds slot "
                            f"{held} and forwards read slots {forwarding}"
                        )
            original(peer, payload)
            if m is not None:
                with watch.cond:
                    kind, version, slot = (
                        m.KIND,
                        getattr(m, "version", None),
                        getattr(m, "slot", None),
                    )
                    watch.messages.append((kind, version, slot))
                    watch.senders.append(peer)
                    watch.cond.notify_all()

        internals.spy_on_messages(sub, t, channel(group), spy)  # in the subscriber's place
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (t.generation, os.getpid())))

    loop: dict[str, Any] = {}

    def state() -> dict[str, Any]:
        return {
            "version": sub.version,
            "applied": sub.applied_version,
            "incomplete": sub.incomplete,
        }

    def staging() -> dict[str, Any]:
        """The newest complete version's slot and the extremes of every staging slot."""
        newest, _, _, versions = internals.slot_state(sub)
        return {
            "newest": newest,
            "slot_versions": versions,
            "slots": [extremes(s) for s in sub.staging],
        }

    def wait_message(kind: str, version: int, timeout: float) -> list[Any]:
        watch.wait(
            lambda: any(k == kind and v == version for k, v, _ in watch.messages),
            timeout,
            f"a {kind!r} message of version {version}",
        )
        return list(watch.messages)

    def wait_updates(count: int, timeout: float) -> list[int]:
        watch.wait(lambda: len(watch.updates) >= count, timeout, f"{count} on_update calls")
        return list(watch.updates)

    def snapshots(until: int, timeout: float) -> dict[str, Any]:
        """apply(), then check that the live tensors hold one version, everywhere, again and again
        until version ``until`` is applied (and checked) or the deadline passes."""
        deadline = time.monotonic() + timeout
        out: dict[str, Any] = {
            "snapshots": 0,
            "mixed": 0,
            "first_mixed": None,
            "applied": [],
            "backwards": 0,
            "final": None,
            "timed_out": False,
        }
        live = sub.live
        last = -1
        while True:
            v = sub.apply()
            lo = hi = where = None
            for n, t in live.items():
                a, b = torch.aminmax(t)
                a, b = float(a), float(b)
                lo = a if lo is None else min(lo, a)
                hi = b if hi is None else max(hi, b)
                if lo != hi:
                    where = n  # the first tensor that differs
                    break
            out["snapshots"] += 1
            with watch.cond:
                watch.snapshots = out["snapshots"]
                watch.cond.notify_all()
            if lo != hi or (v >= 0 and lo != v):
                out["mixed"] += 1
                if out["first_mixed"] is None:
                    out["first_mixed"] = {
                        "apply_returned": v,
                        "values": extremes(live),
                        "tensor": where,
                    }
            if v < last:
                out["backwards"] += 1
            if v != last:
                out["applied"].append(v)
                last = v
            out["final"] = v
            if v >= until:
                break
            if time.monotonic() > deadline:
                out["timed_out"] = True
                break
        return out

    def wait_snapshots(count: int, timeout: float) -> int:
        watch.wait(lambda: watch.snapshots >= count, timeout, f"{count} snapshots")
        return watch.snapshots

    def snapshot_start(until: int, timeout: float) -> None:
        if "thread" in loop:
            raise RuntimeError("a snapshot loop is already running")
        watch.snapshots = 0

        def run() -> None:
            try:
                loop["result"] = snapshots(until, timeout)
            except BaseException:
                loop["error"] = traceback.format_exc()

        loop["thread"] = threading.Thread(target=run, daemon=True)
        loop["thread"].start()

    def snapshot_result(timeout: float) -> dict[str, Any]:
        th = loop.pop("thread")
        th.join(timeout)
        if th.is_alive():
            raise TimeoutError(f"the snapshot loop did not end within {timeout} s")
        if "error" in loop:
            raise RuntimeError(loop.pop("error"))
        return loop.pop("result")  # type: ignore[no-any-return]

    held_record: list[Any] = []

    def hold_record() -> None:
        """From now on its housekeeping beats but does not put its record back in the store
        (for a test that restarts the store and must see the group entry back first)."""
        held_record.append(internals.hold_record_restore(t))

    handlers = {
        "hold_record": hold_record,
        "idle_counts": lambda seconds: internals.idle_counts(t, seconds),
        "release_record": lambda: held_record.pop()(),
        "state": state,
        "wait_for_version": lambda n, timeout: sub.wait_for_version(n, timeout),
        "apply": sub.apply,
        "receive": lambda version, timeout: sub.receive(version, timeout),
        "torn": lambda: sub.torn,
        "live": lambda: extremes(sub.live),
        "registrations": lambda: len(internals.local_memory(t)),
        "staging": staging,
        "wait_message": wait_message,
        "wait_updates": wait_updates,
        "violations": lambda: list(watch.violations),
        "refused": lambda: sub.refused_messages,
        "writers": lambda kind: sorted(
            {p for (k, _, _), p in zip(watch.messages, watch.senders, strict=True) if k == kind}
        ),
        "snapshot_start": snapshot_start,
        "wait_snapshots": wait_snapshots,
        "snapshot_result": snapshot_result,
        "close": sub.close,
    }
    serve(conn, handlers, lambda: (sub.close(), t.close()))


def _pub_child(
    conn: Any,
    name: str,
    store: str,
    spec: Spec,
    group: str,
    pub_kwargs: dict[str, Any],
    kwargs: dict[str, Any],
) -> None:
    import transport

    try:
        t = transport.Transport(name, store=store, **kwargs)
        tensors = make_tensors(spec)
        pub = transport.WeightPublisher(t, tensors, group=group, **pub_kwargs)
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (t.generation, os.getpid())))

    def fill_and_publish(version: int, value: float, timeout: float) -> Any:
        for x in tensors.values():
            x.fill_(value)
        return pub.publish(version, timeout=timeout)

    def publish(
        version: int, value: float, timeout: float, wait: float
    ) -> tuple[dict[str, str], dict[str, str]]:
        r = fill_and_publish(version, value, timeout).wait(wait)
        return dict(r.status), dict(r.reasons)

    def publish_nowait(version: int, value: float, timeout: float) -> None:
        """Answer as soon as publish() returned, with the transfers still in flight (for a test
        that kills this process then)."""
        fill_and_publish(version, value, timeout)

    handlers = {
        "publish": publish,
        "publish_nowait": publish_nowait,
        # data goes, a version's completion never does (the test kills this process)
        "hold_notified_parts": lambda: internals.hold_notified_posts(t),
        "refresh": pub.refresh,
        "subscribers": pub.subscribers,
    }
    serve(conn, handlers, lambda: (pub.close(), t.close()))


class SubscriberProcess(ChildProcess):
    """A child running ``Transport(name, store=store_url, **kwargs)`` and a WeightSubscriber of
    ``group`` over zero-filled tensors of ``spec``. Commands: ``state`` (version, applied,
    incomplete), ``wait_for_version``, ``apply``, ``live`` and ``staging`` (extremes of every
    tensor), ``wait_message`` (a control message of a kind and version arrived), ``wait_updates``,
    ``violations`` (of the staging rule), ``writers(kind)`` (who sent messages of a kind),
    ``snapshot_start`` / ``wait_snapshots`` /
    ``snapshot_result`` (a loop of apply() and checks on a thread of the child), ``close``
    (leave the group, keep the Transport), ``registrations`` (its NIXL registrations), ``hold_record`` / ``release_record`` (its record is
    not put back in a store that lost it until released; it goes on beating). ``mode="window"``
    makes a WindowedSubscriber instead, with ``receive(version, timeout)`` and ``torn``."""

    def __init__(
        self,
        name: str,
        store_url: str,
        spec: Spec,
        group: str = "policy",
        mode: str = "staging",
        start_timeout: float = START_TIMEOUT,
        wait: bool = True,
        relay: bool = True,
        slots: int = 2,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            name,
            _sub_child,
            (store_url, spec, group, mode, relay, kwargs, slots),
            start_timeout,
            wait,
        )

    def live_values(self) -> dict[str, tuple[float, float]]:
        return self.call("live")


class PublisherProcess(ChildProcess):
    """A child running a WeightPublisher of ``group`` over tensors of ``spec``. Commands:
    ``publish(version, value, timeout, wait)`` fills every tensor with ``value``, publishes and
    returns (status, reasons); ``publish_nowait(version, value, timeout)`` answers as soon as
    ``publish()`` returned (the kill test kills it then); ``hold_notified_parts`` (data goes,
    notifications never do); ``refresh``, ``subscribers``."""

    def __init__(
        self,
        name: str,
        store_url: str,
        spec: Spec,
        group: str = "policy",
        start_timeout: float = START_TIMEOUT,
        wait: bool = True,
        fanout: str = "direct",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            name,
            _pub_child,
            (store_url, spec, group, {"fanout": fanout}, kwargs),
            start_timeout,
            wait,
        )


WsPeerError = ChildError  # the name the weight tests use
