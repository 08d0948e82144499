"""Tests of the reference scheduler ``spec/`` (rules R1-R11 of docs/semantics.md)."""
