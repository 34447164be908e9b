"""Vendor facts and runtime back-end selection for elastiserve. Importing this does not import torch."""

from elastiserve.platforms.capability import ARCHS, ArchFacts, FastGemm, Platform, Vendor, current_platform, resolve
from elastiserve.platforms.env import EnvSettings, settings
from elastiserve.platforms.errors import BackendUnavailable, ConfigError, ElastiserveError

__all__ = [
    "ARCHS",
    "ArchFacts",
    "BackendUnavailable",
    "ConfigError",
    "ElastiserveError",
    "EnvSettings",
    "FastGemm",
    "Platform",
    "Vendor",
    "current_platform",
    "resolve",
    "settings",
]
__version__ = "0.1.0"
