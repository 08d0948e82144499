"""Errors raised while reading checkpoints."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is malformed or describes a model this package cannot run."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint directory or one of its required files does not exist."""
