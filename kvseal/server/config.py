"""Frontend configuration: one frozen dataclass, its flags, validated on construction."""

from __future__ import annotations

import argparse
import ipaddress
import math
from dataclasses import dataclass

from kvseal.errors import ConfigError

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys_path: str | None = None
    audit_log_path: str | None = None
    audit_log_prompts: bool = False
    served_model_name: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_grace_s: float = 30.0
    header_timeout_s: float = 15.0
    body_timeout_s: float = 60.0
    log_level: str = "INFO"
    generation_config: str = "auto"  # "auto": the model's generation_config.json; "vllm": neutral defaults
    tool_call_parser: str | None = None  # "hermes": parse <tool_call> blocks; None: requests with tools get 400

    def __post_init__(self) -> None:
        if self.tool_call_parser not in (None, "hermes"):
            raise ConfigError(f"--tool-call-parser must be 'hermes', got {self.tool_call_parser!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ConfigError(f"--generation-config must be 'auto' or 'vllm', got {self.generation_config!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if not 0 <= self.shutdown_grace_s < math.inf:
            raise ConfigError(f"--shutdown-grace-s must be a number >= 0, got {self.shutdown_grace_s}")
        for flag, value in (("--header-timeout-s", self.header_timeout_s), ("--body-timeout-s", self.body_timeout_s)):
            if not 0 < value < math.inf:
                raise ConfigError(f"{flag} must be a number of seconds > 0, got {value}")

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerConfig:
        return cls(
            host=ns.host, port=ns.port, api_keys_path=ns.api_keys, audit_log_path=ns.audit_log,
            audit_log_prompts=ns.audit_log_prompts, served_model_name=ns.served_model_name,
            max_body_bytes=ns.max_body_bytes, shutdown_grace_s=ns.shutdown_grace_s,
            header_timeout_s=ns.header_timeout_s, body_timeout_s=ns.body_timeout_s,
            log_level=getattr(ns, "log_level", "INFO"),
            generation_config=getattr(ns, "generation_config", "auto"),
            tool_call_parser=getattr(ns, "tool_call_parser", None),
        )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The frontend's flags (engine flags come from `kvseal.engine_args.add_engine_arguments`)."""
    d = ServerConfig()
    parser.add_argument("--host", default=d.host, help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--api-keys", default=None, metavar="FILE",
                        help='JSON file {"KEY": {"tenant": NAME, "max_concurrent_requests": N, "max_tokens": N, '
                             '"admin": BOOL}}; without it every request runs as tenant \'default\' and /metrics '
                             "is open; with it /metrics needs an admin key")
    parser.add_argument("--audit-log", default=None, metavar="FILE",
                        help="append one JSON line per request here (default: the 'kvseal.audit' logger)")
    parser.add_argument("--audit-log-prompts", action="store_true",
                        help="also write prompt text into the audit log (off by default)")
    parser.add_argument("--served-model-name", default=None,
                        help="model id clients must send (default: the model folder or file name)")
    parser.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                        help="larger request bodies get HTTP 413")
    parser.add_argument("--shutdown-grace-s", type=float, default=d.shutdown_grace_s,
                        help="on SIGTERM, how long in-flight requests may run before they are aborted")
    parser.add_argument("--header-timeout-s", type=float, default=d.header_timeout_s,
                        help="close a connection whose request headers have not all arrived in this time")
    parser.add_argument("--body-timeout-s", type=float, default=d.body_timeout_s,
                        help="answer 408 when a request body has not all arrived this long after its headers")
    parser.add_argument("--generation-config", choices=("auto", "vllm"), default=d.generation_config,
                        help="defaults for omitted temperature/top_p/top_k/repetition_penalty: 'auto' takes "
                             "the model's generation_config.json, 'vllm' neutral values")
    parser.add_argument("--tool-call-parser", choices=("hermes",), default=None,
                        help="parse tool calls from the output in this format (Hermes/Qwen <tool_call> blocks); "
                             "without it, requests with tools are refused")
