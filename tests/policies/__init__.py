"""Scheduling policies (R9): registries, ``reserve``, liveness, conform, bad policies."""
