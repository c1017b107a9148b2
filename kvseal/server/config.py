"""Frontend configuration: one frozen dataclass, its flags, validated on construction."""

from __future__ import annotations

import argparse
import ipaddress
import math
from dataclasses import dataclass, field
from typing import Any

from kvseal.capacity import parse_bytes
from kvseal.errors import ConfigError
from kvseal.flags import add_flags, flag, values_of
from kvseal.generation_defaults import GenerationDefaults, parse_override
from kvseal.server.open_files import FDS_KEPT, check_max_connections
from kvseal.server.reasoning import REASONING_PARSERS

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")  # `server/tools/`


def _size(text: str) -> int:
    """A size flag's value ('100MiB'); argparse reports a bad one as the flag's error."""
    try:
        return parse_bytes(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP frontend's settings; each field with a flag is `kvseal serve`'s flag (`kvseal.flags`)."""

    host: str = field(default="127.0.0.1", metadata=flag("address to bind (default: loopback only)"))
    port: int = field(default=8000, metadata=flag("port to bind"))
    api_keys_path: str | None = field(default=None, metadata=flag(
        'JSON file {"KEY" or "sha256:HEX": {"tenant": NAME, "max_concurrent_requests": N (default 64), '
        '"max_tokens": N, "requests_per_minute": N, "tokens_per_minute": N, "admin": BOOL, "revoked": BOOL}}, '
        "reloaded on SIGHUP and POST /admin/keys/reload; without it every request runs as tenant 'default' and "
        "/metrics and /admin are open; with it they need an admin key", name="--api-keys", metavar="FILE"))
    audit_log_path: str | None = field(default=None, metadata=flag(
        "append one JSON line per request here (default: the 'kvseal.audit' logger)", name="--audit-log",
        metavar="FILE"))
    audit_log_max_bytes: int | None = field(default=None, metadata=flag(
        "rotate the audit log before a line would take it past this size (e.g. 100MiB): the file is renamed "
        "FILE.N (N counts up; FILE.1 is the oldest) between whole lines and a new FILE started; default: never",
        type=_size, metavar="BYTES"))
    audit_log_max_age_s: float | None = field(default=None, metadata=flag(
        "also rotate the audit log before a line that comes this many seconds or more after the file's first "
        "line (86400: a file per day at most); default: never", type=float, metavar="SECONDS"))
    audit_log_backups: int | None = field(default=None, metadata=flag(
        "with rotation: keep only the newest N rotated files, deleting older ones (each deletion "
        "logged); default: keep every one, since the audit log is an incident's evidence and is deleted only "
        "when the operator says how much to keep", type=int, metavar="N"))
    audit_log_prompts: bool = field(default=False, metadata=flag(
        "also write prompt text into the audit log (off by default)", action="store_true"))
    served_model_name: str | None = field(default=None, metadata=flag(
        "model id clients must send (default: the model folder or file name)"))
    max_body_bytes: int = field(default=DEFAULT_MAX_BODY_BYTES, metadata=flag("larger request bodies get HTTP 413"))
    shutdown_grace_s: float = field(default=30.0, metadata=flag(
        "on SIGTERM, how long in-flight requests may run before they are aborted"))
    # None: the open-files limit (raised to the hard one at start) less FDS_KEPT
    max_connections: int | None = field(default=None, metadata=flag(
        "HTTP connections open at once at most; one past it is answered 503 too_many_connections and closed, so "
        f"held connections never take the descriptors the engine links and the audit log need (default: the "
        f"open-files limit, which start-up raises to the hard one, less {FDS_KEPT})", type=int, metavar="N"))
    header_timeout_s: float = field(default=15.0, metadata=flag(
        "close a connection whose request headers have not all arrived in this time"))
    body_timeout_s: float = field(default=60.0, metadata=flag(
        "answer 408 when a request body has not all arrived this long after its headers"))
    log_level: str = "INFO"  # the top-level --log-level (every command has it)
    # None: --log-level's
    uvicorn_log_level: str | None = field(default=None, metadata=flag(
        "the HTTP server's (uvicorn's) log level, as vLLM's flag: its access lines are INFO (default: the "
        "top-level --log-level)", choices=("critical", "error", "warning", "info", "debug", "trace")))
    # "auto": the model's generation_config.json; "vllm": neutral defaults; else a folder holding one
    generation_config: str = field(default="auto", metadata=flag(
        "defaults for omitted temperature/top_p/top_k/min_p/repetition_penalty (and max_tokens, from "
        "max_new_tokens): 'auto' takes the model's generation_config.json, 'vllm' neutral values, a folder the "
        "generation_config.json in it (start-up stops if it has none)", metavar="{auto,vllm,FOLDER}"))
    # None: no override; else a JSON object (checked in __post_init__, parsed by `generation_override`)
    override_generation_config: str | None = field(default=None, metadata=flag(
        "a JSON object of sampling defaults laid over --generation-config's (over the neutral ones with 'vllm'), "
        "e.g. '{\"temperature\": 0.7, \"max_new_tokens\": 256}'; keys as vLLM's: temperature, top_p, top_k, "
        "min_p, repetition_penalty, max_new_tokens; null drops the file's value", metavar="JSON"))
    # None: requests with tools get 400
    tool_call_parser: str | None = field(default=None, metadata=flag(
        "parse tool calls from the output in this format: hermes (Hermes/Qwen <tool_call> blocks), llama3_json "
        "(Llama 3.1-3.3 JSON calls), mistral ([TOOL_CALLS] and a JSON list of calls), pythonic (Llama 3.2 and 4: "
        "[name(key=value, ...)]), qwen3_coder (Qwen3-Coder: <tool_call> blocks of <function=name> and "
        "<parameter=key> XML); without it, requests with tools are refused", choices=TOOL_CALL_PARSERS))
    enable_auto_tool_choice: bool = field(default=False, metadata=flag(
        "vLLM's flag, taken so its command lines run: tool_choice 'auto' is on whenever --tool-call-parser is "
        "given; this flag without a parser is refused, as in vLLM", action="store_true"))
    chat_template: str | None = field(default=None, metadata=flag(
        "the chat template for /v1/chat/completions and /tokenize's messages instead of the model's: a file "
        "holding a Jinja template, or the template itself (vLLM's --chat-template)", metavar="FILE_OR_TEMPLATE"))
    # vLLM's: a thinking model's <think> block goes to the message's `reasoning`, the rest to `content`
    reasoning_parser: str | None = field(default=None, metadata=flag(
        "put a thinking model's <think>...</think> reasoning in the chat message's `reasoning` "
        "(and `reasoning_content`) instead of its content", choices=REASONING_PARSERS))

    def __post_init__(self) -> None:
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ConfigError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                              f"{self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser: the parser is what reads the "
                              "model's calls")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ConfigError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got "
                              f"{self.reasoning_parser!r}")
        # reads a named folder's generation_config.json: a bad one stops start-up before any engine starts
        GenerationDefaults.check(self.generation_config, self.generation_override)
        self._check_audit_rotation()
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError(f"--served-model-name must name the model clients send, got {self.served_model_name!r}; "
                              f"leave it out to serve under the model folder or file name")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if not 0 <= self.shutdown_grace_s < math.inf:
            raise ConfigError(f"--shutdown-grace-s must be a number >= 0, got {self.shutdown_grace_s}")
        for name, value in (("--header-timeout-s", self.header_timeout_s), ("--body-timeout-s", self.body_timeout_s)):
            if not 0 < value < math.inf:
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value}")
        check_max_connections(self.max_connections)

    @property
    def generation_override(self) -> dict[str, Any]:
        """--override-generation-config as an object ({} without it)."""
        return parse_override(self.override_generation_config)

    def _check_audit_rotation(self) -> None:
        if self.audit_log_max_bytes is not None:
            if self.audit_log_path is None:
                raise ConfigError("--audit-log-max-bytes rotates the audit log file: give --audit-log FILE too")
            if self.audit_log_max_bytes < 1024:
                raise ConfigError(f"--audit-log-max-bytes must be >= 1024 (one audit line is a few hundred "
                                  f"bytes), got {self.audit_log_max_bytes}")
        if self.audit_log_max_age_s is not None:
            if self.audit_log_path is None:
                raise ConfigError("--audit-log-max-age-s rotates the audit log file: give --audit-log FILE too")
            if not 0 < self.audit_log_max_age_s < math.inf:
                raise ConfigError(f"--audit-log-max-age-s must be a number of seconds > 0, got "
                                  f"{self.audit_log_max_age_s}")
        if self.audit_log_backups is not None:
            if self.audit_log_max_bytes is None and self.audit_log_max_age_s is None:
                raise ConfigError("--audit-log-backups limits the rotated audit files: give --audit-log-max-bytes "
                                  "or --audit-log-max-age-s too")
            if self.audit_log_backups < 0:
                raise ConfigError(f"--audit-log-backups must be >= 0, got {self.audit_log_backups}")

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
        return cls(**values_of(ns, cls), log_level=getattr(ns, "log_level", "INFO"))


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The frontend's flags (engine flags come from `kvseal.engine_args.add_engine_arguments`)."""
    add_flags(parser, ServerConfig)
    parser.add_argument("--api-key", action=_RefuseKeyOnCommandLine, help=argparse.SUPPRESS)


API_KEY_ON_COMMAND_LINE = (
    "kvseal takes API keys from a file, never from the command line, where every local user can read them "
    "in the process list: put the key in a JSON file, {\"KEY\": {\"tenant\": \"NAME\"}}, mode 0600, and pass "
    "--api-keys FILE (the value given was neither used nor logged)")


class _RefuseKeyOnCommandLine(argparse.Action):
    """vLLM's `--api-key KEY`: refused by name, before argparse would take it for an abbreviation
    of `--api-keys` and report the key back as a file it cannot read."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        parser.error(API_KEY_ON_COMMAND_LINE)
