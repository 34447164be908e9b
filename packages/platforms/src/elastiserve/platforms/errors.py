"""The root of elastiserve's typed errors; every package derives its own from these."""


class ElastiserveError(Exception):
    """Base class of every error elastiserve raises on purpose."""


class ConfigError(ElastiserveError, ValueError):
    """A configuration that can never work: raised at startup, fatal."""


class BackendUnavailable(ElastiserveError, RuntimeError):
    """An explicitly requested back-end (platform, VMM, kernel) that this machine cannot provide."""
