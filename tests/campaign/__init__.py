"""The campaign: the stateful machines run by many workers on one shared example database
(scripts/campaign; docs/stateful-testing.md, "Campaign")."""
