"""The trainer's side of a weight group: the publishers (:class:`WeightPublisher`, one process
holding every tensor; :class:`ShardedPublisher`, one per rank of a sharded trainer), the roster of
subscribers they serve, the handles of a publish, and the write plans they replay. Users import
them from ``transport.weights``."""

from transport.weights.publishing.roster import FANOUTS

__all__ = ["FANOUTS"]
