"""What the front door reads and opens before anything starts: the API keys, the audit log, and
a `--chat-template`.

Kept apart from the HTTP server's modules (FastAPI, the tokenizer) so that `kvseal serve` can
check both, then start its engine process, before it loads them."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvseal.errors import ConfigError
from kvseal.prompting import load_chat_template
from kvseal.server.audit import AuditLog
from kvseal.server.auth import ApiKeyTable
from kvseal.server.config import ServerConfig


@dataclass
class FrontDoorFiles:
    keys: ApiKeyTable
    audit: AuditLog
    chat_template: str | None = None  # --chat-template's template, read

    @classmethod
    def open(cls, config: ServerConfig) -> FrontDoorFiles:
        """ConfigError for a bad keys file (its keys never echoed), an audit log that cannot be
        opened, or a --chat-template that is neither a readable file nor a template."""
        if config.api_keys_path is None and os.environ.get("VLLM_API_KEY"):
            raise ConfigError("VLLM_API_KEY is set, but kvseal does not read it: this server would run with no key "
                              "at all. Put the key in a JSON file, {\"KEY\": {\"tenant\": \"NAME\"}}, mode 0600, "
                              "and pass --api-keys FILE (or unset VLLM_API_KEY to serve without keys)")
        keys = ApiKeyTable.load(config.api_keys_path)
        chat_template = None if config.chat_template is None else load_chat_template(config.chat_template)
        try:
            audit = AuditLog(config.audit_log_path, config.audit_log_prompts, max_bytes=config.audit_log_max_bytes,
                             max_age_s=config.audit_log_max_age_s, num_backups=config.audit_log_backups)
        except OSError as exc:
            raise ConfigError(f"cannot open the audit log {config.audit_log_path}: {exc}") from exc
        return cls(keys, audit, chat_template)
