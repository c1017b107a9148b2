"""Sampling defaults from a folder's generation_config.json and from vLLM's override
(`--generation-config FOLDER`, `--override-generation-config JSON`): where each value comes
from, and what stops start-up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvseal.cli import build_parser
from kvseal.errors import ConfigError
from kvseal.generation_defaults import GenerationDefaults, parse_override
from kvseal.server.config import ServerConfig


def _folder(path: Path, values: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(values))
    return path


def test_the_override_is_laid_over_the_file_or_over_the_neutral_values(tmp_path: Path) -> None:
    model = _folder(tmp_path / "model", {"temperature": 0.6, "top_k": 20, "max_new_tokens": 3, "bos_token_id": 1})
    merged = GenerationDefaults.load("auto", model, {"temperature": 0.1, "max_new_tokens": 9})
    assert (merged.temperature, merged.top_k, merged.max_tokens) == (0.1, 20, 9)
    assert merged.describe().startswith("temperature=0.1 [override] top_p=1 [neutral] top_k=20 [file] ")
    assert "max_tokens=9 [override]" in merged.describe()
    neutral = GenerationDefaults.load("vllm", model, {"top_p": 0.5})
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.max_tokens) == (1.0, 0.5, -1, None)
    assert "top_p=0.5 [override]" in neutral.describe() and "[file]" not in neutral.describe()
    dropped = GenerationDefaults.load("auto", model, {"top_k": None})  # vLLM: a null override unsets the file's
    assert (dropped.top_k, dropped.temperature) == (-1, 0.6) and "top_k=-1 [neutral]" in dropped.describe()
    assert GenerationDefaults.load("auto", model, {}) == GenerationDefaults.load("auto", model)


def test_a_folder_is_read_in_place_of_the_models_file(tmp_path: Path) -> None:
    model = _folder(tmp_path / "model", {"temperature": 0.6, "top_k": 20})
    other = _folder(tmp_path / "other", {"temperature": 0.2})
    defaults = GenerationDefaults.load(str(other), model, {"min_p": 0.1})
    assert (defaults.temperature, defaults.top_k, defaults.min_p) == (0.2, -1, 0.1), "nothing of the model's file"
    assert f"(file {other / 'generation_config.json'})" in defaults.describe()
    assert GenerationDefaults.load(str(other), None).temperature == 0.2, "a bare .gguf model: the folder still counts"


@pytest.mark.parametrize("mode, why", [
    ("missing", "'.*missing' is no folder"),
    ("empty", "the folder '.*empty' holds no generation_config.json"),
    ("model/generation_config.json", "is no folder"),
    ("", "takes auto, vllm or a folder"),
])
def test_a_folder_without_the_file_stops_start_up(tmp_path: Path, mode: str, why: str) -> None:
    _folder(tmp_path / "model", {"temperature": 0.6})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=f"--generation-config.*{why}"):
        GenerationDefaults.load(str(tmp_path / mode) if mode else mode, tmp_path / "model")


@pytest.mark.parametrize("override, named", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": "high"}, "top_p"),
    ({"min_p": 2}, "min_p"),
    ({"top_k": [5]}, "top_k must be a number"),
    ({"top_k": 2.5}, "top_k must be a whole number"),
    ({"top_k": float("inf")}, "top_k must be a finite number"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be a positive integer"),
    ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
    ({"repetition_penalty": True}, "repetition_penalty"),
])
def test_override_values_are_checked_as_the_files_are(tmp_path: Path, override: dict[str, Any], named: str) -> None:
    model = _folder(tmp_path / "model", {})
    with pytest.raises(ConfigError, match=named) as from_override:
        GenerationDefaults.load("auto", model, override)
    _folder(model, override)
    with pytest.raises(ConfigError, match=named) as from_file:
        GenerationDefaults.load("auto", model)
    assert str(from_override.value).startswith("--override-generation-config: bad sampling default: ")
    assert str(from_file.value).startswith(f"{model / 'generation_config.json'}: bad sampling default: ")
    assert str(from_override.value).split("bad sampling default: ")[1] == \
        str(from_file.value).split("bad sampling default: ")[1], "one check, the same words"


@pytest.mark.parametrize("text, why", [
    ('{"max_tokens": 64}', "unknown key.*'max_tokens'.*max_tokens is max_new_tokens there"),
    ('{"do_sample": true}', "unknown key.*'do_sample'.*it takes temperature, top_p, top_k, min_p"),
    ("[0.5]", "must be a JSON object.*got list"),
    ('"temperature=0.5"', "must be a JSON object.*got str"),
    ("null", "must be a JSON object.*got NoneType"),
    ("{temperature: 0.5}", "is not valid JSON"),
])
def test_an_override_that_is_not_an_object_of_vllms_keys_is_refused(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=f"--override-generation-config.*{why}"):
        parse_override(text)


def test_serve_flags_take_a_folder_and_an_override(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "defaults", {"temperature": 0.3})
    parser = build_parser()
    ns = parser.parse_args(["serve", "/models/m", "--generation-config", str(folder),
                            "--override-generation-config", '{"top_k": 5, "max_new_tokens": 12}'])
    config = ServerConfig.from_namespace(ns)
    assert (config.generation_config, config.generation_override) == (str(folder), {"top_k": 5, "max_new_tokens": 12})
    defaults = GenerationDefaults.load(config.generation_config, None, config.generation_override)
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.3, 5, 12)
    assert ServerConfig.from_namespace(parser.parse_args(["serve", "/models/m"])).generation_override == {}
    for bad in (["--override-generation-config", '{"top_k": "5"}'],
                ["--generation-config", str(tmp_path / "nowhere")]):
        with pytest.raises(ConfigError, match="top_k must be a number|is no folder"):
            ServerConfig.from_namespace(parser.parse_args(["serve", "/models/m", *bad]))
