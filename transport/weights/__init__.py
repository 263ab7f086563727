"""Weight sync for RL: a publisher (the trainer) and subscribers (generators) of a named group."""

from transport.weights.publisher import PublishHandle, PublishResult, WeightPublisher
from transport.weights.subscriber import WeightSubscriber

__all__ = ["PublishHandle", "PublishResult", "WeightPublisher", "WeightSubscriber"]
