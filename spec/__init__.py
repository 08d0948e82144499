"""The reference scheduler: pure functions over immutable state (see docs/semantics.md)."""
