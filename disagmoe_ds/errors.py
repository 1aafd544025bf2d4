"""Exceptions a user can cause. Every message names the field, the value, the rule and the fix."""


class DisagMoEError(ValueError):
    """Base class for user-facing errors of DisagMoE-DS."""


class LayoutError(DisagMoEError):
    """The attention/FFN layout does not fit the model or the world size."""


class ConfigError(DisagMoEError):
    """A config file or command-line value is malformed or inconsistent."""


class UnsupportedModelError(DisagMoEError):
    """The Hugging Face architecture has no DisagMoE adapter."""


class CheckpointError(DisagMoEError):
    """A checkpoint is missing, incomplete, corrupt or belongs to another model."""
