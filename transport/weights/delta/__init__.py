"""Delta updates: a version as its changes against the one before it. The codec (one blob
format for both protocols), the trainer's copies, the auto policy, the application of changes."""

from transport.weights.delta.codec import as_ints, width_of
from transport.weights.delta.policy import DeltaPolicy

__all__ = ["DeltaPolicy", "as_ints", "width_of"]
