"""kvexport's version, importable by every layer without the package's public API."""

__version__ = "0.1.0"
