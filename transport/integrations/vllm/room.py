"""How much staging memory a vLLM worker may take for the versions it receives.

``staging_gb`` in the init info says it. Without it, the bound is what the staging device has
free once vLLM has taken its own (weights, activations, and the KV cache, which vLLM sizes to
fill what it was given), measured when the worker joins, less a margin for what the process
still allocates while it serves and loads (a layer at a time during a reload):

* a CUDA device: ``torch.cuda.mem_get_info`` (free bytes as the driver counts them, every
  process on the device included);
* host memory: ``MemAvailable`` of ``/proc/meminfo`` (what the kernel can hand out without
  swapping, page cache that it can drop included).

A worker whose copies do not fit then takes one, or none (in place, where vLLM computes with its
parameters as stored: its GPU builds, unquantized), or streams the version in parts through two
buckets of half the bound (see worker.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: the share of the free memory a worker stages into when no staging_gb is given
FREE_SHARE = 0.8


@dataclass(frozen=True)
class Room:
    """``bound``: the most bytes the worker stages; ``how``: where that figure comes from
    (for the log, the state and error messages)."""

    bound: int
    how: str


def staging_room(staging_gb: float | None, device: torch.device) -> Room:
    """The staging bound of a worker: ``staging_gb`` when given, else FREE_SHARE of the memory
    free on ``device`` now."""
    if staging_gb is not None:
        return Room(int(staging_gb * 2**30), f"staging_gb={staging_gb}")
    free, source = free_bytes(device)
    bound = int(free * FREE_SHARE)
    return Room(
        bound,
        f"{FREE_SHARE:.0%} of the {free / 2**30:.2f} GiB free on {device} after vLLM's own "
        f"allocation ({source}); give staging_gb to set it",
    )


def free_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes free on ``device`` now, how that was measured)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), "torch.cuda.mem_get_info"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable of /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    import psutil  # a dependency of vLLM

    return int(psutil.virtual_memory().available), "psutil's available memory"
