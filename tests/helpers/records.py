"""A peer record for the wire tests: two regions in two registrations (host and GPU memory)."""

from __future__ import annotations

from typing import Any

from transport import RegionInfo
from transport.wire import PeerRecord


def record(**over: Any) -> PeerRecord:
    base: dict[str, Any] = dict(
        name="gen-0",
        namespace="run-7",
        generation=3,
        agent="gen-0#3",
        backend="nixl",
        metadata=b"md" * 50,
        host="h",
        pid=42,
        version="0.1.0",
        created=1.5,
        regions=(
            RegionInfo("layers.0.w", 0x7F0000001000, 64, "float32", (4, 4), "rw", "cpu"),
            RegionInfo("emb", 0x7F0000002000, 2, "bfloat16", (1,), "r", "cuda:1"),
        ),
        registrations=((0x7F0000001000, 4096, "cpu"), (0x7F0000002000, 2, "cuda:1")),
    )
    base.update(over)
    return PeerRecord(**base)
