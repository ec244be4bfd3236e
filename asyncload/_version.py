"""The one place the version is written; pyproject.toml and ``asyncload --version`` read it."""

__version__ = "0.2.0"
