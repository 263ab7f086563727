"""Every test of this folder runs hosts on network namespaces (transport/cluster/): marker
``hosts``, so that ``pytest -m hosts`` runs them all. They need root and iproute2; without them
each is skipped with the reason (the test command runs as root in CI, so there they run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from transport import ClusterError
from transport.cluster import check_rights


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.hosts)


@pytest.fixture
def rights() -> None:
    try:
        check_rights()
    except ClusterError as e:
        pytest.skip(str(e))
