"""`kvseal canary`: a tenant-isolation harness against any OpenAI-compatible server."""

from kvseal.canary.cli import add_canary_arguments, cmd_canary

__all__ = ["add_canary_arguments", "cmd_canary"]
