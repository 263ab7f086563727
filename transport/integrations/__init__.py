"""Adapters that let other engines consume transport. They sit above the core and the weight-sync
layer and use the public API only (``transport``, ``transport.weights``); each imports its engine
only when it is used, so the package installs and imports without them."""
