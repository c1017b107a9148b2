"""`kvseal bench serve` takes vLLM's bench forms: the server's root URL with --endpoint, and vLLM's flag names."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from kvseal.bench.cli import config_from
from kvseal.bench.client import Endpoint
from kvseal.bench.runner import LoadShape, send_times
from kvseal.cli import build_parser, main
from kvseal.errors import KvsealError


def test_root_and_v1_base_urls_reach_the_same_completions_url() -> None:
    assert Endpoint("http://h:8000", "m").completions_url == "http://h:8000/v1/completions"
    assert Endpoint("http://h:8000/", "m").completions_url == "http://h:8000/v1/completions"
    assert Endpoint("http://h:8000/v1", "m").completions_url == "http://h:8000/v1/completions"
    assert Endpoint("http://h:8000", "m", endpoint="/x/completions").completions_url == "http://h:8000/x/completions"


def test_vllm_flag_names_are_accepted_beside_kvseals() -> None:
    parser = build_parser()
    vllm = config_from(parser.parse_args(["bench", "serve", "--base-url", "http://h:8000", "--model", "m",
                                          "--endpoint", "/v1/completions", "--max-concurrency", "4",
                                          "--random-input-len", "32", "--random-output-len", "8"]))
    ours = config_from(parser.parse_args(["bench", "serve", "--base-url", "http://h:8000/v1", "--model", "m",
                                          "--concurrency", "4", "--input-len", "32", "--output-len", "8"]))
    assert vllm.endpoint.completions_url == ours.endpoint.completions_url
    assert (vllm.shape, vllm.input_len, vllm.output_len) == (ours.shape, ours.input_len, ours.output_len)


def test_a_result_json_that_is_a_folder_is_refused_before_any_request(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m",
            "--tokenizer", str(tmp_path / "not-read"), "--result-json", str(tmp_path)]
    assert main(argv) == 2
    assert f"--result-json {tmp_path} is a folder" in capsys.readouterr().err


def test_a_tokenizer_folder_without_a_tokenizer_is_refused(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", str(tmp_path)]
    assert main(argv) == 2
    assert f"cannot load a tokenizer from {tmp_path}" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["[]", "[{\"max_concurrency\": 1}]", "3"])
def test_plot_refuses_a_json_that_is_not_a_result_naming_the_file(tmp_path: Path, text: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    result = tmp_path / "list.json"
    result.write_text(text)
    assert main(["bench", "plot", str(result), "-o", str(tmp_path / "p.png")]) == 2
    assert f"{result} is not a benchmark result" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--num-prompts", "-3", "--num-prompts must be >= 1 (got -3)"),
    ("--num-prompts", "0", "--num-prompts must be >= 1 (got 0)"),
    ("--request-timeout", "0", "--request-timeout must be > 0 seconds (got 0.0)"),
    ("--request-timeout", "nan", "--request-timeout must be > 0 seconds (got nan)"),
])
def test_bench_serve_refuses_nothing_to_send_or_no_time_to_wait(flag: str, value: str, expected: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", "no-such-folder"]
    assert main([*argv, flag, value]) == 2
    assert expected in capsys.readouterr().err


def test_request_rate_takes_vllms_burstiness_and_a_concurrency_limit_beside_it() -> None:
    parser = build_parser()
    both = config_from(parser.parse_args(["bench", "serve", "--base-url", "http://h:8000", "--model", "m",
                                          "--request-rate", "4", "--max-concurrency", "2", "--burstiness", "0.5"]))
    assert both.shape == LoadShape(concurrency=2, request_rate=4.0, burstiness=0.5)
    rate_only = config_from(parser.parse_args(["bench", "serve", "--base-url", "http://h:8000", "--model", "m",
                                               "--request-rate", "4"]))
    assert rate_only.shape == LoadShape(concurrency=None, request_rate=4.0, burstiness=1.0)
    with pytest.raises(KvsealError, match="burstiness must be > 0"):
        LoadShape(request_rate=4.0, burstiness=0)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 3.0])
def test_the_send_schedule_is_vllms_the_last_send_at_n_over_the_rate(burstiness: float) -> None:
    """vLLM's client: every request, the first too, waits a gamma gap (shape = burstiness, mean
    1/rate); the times are scaled so the last send is at n/rate, whatever the seed."""
    shape = LoadShape(concurrency=None, request_rate=40.0, burstiness=burstiness)
    for seed in range(6):
        times = send_times(24, shape, random.Random(seed))
        assert times[-1] == pytest.approx(24 / 40.0)
        assert 0 < times[0] and all(a <= b for a, b in zip(times, times[1:]))
    assert send_times(24, shape, random.Random(3)) == send_times(24, shape, random.Random(3))
    assert send_times(24, shape, random.Random(3)) != send_times(24, shape, random.Random(4))


def test_infinite_burstiness_spaces_sends_evenly_and_an_infinite_rate_sends_at_once() -> None:
    even = send_times(4, LoadShape(request_rate=8.0, burstiness=math.inf), random.Random(0))
    assert even == pytest.approx([0.125, 0.25, 0.375, 0.5])
    assert send_times(5, LoadShape(request_rate=math.inf), random.Random(0)) == [0.0] * 5
