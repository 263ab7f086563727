"""The generator's side of a weight group: :class:`WeightSubscriber` (staging slots or in place),
:class:`WindowedSubscriber` (versions written into the generator's own tensors while a window is
open), and what a subscriber does for others: relaying a version on, hearing its upstream,
collecting a sharded trainer's ranks. Users import them from ``transport.weights``."""
