"""The weight groups' control messages as typed values, encoded and decoded by the one codec of
weight sync (weights/message_codec.py: its kind under ``"k"``, one-letter keys for the fields).

What each message means, who sends it and when is in the docstring of
``transport.weights.group``. :func:`decode` is the only place that reads a peer's bytes: exact
field sets, types and ranges, or :class:`WireFormatError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from transport import WireFormatError
from transport.contract import NAME_RE, is_count
from transport.weights.message_codec import Codec

#: the most children one relay serves (the publisher's ``degree``)
MAX_DEGREE = 16
#: slots are small numbers (a staging subscriber has two)
MAX_SLOT = 8
#: the largest version a message may name (a signed 64-bit int)
MAX_VERSION = (1 << 63) - 1
#: what a relay report may say of a forward: landed, the child went away, or it failed
OUTCOMES = ("", "lost", "fail")


@dataclass(frozen=True)
class Hello:
    """publisher -> subscriber: tell me which slots I may write."""

    KIND: ClassVar[str] = "hello"
    WIRE: ClassVar[dict[str, str]] = {}


@dataclass(frozen=True)
class _SlotMessage:
    """A message about one version in one slot."""

    version: int
    slot: int
    KIND: ClassVar[str] = ""
    WIRE: ClassVar[dict[str, str]] = {"version": "v", "slot": "s"}


@dataclass(frozen=True)
class Begin(_SlotMessage):
    """publisher -> subscriber: ``version`` is being written into ``slot``."""

    KIND: ClassVar[str] = "begin"


@dataclass(frozen=True)
class Ver(_SlotMessage):
    """The notification of the data put: every tensor of ``version`` has landed in ``slot``."""

    KIND: ClassVar[str] = "ver"


@dataclass(frozen=True)
class Abort(_SlotMessage):
    """publisher -> subscriber: the write of ``version`` into ``slot`` was given up."""

    KIND: ClassVar[str] = "abort"


@dataclass(frozen=True)
class Lend:
    """publisher -> subscriber: the slot ``version`` was to land in is cut off (the relay
    writing it was lost on the way, and owns it until it reports or is gone); hand back the slot
    of your newest version if you applied it, as a one-slot subscriber does, and credit again."""

    version: int
    KIND: ClassVar[str] = "lend"
    WIRE: ClassVar[dict[str, str]] = {"version": "v"}


@dataclass(frozen=True)
class Credit:
    """subscriber -> publisher: the slots it may write now, its newest complete version (-1:
    none yet) and the newest version it is done with (``settled``: complete, or given up), so
    that the ranks of a sharded trainer start a version only once the one before is settled;
    ``holds``: per slot in ``slots``, the version it holds whole (-1: none, or torn), which a
    delta written there applies onto (empty: none says)."""

    slots: tuple[int, ...]
    newest: int
    settled: int = -1
    holds: tuple[int, ...] = ()
    KIND: ClassVar[str] = "credit"
    WIRE: ClassVar[dict[str, str]] = {"slots": "s", "newest": "v", "settled": "d", "holds": "h"}

    def held(self, slot: int) -> int:
        """The version ``slot`` holds whole, as this credit says (-1: none)."""
        for k, v in zip(self.slots, self.holds, strict=False):
            if k == slot:
                return v
        return -1

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> Credit:
        slots = raw["slots"]
        if not isinstance(slots, list) or not all(is_count(x) and x < MAX_SLOT for x in slots):
            raise WireFormatError("credit slots must be a list of small ints")
        holds = raw["holds"]
        if not isinstance(holds, list) or len(holds) not in (0, len(slots)):
            raise WireFormatError("a credit says the version each credited slot holds, or none")
        for x in [raw["newest"], raw["settled"], *holds]:
            if not isinstance(x, int) or isinstance(x, bool) or not -1 <= x <= MAX_VERSION:
                raise WireFormatError(
                    f"credit versions are ints from -1 (none) to {MAX_VERSION}, got {x!r}"
                )
        return cls(tuple(slots), raw["newest"], raw["settled"], tuple(holds))


@dataclass(frozen=True)
class Target:
    """One child of a relay: write into its ``slot``; ``relays``: it forwards in turn;
    ``base``: the child holds that version, so forward the version's changes against it if
    they came here as such (-1: whole)."""

    child: str
    slot: int
    relays: bool
    base: int = -1

    def to_wire(self) -> list[Any]:
        return [self.child, self.slot, int(self.relays), self.base]


@dataclass(frozen=True)
class Forward:
    """publisher -> relay: write ``version`` into each target as it lands here, within ``ms``."""

    version: int
    ms: int
    targets: tuple[Target, ...]
    KIND: ClassVar[str] = "fwd"
    WIRE: ClassVar[dict[str, str]] = {"version": "v", "ms": "t", "targets": "to"}

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> Forward:
        return cls(_count(cls, raw, "version"), _count(cls, raw, "ms"), _targets(raw["targets"]))


@dataclass(frozen=True)
class Segment:
    """writer -> relay: tensors ``first`` to ``end - 1`` (sorted names) of ``version`` have
    landed in ``slot``."""

    version: int
    slot: int
    first: int
    end: int
    KIND: ClassVar[str] = "seg"
    WIRE: ClassVar[dict[str, str]] = {"version": "v", "slot": "s", "first": "a", "end": "b"}

    def wire_rule(self) -> str:
        return "" if self.first < self.end else "a segment must name at least one tensor"


@dataclass(frozen=True)
class PartLanded:
    """writer -> relay: bytes ``offset`` to ``offset + nbytes - 1`` of tensor ``index`` of
    ``version`` have landed in ``slot``."""

    version: int
    slot: int
    index: int
    offset: int
    nbytes: int
    KIND: ClassVar[str] = "part"
    WIRE: ClassVar[dict[str, str]] = {
        "version": "v",
        "slot": "s",
        "index": "a",
        "offset": "o",
        "nbytes": "n",
    }

    def wire_rule(self) -> str:
        return "" if self.nbytes else "a part must hold at least one byte"


@dataclass(frozen=True)
class Patch:
    """The notification of a delta put: the changes that make ``version`` out of ``base`` have
    landed in the subscriber's inbox (``nbytes`` of it from byte ``at``; a sharded trainer's
    ranks each write their own part of the inbox); apply them onto ``slot``, which must hold
    ``base`` whole, or refuse."""

    version: int
    slot: int
    base: int
    nbytes: int
    at: int = 0
    KIND: ClassVar[str] = "patch"
    WIRE: ClassVar[dict[str, str]] = {
        "version": "v",
        "slot": "s",
        "base": "p",
        "nbytes": "n",
        "at": "a",
    }

    def wire_rule(self) -> str:
        if not self.nbytes:
            return "a patch must hold at least one byte"
        return "" if self.base < self.version else "a patch's base must be older than its version"


@dataclass(frozen=True)
class Patched:
    """subscriber -> publisher: what became of the :class:`Patch` of ``version`` in ``slot``:
    ``why`` is empty when the version is complete there, else why it was refused (the
    publisher then writes the version whole into the same slot)."""

    version: int
    slot: int
    why: str
    KIND: ClassVar[str] = "patched"
    WIRE: ClassVar[dict[str, str]] = {"version": "v", "slot": "s", "why": "e"}

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> Patched:
        if not isinstance(raw["why"], str):
            raise WireFormatError("a patched message says why as a str")
        return cls(_count(cls, raw, "version"), _count(cls, raw, "slot"), raw["why"])


@dataclass(frozen=True)
class Report:
    """relay -> publisher: what became of the forward of ``version`` to ``child``: ``outcome``
    is one of :data:`OUTCOMES`, ``why`` says why it failed; ``patched``: the bytes of the
    version's changes the relay wrote into the child's inbox and the child applied (0: it took
    the version whole, or the forward did not land; only a landed forward carries bytes)."""

    version: int
    child: str
    outcome: str
    why: str
    patched: int = 0
    KIND: ClassVar[str] = "fwdr"
    WIRE: ClassVar[dict[str, str]] = {
        "version": "v",
        "child": "c",
        "outcome": "x",
        "why": "e",
        "patched": "n",
    }

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> Report:
        if (
            not _name(raw["child"])
            or raw["outcome"] not in OUTCOMES
            or not isinstance(raw["why"], str)
        ):
            raise WireFormatError("malformed relay report")
        version, patched = _count(cls, raw, "version"), _count(cls, raw, "patched")
        return cls(version, raw["child"], raw["outcome"], raw["why"], patched)

    def wire_rule(self) -> str:
        if self.patched and self.outcome:
            return "a relay report carries bytes of changes only for a forward that landed"
        return ""


Message = (
    Hello
    | Begin
    | Ver
    | Abort
    | Lend
    | Credit
    | Forward
    | Segment
    | PartLanded
    | Patch
    | Patched
    | Report
)
KINDS: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        Hello,
        Begin,
        Ver,
        Abort,
        Lend,
        Credit,
        Forward,
        Segment,
        PartLanded,
        Patch,
        Patched,
        Report,
    )
}


#: the weight groups' codec (weights/message_codec.py)
CODEC: Codec[Message] = Codec(
    "weight-sync",
    KINDS.values(),
    max_bytes=1 << 16,
    max_str=1024,
    max_array=MAX_DEGREE * 2,
    max_map=8,
)
encode = CODEC.encode
decode = CODEC.decode
decode_from = CODEC.decode_from


def _count(cls: type[Message], raw: dict[str, Any], name: str) -> int:
    value = raw[name]
    if not is_count(value):
        key = cls.WIRE[name]
        raise WireFormatError(
            f"field {key!r} of a {cls.KIND!r} message must be a non-negative 64-bit int (0 to 2**63 - 1)"
        )
    return int(value)


def _targets(to: Any) -> tuple[Target, ...]:
    if (
        not isinstance(to, list)
        or not 0 < len(to) <= MAX_DEGREE
        or not all(
            isinstance(x, list)
            and len(x) == 4
            and _name(x[0])
            and is_count(x[1])
            and x[1] < MAX_SLOT
            and x[2] in (0, 1)
            and not isinstance(x[2], bool)
            and isinstance(x[3], int)
            and not isinstance(x[3], bool)
            and x[3] >= -1
            for x in to
        )
    ):
        raise WireFormatError("fwd targets must be a list of [child, slot, relays, base]")
    return tuple(Target(x[0], x[1], bool(x[2]), x[3]) for x in to)


def _name(x: Any) -> bool:
    return isinstance(x, str) and NAME_RE.match(x) is not None


#: seconds after which a subscriber that has not answered a publisher's hello is asked again
HELLO_AGAIN = 0.5
