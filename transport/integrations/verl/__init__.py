"""verl's checkpoint engine on this library (``checkpoint_engine.backend=transport``).

verl imports this module on every worker when ``checkpoint_engine.custom_backend_module`` names
it; importing it registers :class:`~transport.integrations.verl.engine.TransportCheckpointEngine`
as ``"transport"`` in verl's ``CheckpointEngineRegistry``. The bucket stream it runs on
(transport/weights/buckets/) does not need verl; without verl this package still imports, and
only the engine is missing (with the line that installs verl).
"""

from __future__ import annotations

from typing import Any

try:
    import verl.checkpoint_engine.base  # noqa: F401
except ImportError as e:
    _MISSING: ImportError | None = e
else:
    _MISSING = None
    from transport.integrations.verl.engine import TransportCheckpointEngine  # noqa: F401

__all__ = ["TransportCheckpointEngine"]


def __getattr__(name: str) -> Any:
    if name == "TransportCheckpointEngine" and _MISSING is not None:
        raise ImportError(
            f"the transport checkpoint engine needs verl ({_MISSING}); install it with "
            "`bash examples/setup_verl.sh` (verl==0.9.1 and what its checkpoint engines import)"
        )
    raise AttributeError(name)
