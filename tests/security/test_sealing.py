"""Notification MACs and the replay window, frame by frame."""

from __future__ import annotations

import pytest

from transport import SignatureError
from transport.security.sealing import (
    REPLAY_WINDOW,
    TRAILER_BYTES,
    FrameOpener,
    keys_for,
    sequence_base,
)

pytestmark = pytest.mark.unit

KEYS = keys_for(b"secret-123", "ns")
A, B = "a#1", "b#1"


def test_a_sealed_frame_opens_once_at_its_receiver_only():
    sealer = KEYS.sealer(A, B)
    sealed = sealer.seal(b"frame")
    assert len(sealed) == len(b"frame") + TRAILER_BYTES
    assert FrameOpener(KEYS, B).open(A, sealed) == b"frame"
    with pytest.raises(SignatureError, match="MAC does not match"):
        FrameOpener(KEYS, "b#2").open(A, sealed)  # another incarnation of the receiver
    with pytest.raises(SignatureError, match="MAC does not match"):
        FrameOpener(KEYS, B).open("c#1", sealed)  # claimed by another sender
    with pytest.raises(SignatureError, match="MAC does not match"):
        FrameOpener(keys_for(b"secret-123", "other-ns"), B).open(A, sealed)
    opener = FrameOpener(KEYS, B)
    opener.open(A, sealed)
    with pytest.raises(SignatureError, match="already received once"):
        opener.open(A, sealed)


def test_every_changed_byte_is_refused():
    sealed = KEYS.sealer(A, B).seal(b"payload-bytes")
    for i in range(len(sealed)):
        bad = bytearray(sealed)
        bad[i] ^= 0x40
        with pytest.raises(SignatureError):
            FrameOpener(KEYS, B).open(A, bytes(bad))
    with pytest.raises(SignatureError, match="carries no MAC"):
        FrameOpener(KEYS, B).open(A, b"short")


def test_reordered_frames_within_the_window_are_accepted_once_and_old_ones_refused():
    sealer = KEYS.sealer(A, B)
    frames = [sealer.seal(b"%d" % i) for i in range(REPLAY_WINDOW + 10)]
    opener = FrameOpener(KEYS, B)
    opener.open(A, frames[5])
    for i in (3, 0, 4, 1, 2):  # overtaken frames arrive late: each once
        assert opener.open(A, frames[i]) == b"%d" % i
    with pytest.raises(SignatureError, match="already received"):
        opener.open(A, frames[3])
    opener.open(A, frames[-1])  # the newest jumps ahead by more than the window
    with pytest.raises(SignatureError, match="older than"):
        opener.open(A, frames[6])
    assert opener.open(A, frames[-2]) == b"%d" % (REPLAY_WINDOW + 8)


def test_senders_are_numbered_apart():
    to_b, to_c = KEYS.sealer(A, B), KEYS.sealer(A, "c#1")
    opener = FrameOpener(KEYS, B)
    to_c.seal(b"x")
    assert opener.open(A, to_b.seal(b"1")) == b"1"
    assert opener.open("d#1", KEYS.sealer("d#1", B).seal(b"2")) == b"2"


def test_a_new_sealer_to_the_same_receiver_continues_above_the_last_one():
    """A reconnect to the same incarnation makes a new sealer; the receiver's window outlives the
    old connection, so the new sealer's numbers must start above every number the old one used
    (they start at the process's clock in nanoseconds), however many frames it sealed."""
    opener = FrameOpener(KEYS, B)
    first = KEYS.sealer(A, B)
    for i in range(REPLAY_WINDOW + 100):
        opener.open(A, first.seal(b"a%d" % i))
    again = KEYS.sealer(A, B)  # the reconnect
    for i in range(10):
        assert opener.open(A, again.seal(b"b%d" % i)) == b"b%d" % i
    # and a frame of the old connection still in flight is refused only if it is a replay
    late = first.seal(b"late")
    with pytest.raises(SignatureError, match="older than"):
        opener.open(A, late)


def test_sequence_bases_never_go_back_within_a_process():
    bases = [sequence_base() for _ in range(1000)]
    assert bases == sorted(set(bases))
