"""``delta="auto"`` (transport/weights/delta/policy.py): it diffs while diff and changes take less
time than whole versions, stops diffing once they lose, looks again after 4, 8, 16 ... versions,
and never stops diffing when ``auto`` is off. Timings are given, not measured."""

from __future__ import annotations

import pytest

from transport.weights.delta.policy import FIRST_LOOK, LAST_LOOK, DeltaPolicy

pytestmark = [pytest.mark.unit, pytest.mark.delta]


class Trainer:
    """What DeltaSource does with the policy: a version is diffed only when the copy is there
    (the first one, and the first after a rest, only takes the copy)."""

    def __init__(self, p: DeltaPolicy) -> None:
        self.p, self.copy = p, False


def run_version(t: Trainer | DeltaPolicy, diff: float, patch: float, whole: float) -> bool:
    """One publish to two subscribers, one with an inbox and one without; returns whether the
    trainer compared the weights (took or updated its copy)."""
    if isinstance(t, DeltaPolicy):
        t = _trainers.setdefault(id(t), Trainer(t))
    wanted = t.p.want_diff()
    if wanted and t.copy:
        t.p.diffed(diff)
        t.p.wrote(True, patch)
    t.copy = wanted
    t.p.wrote(False, whole)
    return wanted


_trainers: dict[int, Trainer] = {}


def test_off_it_always_diffs():
    p = DeltaPolicy(auto=False)
    assert all(run_version(p, 10.0, 10.0, 0.1) for _ in range(50))


def test_changes_that_win_keep_being_sent():
    p = DeltaPolicy(auto=True)
    assert all(run_version(p, 0.01, 0.05, 1.0) for _ in range(50))


def test_changes_that_lose_stop_and_are_looked_at_again_ever_less_often():
    p = DeltaPolicy(auto=True)
    diffed = [run_version(p, 0.2, 0.9, 1.0) for _ in range(600)]  # 1.1 s against 1.0 s
    # a look: the copy at one version, the diff at the next
    looks = [i for i, d in enumerate(diffed) if d and (i == 0 or not diffed[i - 1])]
    assert all(diffed[i + 1] for i in looks[:-1])
    assert looks[0] == 0
    # versions rested between looks
    gaps = [b - a - 1 for a, b in zip(looks, looks[1:], strict=False)]
    assert gaps[:4] == [FIRST_LOOK, 2 * FIRST_LOOK, 4 * FIRST_LOOK, 8 * FIRST_LOOK]
    assert max(gaps) == LAST_LOOK
    assert sum(diffed) < 0.05 * len(diffed)  # looking costs a few percent at most


def test_within_the_margin_of_whole_is_a_loss():
    p = DeltaPolicy(auto=True)
    assert run_version(p, 0.1, 0.86, 1.0)  # the copy
    assert run_version(p, 0.1, 0.86, 1.0)  # 0.96 of whole: more than 0.95
    assert not p.diffing and not p.want_diff()


def test_changes_that_win_again_after_a_loss_are_sent_again():
    p = DeltaPolicy(auto=True)
    run_version(p, 0.5, 1.0, 1.0)  # the copy
    run_version(p, 0.5, 1.0, 1.0)  # lost
    for _ in range(FIRST_LOOK - 1):
        assert not run_version(p, 0.01, 0.05, 1.0)
    assert run_version(p, 0.01, 0.05, 1.0)  # the look: the copy is taken
    assert all(run_version(p, 0.01, 0.05, 1.0) for _ in range(20))  # the link got slow
