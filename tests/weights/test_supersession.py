"""The one rule of supersession (weights/supersession.py) and both protocols keeping it: a
publisher's older version and a verl engine's older update are superseded by the newer one."""

from __future__ import annotations

import pytest

from transport import UpdateSupersededError
from transport.weights.buckets import Inbox
from transport.weights.supersession import Supersession

pytestmark = pytest.mark.unit


def test_only_the_key_begun_last_is_live():
    newest: Supersession[int] = Supersession()
    assert newest.live is None and newest.superseded(1)  # nothing begun: nothing is live
    assert newest.begin(1) is None and not newest.superseded(1)
    assert newest.begin(2) == 1
    assert newest.superseded(1) and not newest.superseded(2) and newest.live == 2


def test_an_engine_that_begins_another_update_supersedes_the_running_one(loopback_net):
    inbox = Inbox(loopback_net.make("writer"))
    try:
        inbox.begin("0" * 16)
        inbox.check("0" * 16)
        inbox.begin("1" * 16)
        with pytest.raises(UpdateSupersededError, match="superseded by update 1111"):
            inbox.check("0" * 16)
        with pytest.raises(UpdateSupersededError):
            inbox.post("0" * 16, lambda: pytest.fail("a superseded update must start no put"))
    finally:
        inbox.close()
