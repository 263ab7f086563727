"""``delta="auto"``: whether a version is worth diffing, judged by what versions cost."""

from __future__ import annotations

#: a version goes as changes only where they are predicted to take at most this share of a whole
#: version's time: the margin keeps ``auto`` within 5% of always whole
MARGIN = 0.95
#: how often (in versions) ``auto`` looks again after changes lost, at first and at most
FIRST_LOOK, LAST_LOOK = 4, 256
#: the weight of the newest measurement in each running estimate
WEIGHT = 0.5


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new


class DeltaPolicy:
    """Owns the running estimates of what a version costs each way: the diff (the trainer's
    compare pass, before :meth:`publish` returns), a write of the changes until the subscriber
    completed it (transfer and apply), and a write of the whole version. With ``auto`` off it
    always diffs.

    Rules: a version is diffed while diff plus changes are predicted within ``MARGIN`` of whole
    (or while one of them was never measured). Once they lose, the trainer stops diffing (and
    drops its copy: no cost at all) and looks again after ``FIRST_LOOK`` versions, doubling the
    wait (up to ``LAST_LOOK``) each time they lose again, so that looking costs a few percent at
    most. A look takes the copy at one version and diffs the next.
    """

    def __init__(self, auto: bool) -> None:
        self.auto = auto
        self.diff_s: float | None = None
        self.patch_s: float | None = None
        self.whole_s: float | None = None
        self.wait = FIRST_LOOK
        self.resting = 0  # versions left before the next look (0: diffing)
        self.looking = False  # the copy is being taken for a look

    def want_diff(self) -> bool:
        """At each publish: diff this version (or take the copy to diff the next)?"""
        if not self.auto:
            return True
        if self.resting > 0:
            self.resting -= 1
            return self.resting == 0
        return True

    def diffed(self, seconds: float) -> None:
        self.diff_s = _mix(self.diff_s, seconds)

    def wrote(self, patched: bool, seconds: float) -> None:
        """A subscriber completed a version: as changes (``patched``) or whole, ``seconds``
        after its write began."""
        if patched:
            self.patch_s = _mix(self.patch_s, seconds)
        else:
            self.whole_s = _mix(self.whole_s, seconds)
        self._judge()

    def _judge(self) -> None:
        if not self.auto or self.resting or None in (self.diff_s, self.patch_s, self.whole_s):
            return
        assert self.diff_s is not None and self.patch_s is not None and self.whole_s is not None
        if self.diff_s + self.patch_s <= MARGIN * self.whole_s:
            self.wait = FIRST_LOOK
            return
        self.resting = self.wait  # changes lost: rest, then look again
        self.wait = min(2 * self.wait, LAST_LOOK)
        self.diff_s = self.patch_s = None  # the look measures them afresh

    @property
    def diffing(self) -> bool:
        """Whether the trainer keeps its copy up to date now."""
        return self.resting == 0
