"""CUDA sources of transport (compiled at run time with NVRTC; see README.md here)."""
