"""The stateful machines as targets of a fuzzing campaign (docs/stateful-testing.md)."""
