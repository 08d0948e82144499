"""Hypothesis stateful differential suite: spec vs engine (docs/stateful-testing.md)."""
