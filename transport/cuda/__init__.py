"""Stream-ordered transfers on CUDA streams (``put``/``get``/``publish`` with ``stream=``).

``proxy`` (the doorbell watcher) needs nothing from CUDA; ``stream`` (kernels, pinned words,
handles) imports CuPy only when a ``stream=`` call is made."""
