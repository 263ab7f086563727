"""The one shape of the relay trees of both protocols: each member but the roots has one parent
before it, no member more than ``degree`` children, and the children a member writes are exactly
those whose parent it is (a chain, a one-root tree, verl's forest of ``degree`` roots)."""

from __future__ import annotations

import pytest

from transport.weights.buckets.topology import EngineInfo, build_plans
from transport.weights.relay_tree import children_of, parent_of

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "count, roots, degree", [(1, 1, 1), (7, 1, 1), (13, 1, 3), (40, 4, 4), (5, 5, 0), (9, 2, 16)]
)
def test_children_and_parents_are_one_tree(count, roots, degree):
    parents = [parent_of(i, roots, degree) for i in range(count)]
    assert parents[: min(roots, count)] == [None] * min(roots, count)
    for i, p in enumerate(parents):
        if degree == 0:
            assert p is None
        elif i >= roots:
            assert p is not None and p < i
    for i in range(count):
        kids = list(children_of(i, count, roots, degree))
        assert len(kids) <= degree
        assert kids == [j for j in range(count) if parents[j] == i]


def test_verls_plans_follow_the_shared_tree():
    names = [f"t{r}" for r in range(2)] + [f"w{i}" for i in range(11)]
    infos = [EngineInfo(n, "tcp://store", 1 << 20, 3) for n in names]
    trainers, workers = build_plans(2, 11, infos)
    assert trainers[0].targets == ("w0", "w1", "w2")
    for i, plan in enumerate(workers):
        up = parent_of(i, 3, 3)
        assert plan.parent == (None if up is None else f"w{up}")
        assert plan.targets == tuple(f"w{j}" for j in children_of(i, 11, 3, 3))


def test_a_bad_shape_is_refused():
    with pytest.raises(ValueError, match="roots >= 1"):
        parent_of(3, 0, 2)
