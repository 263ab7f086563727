"""Who sends what to whom in one update: the engines' introductions and the plan each one gets.

verl calls ``prepare()`` on every engine (it returns an :class:`EngineInfo`), then the engine
class's ``build_topology`` in the driver with all of them (trainer ranks first), then
``init_process_group(plan=...)`` on every engine with the :class:`UpdatePlan` that
:func:`build_plans` made for it.

The plan: bucket ``k`` of an update is filled and sent by trainer rank ``k % trainers`` (every
rank holds every tensor, so the ranks share the sending); it lands in slot ``k % 2`` of each
receiver. Receivers form a tree of ``degree`` children per node with ``degree`` roots
(weights/relay_tree.py, the weight groups' shape too; ``degree == 0``: no relays, the trainer
ranks write every rollout worker themselves); the roots take buckets from the trainer ranks,
every other worker from its parent, which relays each bucket it received.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from transport.contract import NAME_RE
from transport.weights.buckets.messages import TOKEN_CHARS
from transport.weights.relay_tree import children_of, parent_of

#: the relay degree that "auto" picks above this many rollout workers (direct at or below)
AUTO_DIRECT_MAX = 4
AUTO_DEGREE = 4


@dataclass(frozen=True)
class EngineInfo:
    """What an engine tells the others in ``prepare()``: its peer name in the store, the store's
    URL if it hosts it (or was given one), the bucket size and relay degree it was built with,
    whether it takes ``delta`` buckets and the update its copies hold (``holds``, changes.py)."""

    name: str
    store: str | None
    bucket_bytes: int
    degree: int | None
    delta: bool = False
    holds: str = ""


@dataclass(frozen=True)
class UpdatePlan:
    """One engine's part of one update (see the module docstring for the rules).

    ``role`` is ``"trainer"`` or ``"rollout"``; ``rank`` its index among its role; ``trainers``
    every trainer rank's peer name by rank; ``targets`` the peers this engine writes (a trainer
    rank: the tree's roots; a rollout worker: its children); ``parent`` where a rollout worker's
    buckets come from (None: from the trainer ranks). ``base``: the update every engine's copies
    hold, which the buckets' changes apply onto ("": every bucket raw)."""

    token: str
    role: str
    rank: int
    store: str
    bucket_bytes: int
    trainers: tuple[str, ...]
    targets: tuple[str, ...]
    parent: str | None
    base: str = ""

    def sender_of(self, index: int) -> str:
        """The peer that writes bucket ``index`` to this rollout worker."""
        return self.parent if self.parent is not None else self.trainers[index % len(self.trainers)]

    def senders(self) -> tuple[str, ...]:
        """Every peer that writes this rollout worker: its parent, or every trainer rank."""
        return (self.parent,) if self.parent is not None else self.trainers

    def sends(self, index: int) -> bool:
        """Whether this trainer rank fills and sends bucket ``index``."""
        return index % len(self.trainers) == self.rank


def introduction_rule(info: EngineInfo) -> str:
    """The rule an engine's introduction breaks ("" when it keeps them): what ``prepare()``
    returns travels through verl (Ray) before the plans are built from it."""
    if not isinstance(info.name, str) or not NAME_RE.fullmatch(info.name):
        return "its name is not a peer name (letters, digits and ._:- up to 128 characters)"
    if info.store is not None and not (isinstance(info.store, str) and info.store):
        return "its store is a URL or None"
    if type(info.bucket_bytes) is not int or info.bucket_bytes < 1:
        return "its bucket size is a positive int"
    if info.degree is not None and not (type(info.degree) is int and 0 <= info.degree <= 64):
        return "its relay degree is an int from 0 to 64, or None"
    if type(info.delta) is not bool or not isinstance(info.holds, str):
        return "delta is true or false, and holds a str"
    return ""


def build_plans(
    trainers: int, rollouts: int, infos: list[EngineInfo]
) -> tuple[list[UpdatePlan], list[UpdatePlan]]:
    """Every trainer rank's and rollout worker's plan from their introductions (trainer ranks
    first, as verl lists them)."""
    if trainers < 1 or rollouts < 0 or len(infos) != trainers + rollouts:
        raise ValueError(
            f"build_topology: {len(infos)} engines introduced themselves for {trainers} trainer "
            f"ranks and {rollouts} rollout workers"
        )
    if not all(isinstance(i, EngineInfo) for i in infos):
        kinds = sorted({type(i).__name__ for i in infos})
        raise TypeError(
            f"build_topology: every engine must be a transport engine (got {kinds}); set "
            "checkpoint_engine.backend=transport on the trainer and the rollout side alike"
        )
    for k, info in enumerate(infos):
        broken = introduction_rule(info)
        if broken:
            raise ValueError(f"build_topology: engine {k} ({str(info)[:200]}): {broken}")
    stores = {i.store for i in infos if i.store is not None}
    if len(stores) != 1:
        raise ValueError(
            "build_topology: the engines name "
            + (f"{len(stores)} different stores {sorted(stores)}" if stores else "no store")
            + "; give every engine the same store (engine_kwargs.transport.store or "
            "$TRANSPORT_STORE), or let trainer rank 0 (is_master=True) host one"
        )
    sizes = {i.bucket_bytes for i in infos}
    if len(sizes) != 1:
        raise ValueError(
            f"build_topology: the engines have different bucket sizes {sorted(sizes)}; give them "
            "all the same update_weights_bucket_megabytes"
        )
    (store,) = stores
    (bucket,) = sizes
    degree = infos[0].degree
    if degree is None:
        degree = 0 if rollouts <= AUTO_DIRECT_MAX else AUTO_DEGREE
    token = secrets.token_hex(TOKEN_CHARS // 2)
    names = [i.name for i in infos]
    if len(set(names)) != len(names):
        raise ValueError(f"build_topology: two engines share a peer name: {names}")
    t_names, r_names = tuple(names[:trainers]), names[trainers:]
    # the trainer ranks write the first ``degree`` workers (every one without relays)
    first = len(r_names) if degree == 0 else degree
    roots = r_names[:first]
    # changes only when every engine takes them and every one's copies hold the same update
    holds = {i.holds for i in infos}
    base = holds.pop() if all(i.delta for i in infos) and len(holds) == 1 else ""
    t_plans = [
        UpdatePlan(token, "trainer", r, store, bucket, t_names, tuple(roots), None, base)
        for r in range(trainers)
    ]
    r_plans = []
    for i in range(len(r_names)):
        children = tuple(r_names[j] for j in children_of(i, len(r_names), max(first, 1), degree))
        up = parent_of(i, max(first, 1), degree)
        parent = None if up is None else r_names[up]
        r_plans.append(
            UpdatePlan(token, "rollout", i, store, bucket, t_names, children, parent, base)
        )
    return t_plans, r_plans
