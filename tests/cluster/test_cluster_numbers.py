"""A cluster number is claimed again only once the removal of the dead cluster that held it is
over: a slower cleaner never removes the namespaces of a new cluster of the same number."""

from __future__ import annotations

import json
import threading

import pytest

from transport.cluster import leftovers

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_a_number_being_cleaned_is_not_claimed_until_its_removal_is_over(tmp_path, monkeypatch):
    monkeypatch.setattr(leftovers, "STATE_DIR", tmp_path)
    # cluster 1 of a run that was killed: its owner is gone (no such process)
    (tmp_path / "1.json").write_text(
        json.dumps({"owner": 2**22 + 7, "started": "0", "namespaces": ["tpc1-gen0"]})
    )
    removing, release = threading.Event(), threading.Event()
    removed: list[tuple[int, list[str]]] = []

    def slow_remove(number, namespaces):
        removing.set()  # the cleaner is killing what runs in the dead cluster's namespaces
        assert release.wait(20)
        removed.append((number, list(namespaces)))
        (tmp_path / f"{number}.json").unlink()

    monkeypatch.setattr(leftovers, "remove", slow_remove)
    monkeypatch.setattr(leftovers, "_namespaces", lambda: [])
    cleaner = threading.Thread(target=leftovers.clean_leftovers)
    cleaner.start()
    assert removing.wait(10)
    claimed: list[int] = []
    claimer = threading.Thread(target=lambda: claimed.append(leftovers.claim_number()))
    claimer.start()
    claimer.join(1.0)
    # without the lock it would have claimed 2 at once (1.json still there), or 1 once unlinked
    # while the cleaner had not finished: here it waits for the removal to end
    assert claimed == [] and claimer.is_alive()
    release.set()
    cleaner.join(10)
    claimer.join(10)
    assert removed == [(1, ["tpc1-gen0"])]
    assert claimed == [1]  # the dead cluster's number, once nothing of it is left
