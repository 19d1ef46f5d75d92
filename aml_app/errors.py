"""The error every configuration check raises: at the bottom of the package, so every room can raise it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value a person has to fix before the service can start."""
