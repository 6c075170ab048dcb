"""The package version (pyproject reads it)."""

__version__ = "0.1.0"
