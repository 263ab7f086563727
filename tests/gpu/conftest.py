"""GPU tests (marker ``cuda``): skipped where there is no CUDA device or no CuPy; the stores and
the writer come from tests/conftest.py."""
