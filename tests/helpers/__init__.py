"""Shared test helpers (importable as ``helpers.*``: tests/ is on the path)."""
