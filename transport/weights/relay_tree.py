"""The one shape of every relay tree of weight sync: who writes whom.

The members of a tree are numbered in the order the caller fixes (a weight group: relays
first, by name; the bucket protocol: verl's order of the rollout workers). The writer (the
publisher, or the trainer ranks) writes the first ``roots`` members itself; member ``i`` at or
after them goes under member ``(i - roots) // degree``, so that each member has at most
``degree`` children and every tree over the same members is the same tree (relays reuse what
they prepared for it). A chain is the tree of one root and degree 1; ``degree == 0`` means no
relays: the writer writes every member.

Both protocols build their trees here: the weight groups' publisher
(weights/publishing/roster.py, which also keeps a member from a relay that does not hold every
tensor it takes) and the bucket protocol's plans (weights/buckets/topology.py).
"""

from __future__ import annotations


def parent_of(i: int, roots: int, degree: int) -> int | None:
    """The member that writes member ``i`` (None: the writer does)."""
    if i < 0 or roots < 1 or degree < 0:
        raise ValueError(
            f"a relay tree needs i >= 0, roots >= 1, degree >= 0 (got {i}, {roots}, {degree})"
        )
    if i < roots or degree == 0:
        return None
    return (i - roots) // degree


def children_of(i: int, count: int, roots: int, degree: int) -> range:
    """The members that member ``i`` writes, in a tree of ``count`` members."""
    if degree == 0:
        return range(0)
    first = roots + i * degree
    return range(min(first, count), min(first + degree, count))
