"""The exceptions the core raises at its edges (backends, plugins, options).

Every message names what is wrong and what to do about it. All derive from ``DeepInferError`` so a
caller can catch the whole family; each also derives from the closest built-in so existing
``except ValueError`` / ``except LookupError`` code keeps working.
"""

from __future__ import annotations


class DeepInferError(Exception):
    """Base class of every error the core raises on purpose."""


class UnknownBackendError(DeepInferError, LookupError):
    """A backend name that no installed distribution registers."""

    def __str__(self) -> str:  # LookupError would quote the message like a dict key otherwise
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(DeepInferError, RuntimeError):
    """An explicitly requested backend is installed but cannot run here; the message carries its probe reason."""


class InvalidBackendError(DeepInferError, TypeError):
    """A backend entry point or backend class breaks the backend contract (wrong return type, wrong base class)."""


class PluginError(DeepInferError):
    """A plugin could not be loaded or broke the hook contract."""


class PluginValidationError(PluginError, TypeError):
    """A plugin's hook implementations or declared hook API version do not match ``deepinfer_core.hookspecs``."""


class UnknownOptionError(DeepInferError, ValueError):
    """A feature option that neither the core nor any loaded plugin claims."""


class UnsupportedBackendError(DeepInferError, ValueError):
    """An active plugin does not support the selected backend."""
