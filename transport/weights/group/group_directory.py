"""The store side of a group (the keys are listed in the package's docstring): the subscribers'
entries and declared layouts, the membership index and the epoch."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgpack

from transport import Store, WireFormatError
from transport.contract import (
    NAME_RE,
    Counter,
    Inspector,
    SignedStore,
    clock_floor,
    index_counter,
    unpack,
)
from transport.weights.group.region_names import MODES

log = logging.getLogger(__name__)

#: how many times ``leave`` and ``check_in`` read and judge again a value rewritten between
#: their read and their conditional write before they leave it as it is
TRIES = 8


@dataclass(frozen=True)
class GroupEntry:
    """A subscriber's entry in its group, as it signed it: which incarnation of its peer
    (``generation``) and which subscriber of that incarnation (``instance``) it is, how it
    receives (``mode``, ``slots``) and whether it relays. Two entries that differ in anything
    are two members."""

    generation: int
    instance: int
    mode: str
    slots: int
    relay: bool


class GroupDirectory:
    """The store side of a group: the subscribers' entries and declared layouts, the membership
    index and the epoch, under ``transport/<namespace>/groups/<group>/``.

    It keeps the key prefix, the group's two counters and ``signed``, the Transport's signed
    store values (``transport.core.signed``): ``join``, ``declare_layout`` and ``leave`` write
    and remove that Transport's own entry and layout, of subscriber ``instance`` (a number no
    other subscriber of that Transport incarnation has: a publisher plans a subscriber that
    closed and one made after it on the same Transport apart). Every call is one or more store round
    trips, as thread-safe as the store, and never made on the engine thread.

    Trust (DESIGN.md): an entry (generation, instance, mode, slots, relay) and a layout decide where bytes
    land, so both are signed values that only the subscriber itself writes: a value that is
    malformed, unsigned in a namespace with a secret, not signed by the peer it is the entry of,
    or whose body names another generation than its signature is ignored (logged), as if it
    were missing. A store writer without the secret can still delete a value or put back an
    older one of the same key (a replay): a replayed entry or layout of an older incarnation is
    refused by its readers, who compare its generation with the subscriber's live record
    (``Roster.plan``) or with the member's (``layout``); the subscriber puts back whatever of its
    own is missing or not its own (``check_in``). The epoch and the membership index are plain
    counters and names (garbage in them is repaired by whoever meets it, reader or writer: the
    epoch to the clock in milliseconds, the member count as ``index_counter`` says): forging
    them only makes readers read again, or skip a name, since every entry they lead to is
    signed. The membership index only grows (``names`` drops duplicates).

    Restarts (one incarnation per value, DESIGN.md's failure model): ``leave`` deletes the entry
    and the layout only while they are still this subscriber's, and ``check_in`` never puts its
    values back over a newer incarnation's of the same name (one signed by the name with a
    higher generation: a restart whose old process still runs, frozen and resumed, say). Both
    decide on the bytes they read and write with ``compare_delete`` and ``compare_set`` of
    those very bytes, so a newer incarnation's value written between the read and the write
    stays. Without a secret a store writer can forge such a newer value, and the subscriber
    then stays out of the group until it joins again: it could write any entry anyway.

    Made from a bare :class:`Store` instead (tools and tests that inspect a group without a
    Transport), it reads values without checking their MACs and refuses to write.
    """

    def __init__(
        self, signed: SignedStore | Store, namespace: str, group: str, instance: int = 0
    ) -> None:
        self.signed = reader(signed)
        self.instance = instance
        self._declared: bytes | None = None  # the layout as we last stored it
        self._deferred: dict[str, bytes] = {}  # the newer values check_in warned about, by key
        store = self.store = self.signed.store
        self.group = group
        self.prefix = f"transport/{namespace}/groups/{group}/"
        # The epoch only has to differ from every value a publisher saw before a change: the
        # clock in milliseconds does, since join and leave count it up by one from 0
        # (clock_floor), and the publisher that repairs it reads the entries after the repair.
        what = f"the changes of group {group!r}"
        self._epoch = Counter(store, self.prefix + "epoch", what, clock_floor)
        self._members = index_counter(
            store, self.prefix + "members/", f"the members of group {group!r}"
        )

    def epoch(self) -> int:
        return self._epoch.value()

    @property
    def epoch_key(self) -> str:
        """The key :meth:`epoch` reads (a publisher reads it ahead with its other keys)."""
        return self._epoch.key

    # -- this Transport's own entry and layout ---------------------------------------------------

    def _entry_body(self, mode: str, slots: int, relay: bool) -> bytes:
        body: bytes = msgpack.packb(
            {
                "v": 2,
                "gen": self.signed.generation,
                "inst": self.instance,
                "mode": mode,
                "slots": slots,
                "relay": relay,
            }
        )
        return body

    def join(self, mode: str, slots: int, relay: bool) -> None:
        """Write this Transport's entry (signed), add it to the membership index, bump the
        epoch."""
        self.signed.set(
            self.prefix + f"sub/{self.signed.writer}", self._entry_body(mode, slots, relay)
        )
        self._index(self.signed.writer)
        self._epoch.add(1)

    def declare_layout(self, layout: bytes | None) -> None:
        """The destination layout this Transport's subscriber declares before it joins (None:
        whole tensors by name, declared as :data:`WHOLE`: a missing declaration is not one)."""
        self._declared = self.signed.set(
            self.prefix + f"layout/{self.signed.writer}", WHOLE if layout is None else layout
        )

    def leave(self) -> None:
        """Remove this subscriber's entry, then its declared layout, each only while it is
        still ours: the entry while it is this incarnation's and this instance's, the layout
        while it holds the very bytes this directory declared (or, where it declared none, a
        layout this incarnation signed). The epoch is bumped once the entry went.

        Each is deleted with ``compare_delete`` of the bytes read and judged ours, never with a
        plain delete: a newer incarnation of the name that writes its entry or layout between
        our read and our delete keeps it (else it would not be planned until it noticed and
        joined again). A value rewritten in between is read and judged again (our own
        ``check_in`` may write the same bytes once more while we close), up to TRIES times.
        The layout goes only after the entry: a reader that finds our entry finds our layout,
        and one that finds another entry is not ours to strip of its layout."""
        name = self.signed.writer
        if self._delete_own(self.prefix + f"sub/{name}", self._own_entry):
            self._delete_own(self.prefix + f"layout/{name}", self._own_layout)
            self._epoch.add(1)

    def _own_entry(self, key: str, raw: bytes) -> bool:
        entry = self._entry_of(self.signed.writer, key, raw)
        return entry is not None and (entry.generation, entry.instance) == (
            self.signed.generation,
            self.instance,
        )

    def _own_layout(self, key: str, raw: bytes) -> bool:
        if self._declared is not None:
            return raw == self._declared
        value = self._signed_of(key, raw, f"the declared layout {key}", self.signed.writer)
        return value is not None and value[0] == self.signed.generation

    def _delete_own(self, key: str, ours: Callable[[str, bytes], bool]) -> bool:
        """Delete ``key`` with ``compare_delete`` while what it holds is ``ours``; whether it
        was deleted (False: missing, not ours, or rewritten at every read: logged)."""
        for _ in range(TRIES):
            raw = self.store.try_get(key)
            if raw is None or not ours(key, raw):
                return False
            if self.store.compare_delete(key, raw):
                return True
        log.warning(
            "%s#%d left group %r but %s was rewritten %d times while it removed it; it stays",
            self.signed.writer,
            self.signed.generation,
            self.group,
            key,
            TRIES,
        )
        return False

    def check_in(self, mode: str, slots: int, relay: bool, layout: bytes | None, full: bool) -> str:
        """The subscriber's periodic check that the store still holds its entry, its place in
        the membership index and its layout as it wrote them (a store that restarted empty, a
        deletion, garbage, a replay of an older incarnation's values): what was wrong, after
        writing it all again (join), or "". ``full`` reads the layout back whole (it may be
        large); otherwise only its presence is checked.

        A newer incarnation's entry or layout (signed by our name with a higher generation) is
        never replaced: this one has been restarted elsewhere and steps aside, with a warning
        once per value, and answers "" (nothing put back). Each value is put back with
        ``compare_set`` of the bytes read and judged replaceable, so one that a newer
        incarnation writes in between stays."""
        name = self.signed.writer
        key = self.prefix + f"sub/{name}"
        raw = self.store.try_get(key)
        why = ""
        if raw != self.signed.encode(key, self._entry_body(mode, slots, relay)):
            if raw is not None and self._newer(key, raw):
                return ""
            why = f"our entry {key} is missing or not the one we wrote"
        elif not self._indexed(name):
            why = f"our name is missing from the membership index {self.prefix}members/"
        else:
            lkey = self.prefix + f"layout/{name}"
            body = WHOLE if layout is None else layout
            if (full and self.store.try_get(lkey) != self.signed.encode(lkey, body)) or (
                not full and not self.store.exists(lkey)
            ):
                why = f"our declared layout {lkey} is missing or not the one we wrote"
        if why and not self._join_again(mode, slots, relay, layout, raw):
            return ""
        return why

    def _join_again(
        self, mode: str, slots: int, relay: bool, layout: bytes | None, entry: bytes | None
    ) -> bool:
        """``declare_layout`` then ``join``, each value written only over what the store holds
        when that is not a newer incarnation's (``entry``: the entry as ``check_in`` read it;
        the layout is first taken to be what we last stored, and read only if it is not, so a
        large one is not read back on top of being written). False if one is a newer
        incarnation's (or kept changing): nothing more is written."""
        name = self.signed.writer
        lkey = self.prefix + f"layout/{name}"
        declared = self._put_own(lkey, WHOLE if layout is None else layout, self._declared)
        if declared is None:
            return False
        self._declared = declared
        key = self.prefix + f"sub/{name}"
        if self._put_own(key, self._entry_body(mode, slots, relay), entry) is None:
            return False
        self._index(name)
        self._epoch.add(1)
        return True

    def _put_own(self, key: str, body: bytes, raw: bytes | None) -> bytes | None:
        """Write ``body`` (signed) under ``key`` with ``compare_set`` of ``raw`` (what ``key``
        holds, as read or expected), unless that is a newer incarnation's; if the store holds
        something else, read it and judge again. The stored bytes, or None if a newer
        incarnation's value is there or the value was rewritten at every read (both logged)."""
        ours = self.signed.encode(key, body)
        for _ in range(TRIES):
            if raw is not None and self._newer(key, raw):
                return None
            if self.store.compare_set(key, raw, ours):
                return ours
            raw = self.store.try_get(key)
        log.warning(
            "group %r: %s was rewritten %d times while %s#%d put its own back; left as it is",
            self.group,
            key,
            TRIES,
            self.signed.writer,
            self.signed.generation,
        )
        return None

    def _newer(self, key: str, raw: bytes) -> bool:
        """Whether ``raw``, stored under ``key``, is a newer incarnation's value of our name:
        signed by our name with a higher generation (warned about once per value)."""
        try:
            value = self.signed.decode(key, raw, key)
        except WireFormatError:
            return False  # garbage: ours to replace
        if value.writer != self.signed.writer or value.generation <= self.signed.generation:
            return False
        if self._deferred.get(key) != raw:
            self._deferred[key] = raw
            log.warning(
                "group %r: %s holds the value of %s#%d, a newer incarnation of this subscriber "
                "(#%d): it is not put back over it (this one was restarted elsewhere)",
                self.group,
                key,
                value.writer,
                value.generation,
                self.signed.generation,
            )
        return True

    def _index(self, name: str) -> None:
        if not self._indexed(name):
            idx = self._members.add(1)
            self.store.set(self.prefix + f"members/{idx}", name.encode())
            self.store.set(self.prefix + f"members/by-name/{name}", str(idx).encode())

    def _indexed(self, name: str) -> bool:
        """Whether the index holds ``name`` where its by-name key says (two plain keys that any
        store writer may change: a forged one only hides or shows a name, never an entry)."""
        raw = self.store.try_get(self.prefix + f"members/by-name/{name}")
        if raw is None or not _INDEX.fullmatch(raw):
            return False
        return self.store.try_get(self.prefix + f"members/{int(raw)}") == name.encode()

    # -- what readers see -------------------------------------------------------------------------

    def layout(self, name: str, generation: int) -> bytes | None:
        """The destination layout that incarnation ``generation`` of subscriber ``name``
        declared (:data:`WHOLE`: whole tensors by name); None when there is none it signed
        (missing, or not valid: logged)."""
        key = self.prefix + f"layout/{name}"
        value = self.signed.read(key, f"the declared layout {key}", writer=name)
        if value is None:
            return None
        if value.generation != generation:
            log.warning(
                "ignoring the declared layout %s: it is of generation %d, the subscriber's is %d "
                "(an older incarnation's value, put back?)",
                key,
                value.generation,
                generation,
            )
            return None
        return value.body

    def entry(self, name: str) -> GroupEntry | None:
        """Subscriber ``name``'s entry; None when there is none it signed (missing, or not
        valid: logged)."""
        key = self.prefix + f"sub/{name}"
        raw = self.store.try_get(key)
        return None if raw is None else self._entry_of(name, key, raw)

    def _entry_of(self, name: str, key: str, raw: bytes) -> GroupEntry | None:
        """The entry of ``name`` stored under ``key`` as ``raw``; None when it is not valid
        (logged)."""
        value = self._signed_of(key, raw, f"the group entry {key}", name)
        if value is None:
            return None
        generation, body = value
        try:
            m = unpack(body, f"the group entry {key}", 4096, max_str=64, max_map=8)
        except WireFormatError as e:
            log.warning("ignoring %s", e)
            return None
        if (
            not isinstance(m, dict)
            or set(m) != {"v", "gen", "inst", "mode", "slots", "relay"}
            or m["v"] != 2
            or not isinstance(m["relay"], bool)
            or m["mode"] not in MODES
            or m["slots"] not in (1, 2)
            or type(m["gen"]) is not int
            or type(m["inst"]) is not int
        ):
            log.warning("ignoring the malformed group entry %s: %s", key, str(m)[:80])
            return None
        if m["gen"] != generation:
            log.warning(
                "ignoring the group entry %s: it names generation %d, but generation %d signed it",
                key,
                m["gen"],
                generation,
            )
            return None
        return GroupEntry(m["gen"], m["inst"], m["mode"], m["slots"], m["relay"])

    def _signed_of(self, key: str, raw: bytes, what: str, writer: str) -> tuple[int, bytes] | None:
        """``raw``, stored under ``key``, as a signed value of ``writer``: its generation and
        body; None when it is not valid or another writer's (logged), as ``SignedStore.read``
        judges it (``what`` names it)."""
        try:
            value = self.signed.decode(key, raw, what)
        except WireFormatError as e:
            log.warning("ignoring %s: %s", what, e)
            return None
        if value.writer != writer:
            log.warning(
                "ignoring %s: written by %r, but only %r writes it", what, value.writer, writer
            )
            return None
        return value.generation, value.body

    def names(self) -> list[str]:
        """The members that ever joined, in joining order; a name that is not a peer name (the
        store's garbage) is skipped with a warning naming its key."""
        count = self._members.value()
        out = []
        for i in range(1, count + 1):
            key = self.prefix + f"members/{i}"
            raw = self.store.try_get(key)
            if raw is None:
                continue
            name = raw.decode(errors="replace")
            if not NAME_RE.match(name):
                log.warning("skipping %s: %r is not a peer name", key, name[:80])
            elif name not in out:
                out.append(name)
        return out

    def entries(self, names: Iterable[str] | None = None) -> dict[str, GroupEntry]:
        """The entry of every member, or of ``names`` (those that left have none); an entry that
        is not valid is skipped with a warning naming its key, so one bad entry never stops the
        group."""
        out = {}
        for name in self.names() if names is None else names:
            entry = self.entry(name)
            if entry is not None:
                out[name] = entry
        return out


#: a declared layout that says "whole tensors by name" (an encoded layout is never empty)
WHOLE = b""

_INDEX = re.compile(rb"[1-9][0-9]{0,15}")


def reader(store: SignedStore | Store) -> SignedStore:
    """``store`` itself, or for a bare :class:`Store` a read-only :class:`Inspector` of its
    signed values (the envelope checked, not its MAC): for tools and tests that look at a group
    without a Transport. Nothing the library decides reads through the latter."""
    return store if isinstance(store, SignedStore) else Inspector(store)
