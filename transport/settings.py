"""The settings of one Transport, checked once, read live by its parts."""

from __future__ import annotations

from dataclasses import dataclass


def positive(what: str, value: object) -> None:
    """Refuse anything but a positive number of seconds."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{what} must be a positive number of seconds, got {value!r}")


def check_lanes(lanes: object) -> int:
    if not isinstance(lanes, int) or isinstance(lanes, bool) or not 1 <= lanes <= 16:
        raise ValueError(f"lanes must be an int from 1 to 16 (1: no extra agents), got {lanes!r}")
    return lanes


#: transfers between host memory of at least this many bytes are cut over the lanes: from about
#: 8 MiB two agents copying halves beat one (below it, the first and last parts that go alone
#: leave too little to share; benchmarks/README.md, "Lanes")
LANE_BYTES = 8 << 20


@dataclass
class Settings:
    """What a Transport was configured with (see its docstring for each).

    It owns the values and their rules: every field is checked here, at construction, and
    ``lanes`` again when it changes (a Transport may turn its lanes on and off). The parts of a
    Transport share one Settings object and read it on every use, so a change applies to the next
    transfer.
    """

    timeout: float = 60.0
    chunk_bytes: int = 64 << 20
    inline_bytes: int = 1 << 20
    idle_interval: float = 1.0
    heartbeat_interval: float = 1.0
    lanes: int = 1
    lane_bytes: int = LANE_BYTES
    max_plans: int = 4096

    def __post_init__(self) -> None:
        positive("timeout", self.timeout)
        positive("idle_interval", self.idle_interval)
        positive("heartbeat_interval", self.heartbeat_interval)
        if self.chunk_bytes < 4096 or self.inline_bytes < 0:
            raise ValueError("chunk_bytes must be at least 4096 and inline_bytes non-negative")
        self.timeout = float(self.timeout)
        self.chunk_bytes = int(self.chunk_bytes)
        self.inline_bytes = int(self.inline_bytes)
        check_lanes(self.lanes)
        if not isinstance(self.lane_bytes, int) or self.lane_bytes < 1 << 20:
            raise ValueError(
                f"lane_bytes must be an int of at least 1 MiB, got {self.lane_bytes!r}"
            )
        if not isinstance(self.max_plans, int) or self.max_plans < 1:
            raise ValueError(f"max_plans must be a positive int, got {self.max_plans!r}")
