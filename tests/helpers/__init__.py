"""Test helpers: real processes (Redis servers, Python children) and free ports."""
