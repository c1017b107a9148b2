"""Test-only helpers. Nothing here is reachable from a CLI flag, an env var or EngineArgs."""
