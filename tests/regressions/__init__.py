"""Shrunk failures of the stateful suite, kept as plain tests (docs/stateful-testing.md)."""
