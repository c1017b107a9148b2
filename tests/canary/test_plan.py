"""The workload plan: the mix asked for, prompts that fit or overflow by construction."""

from __future__ import annotations

import pytest

from kvseal.canary.config import CanaryConfig, load_keys
from kvseal.canary.plan import Endpoint, build_plan, max_prompt_chars
from kvseal.errors import ConfigError

KEYS = tuple(f"k{i}" for i in range(8))


def _config(**kw: object) -> CanaryConfig:
    return CanaryConfig(base_url="http://127.0.0.1:1", keys=KEYS, **kw)  # type: ignore[arg-type]


def test_plan_has_the_requested_mix() -> None:
    plan = build_plan(_config(num_requests=400, oversized_fraction=0.1, abort_fraction=0.05), max_context=512)
    assert len(plan) == 400
    assert sum(r.is_oversized for r in plan) == 40
    aborts = [r for r in plan if r.abort_after_chunks is not None]
    assert len(aborts) == 20 and all(r.is_stream and not r.is_oversized for r in aborts)
    assert {r.tenant for r in plan} == {f"tenant-{i}" for i in range(8)}
    assert {(r.endpoint, r.is_stream) for r in plan} == {(e, s) for e in Endpoint for s in (True, False)}
    assert len({r.marker.code for r in plan}) == 400


def test_prompts_fit_or_overflow_by_construction() -> None:
    plan = build_plan(_config(num_requests=200, oversized_fraction=0.2, max_tokens=16), max_context=300)
    for r in plan:
        assert r.prompt.startswith(r.marker.text), "the marker opens the prompt (first KV page)"
        if r.is_oversized:
            assert len(r.prompt.split()) > 300  # every word is at least one token
        else:
            assert len(r.prompt) + r.max_tokens <= 300  # never more tokens than characters


def test_plan_is_reproducible_from_the_seed() -> None:
    assert build_plan(_config(seed=5), 512) == build_plan(_config(seed=5), 512)
    assert build_plan(_config(seed=5), 512) != build_plan(_config(seed=6), 512)


def test_refuses_a_context_too_small_for_a_prompt() -> None:
    with pytest.raises(ConfigError, match="context limit 64"):
        build_plan(_config(), max_context=64)
    assert max_prompt_chars() + 32 > 64


@pytest.mark.parametrize(("kw", "message"), [
    ({"keys": ("only-one",)}, "at least 2"),
    ({"keys": ("a", "a")}, "same key twice"),
    ({"num_requests": 0}, "--requests"),
    ({"oversized_fraction": 0.7, "abort_fraction": 0.5}, "must be <= 1"),
    ({"base_url": "127.0.0.1:8000"}, "http://"),
])
def test_bad_configuration_is_refused(kw: dict[str, object], message: str) -> None:
    args = {"base_url": "http://127.0.0.1:1", "keys": KEYS} | kw
    with pytest.raises(ConfigError, match=message):
        CanaryConfig(**args)  # type: ignore[arg-type]


def test_keys_file_must_be_a_list_of_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "keys.json"
    path.write_text('{"k": {"tenant": "a"}}')
    with pytest.raises(ConfigError, match="JSON list"):
        load_keys(str(path))
    path.write_text('["a", "b"]')
    assert load_keys(str(path)) == ("a", "b")
