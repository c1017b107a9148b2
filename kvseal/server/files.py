"""What the front door reads and opens before anything starts: the API keys and the audit log.

Kept apart from the HTTP server's modules (FastAPI, the tokenizer) so that `kvseal serve` can
check both, then start its engine process, before it loads them."""

from __future__ import annotations

from dataclasses import dataclass

from kvseal.errors import ConfigError
from kvseal.server.audit import AuditLog
from kvseal.server.auth import ApiKeyTable
from kvseal.server.config import ServerConfig


@dataclass
class FrontDoorFiles:
    keys: ApiKeyTable
    audit: AuditLog

    @classmethod
    def open(cls, config: ServerConfig) -> FrontDoorFiles:
        """ConfigError for a bad keys file (its keys never echoed) or an audit log that cannot be opened."""
        keys = ApiKeyTable.load(config.api_keys_path)
        try:
            audit = AuditLog(config.audit_log_path, config.audit_log_prompts, max_bytes=config.audit_log_max_bytes,
                             max_age_s=config.audit_log_max_age_s, num_backups=config.audit_log_backups)
        except OSError as exc:
            raise ConfigError(f"cannot open the audit log {config.audit_log_path}: {exc}") from exc
        return cls(keys, audit)
