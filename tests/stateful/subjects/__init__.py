"""The systems under test of the one lockstep machine, one file each (tests/stateful/subject.py
says what a subject gives; docs/stateful-testing.md, "Adding a subject")."""

from tests.stateful.subject import Capabilities

#: Our scheduler and engine: every capability the rules know (prefix caching aside: it
#: refuses swap, so the subjects with caching on drop swap for it).
OURS = Capabilities(
    faults=True,
    swap=True,
    bad_requests=True,
    duplicate_ids=True,
    unknown_ids=True,
    oversize_in_every_add=True,
    priorities=True,
)
