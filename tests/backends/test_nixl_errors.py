"""Every NIXL failure becomes an error of our tree, in one place (a fake agent is allowed here only)."""

from __future__ import annotations

import numpy as np
import pytest

from transport import BackendError, PeerLostError, RegionError, TransportError
from transport.backends import available, backend_class, new_backend
from transport.backends.cma import CmaPeers
from transport.backends.nixl import (
    NIXL_ERRORS,
    NixlBackend,
    Prepped,
    load_nixl,
    map_nixl_error,
    nixl_exception_classes,
)

pytestmark = pytest.mark.unit


def test_no_nixl_exception_is_left_unmapped():
    classes = nixl_exception_classes()
    assert classes, "NIXL defines exception classes; the import found none"
    assert set(classes) <= set(NIXL_ERRORS), f"unmapped: {sorted(set(classes) - set(NIXL_ERRORS))}"
    for name, cls in classes.items():
        err = map_nixl_error(cls("boom"), action="posting a transfer", peer="gen-1")
        assert isinstance(err, TransportError), name
        assert err.__cause__ is not None and type(err.__cause__) is cls
        assert "posting a transfer" in str(err) and "gen-1" in str(err) and name in str(err)


def test_disconnect_is_peer_lost_and_names_the_peer():
    cls = nixl_exception_classes()["nixlRemoteDisconnectError"]
    err = map_nixl_error(cls("x"), action="a transfer", peer="gen-3")
    assert isinstance(err, PeerLostError) and err.peer == "gen-3"


class FakeAgent:
    """Raises the NIXL exception it is given from every call."""

    def __init__(self, exc: BaseException | None = None, status: object = None) -> None:
        self.exc, self.status = exc, status

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            if self.exc is not None:
                raise self.exc
            return self.status

        return call


def fake_backend(exc: BaseException | None = None, status: object = None) -> NixlBackend:
    _, b = load_nixl()
    be = object.__new__(NixlBackend)
    be._b = b
    be._raw = FakeAgent(exc, status)
    be._mem = {"DRAM": b.DRAM_SEG, "VRAM": b.VRAM_SEG}
    be._ops = {"READ": b.NIXL_READ, "WRITE": b.NIXL_WRITE}
    be._success, be._in_prog = b.NIXL_SUCCESS, b.NIXL_IN_PROG
    be._closed = False
    be.cma = CmaPeers()  # no peer proven: every transfer goes to the (fake) agent
    return be


def nixl_exc(name: str) -> BaseException:
    return nixl_exception_classes()[name]("from the fake agent")


DESCS = np.array([[4096, 64, 0]], dtype=np.uint64)
LOCAL = Prepped(1, DESCS, None, "DRAM")
REMOTE = Prepped(2, DESCS, "peer#1", "DRAM")


@pytest.mark.parametrize(
    "call, exc, expect",
    [
        (lambda b: b.post(1, b"", "p"), "nixlRemoteDisconnectError", PeerLostError),
        (lambda b: b.poll(1, "p"), "nixlRemoteDisconnectError", PeerLostError),
        (lambda b: b.post(1, b"", "p"), "nixlNotFoundError", PeerLostError),
        (lambda b: b.prep(None, DESCS, "cpu"), "nixlNotFoundError", RegionError),
        (lambda b: b.prep("peer#1", DESCS, "cpu"), "nixlNotFoundError", PeerLostError),
        (lambda b: b.register(4096, 64, "cpu"), "nixlBackendError", BackendError),
        (lambda b: b.add_peer(b"md"), "nixlInvalidParamError", BackendError),
        (lambda b: b.get_notifs(), "nixlUnknownError", BackendError),
        (
            lambda b: b.send_notif("peer#1", b"x", "peer"),
            "nixlRemoteDisconnectError",
            PeerLostError,
        ),
        (
            lambda b: b.make_xfer("WRITE", LOCAL, DESCS, REMOTE, DESCS, b"", "p"),
            "nixlMismatchError",
            RegionError,
        ),
    ],
)
def test_backend_methods_raise_mapped_errors(call, exc, expect):
    with pytest.raises(expect) as info:
        call(fake_backend(nixl_exc(exc)))
    assert type(info.value.__cause__).__name__ == exc


def test_error_statuses_are_errors_too():
    _, b = load_nixl()
    with pytest.raises(BackendError, match="status"):
        fake_backend(status=b.NIXL_ERR_BACKEND).post(1, b"", "p")
    with pytest.raises(PeerLostError, match="status"):
        fake_backend(status=b.NIXL_ERR_BACKEND).poll(1, "p")


def test_remove_and_release_never_raise():
    be = fake_backend(nixl_exc("nixlNotFoundError"))
    be.remove_peer("gone#1")
    assert be.release_xfer(1) is False
    be.release_prepped(LOCAL)


def test_registry():
    assert available() == ["loopback", "nixl"]
    assert backend_class("nixl") is NixlBackend
    with pytest.raises(ValueError, match="unknown backend 'ucc'; known backends: loopback, nixl"):
        new_backend("ucc")
