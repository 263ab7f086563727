"""The version of the library (one place; peer records carry it)."""

__version__ = "0.1.0"
