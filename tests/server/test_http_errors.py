"""Every refusal in OpenAI's error shape, with the right status, code and param."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from processes import wait_for
from server_process import MAX_BODY_BYTES, MAX_MODEL_LEN, ServerProcess, client_for

ALICE = {"Authorization": "Bearer key-alice"}
JSON = {"content-type": "application/json"}


def post(server: ServerProcess, path: str, body: Any = None, *, content: bytes | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, content=content, timeout=60,
                      headers=ALICE if headers is None else headers)


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return dict(body["error"])


def words(n: int) -> str:
    return " ".join(f"w{10 + i % 400}" for i in range(n))


def test_over_long_prompt_is_400_with_the_numbers(server: ServerProcess, alice: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        alice.completions.create(model=server.model_name, prompt=words(MAX_MODEL_LEN + 88), max_tokens=1)
    assert info.value.status_code == 400
    assert info.value.code == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in info.value.message and str(MAX_MODEL_LEN + 88) in info.value.message
    err = error_of(post(server, "/completions", {"prompt": words(500), "max_tokens": 100}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "600" in err["message"] and "500" in err["message"] and "100" in err["message"]


def test_chat_over_long_is_400(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": words(MAX_MODEL_LEN)}]}
    assert error_of(post(server, "/chat/completions", body), 400)["code"] == "context_length_exceeded"


def test_explicit_truncation_is_honoured(server: ServerProcess) -> None:
    body = {"prompt": words(MAX_MODEL_LEN + 50), "max_tokens": 2, "truncate_prompt_tokens": 100}
    response = post(server, "/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 100


@pytest.mark.parametrize("extreme", [{"top_p": 5e-324}, {"temperature": 1e-40}, {"temperature": 1e-40, "top_p": 1e-30}])
def test_underflowing_sampling_values_are_served(server: ServerProcess, extreme: dict[str, Any]) -> None:
    """Found by fuzzing: values that underflow in float32 once made every probability NaN."""
    response = post(server, "/completions", {"prompt": "w5 w6", "max_tokens": 2, **extreme})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "w5", "temperature": 5}, "temperature"),
    ({"prompt": "w5", "temperature": "hot"}, "temperature"),
    ({"prompt": "w5", "top_p": 0}, "top_p"),
    ({"prompt": "w5", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "w5", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"prompt": "w5", "n": 0}, "n"),
    ({"prompt": "w5", "n": 17}, "n"),
    ({"prompt": "w5", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "w5", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "w5", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "w5", "logit_bias": {"w5": 1}}, "logit_bias"),
    ({"prompt": "w5", "logit_bias": {"600": 1}}, "logit_bias"),
    ({"prompt": "w5", "logit_bias": {"\u0663": 1}}, "logit_bias"),  # ARABIC-INDIC DIGIT THREE
    ({"prompt": "w5", "logit_bias": {"\uff13": 1}}, "logit_bias"),  # FULLWIDTH DIGIT THREE
    ({"prompt": "w5", "stop_token_ids": [600]}, "stop_token_ids"),
    ({"prompt": "w5", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "w5", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"prompt": "w5", "seed": -2**63 - 1}, "seed"),
    ({"prompt": "w5", "stop_token_ids": "5"}, "stop_token_ids"),
    ({"prompt": "w5", "echo": "yes"}, "echo"),
    ({"prompt": "w5", "max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt": "w5", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "w5", "stop": [""]}, "stop"),
    ({"prompt": "w5", "logprobs": 21}, "logprobs"),
    ({"prompt": "w5", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ["w5"] * 129}, "prompt"),
    ({"prompt": ["w5", [600]]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [600]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
])
def test_invalid_completion_parameter_is_400_naming_it(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    err = error_of(post(server, "/completions", body), 400)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "w5"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "w5"}], "max_tokens": 3, "max_completion_tokens": 4},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "w5"}], "top_logprobs": 2}, "top_logprobs"),
])
def test_invalid_chat_parameter_is_400_naming_it(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    assert error_of(post(server, "/chat/completions", body), 400)["param"] == param


@pytest.mark.parametrize(("field", "value"), [("tools", []), ("suffix", "x")])
def test_unsupported_field_is_rejected_not_ignored(server: ServerProcess, field: str, value: Any) -> None:
    err = error_of(post(server, "/completions", {"prompt": "w5", field: value}), 400)
    assert err["code"] == "unsupported_parameter" and err["param"] == field
    assert field in err["message"]


def test_completions_max_tokens_left_out_is_16_and_null_is_the_rest(server: ServerProcess) -> None:
    """OpenAI's and vLLM's completions default: 16 tokens when max_tokens is left out (cut to
    the rest of the context near its end), the rest of the context when it is sent as null.
    Chat's left out is the rest, as vLLM's."""
    def completion_tokens(path: str, body: dict[str, Any]) -> int:
        response = post(server, path, body)
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["completion_tokens"])
    def room(prompt: str) -> int:
        return MAX_MODEL_LEN - int(post(server, "/completions", {"prompt": prompt, "max_tokens": 1}
                                        ).json()["usage"]["prompt_tokens"])
    prompt, near_end = words(MAX_MODEL_LEN - 20), words(MAX_MODEL_LEN - 9)
    assert room(prompt) > 16 > room(near_end)
    no_eos = {"ignore_eos": True}  # (a sampled end-of-text token would stop it short of its max_tokens)
    assert completion_tokens("/completions", {"prompt": "w5"} | no_eos) == 16
    assert completion_tokens("/completions", {"prompt": prompt, "max_tokens": None} | no_eos) == room(prompt)
    assert completion_tokens("/completions", {"prompt": near_end} | no_eos) == room(near_end)
    chat = {"messages": [{"role": "user", "content": prompt}]} | no_eos
    assert completion_tokens("/chat/completions", chat) > 16


def test_vllms_truncation_to_the_most_a_prompt_may_have(server: ServerProcess) -> None:
    """truncate_prompt_tokens=-1 keeps the last max-prompt tokens (here the context's 512): a
    short prompt is untouched, one that then fills the context leaves no room to answer."""
    body = {"prompt": words(20), "max_tokens": 2, "truncate_prompt_tokens": -1}
    response = post(server, "/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == post(server, "/completions", body | {
        "truncate_prompt_tokens": None}).json()["usage"]["prompt_tokens"]
    err = error_of(post(server, "/completions", body | {"prompt": words(MAX_MODEL_LEN + 50)}), 400)
    assert err["code"] == "context_length_exceeded" and f"{MAX_MODEL_LEN + 2} tokens" in err["message"], err


def test_vllms_clamped_logit_bias_and_unseeded_seed(server: ServerProcess) -> None:
    """As vLLM's server: a bias past 100 is 100 (not a 400), and seed -1 is no seed."""
    greedy = {"prompt": "w5 w6", "max_tokens": 3, "temperature": 0}
    for bias in (150, 100):
        response = post(server, "/completions", greedy | {"logit_bias": {"7": bias}})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == " w7 w7 w7", (bias, response.text)
    response = post(server, "/completions", greedy | {"logit_bias": {"7": -1e9}})
    assert response.status_code == 200 and "w7" not in response.json()["choices"][0]["text"], response.text
    response = post(server, "/completions", {"prompt": "w5", "max_tokens": 2, "seed": -1, "n": 2})
    assert response.status_code == 200 and len(response.json()["choices"]) == 2, response.text


def test_vllms_fields_that_ask_for_nothing_are_taken_others_refused(server: ServerProcess) -> None:
    """Clients that always send vLLM's defaults are served; any other value is a 400 naming the
    field (what it asks for is not implemented), never ignored."""
    nothing = {"use_beam_search": False, "priority": 0, "spaces_between_special_tokens": True,
               "return_tokens_as_token_ids": False, "return_token_ids": False, "bad_words": [], "length_penalty": 0.7}
    response = post(server, "/completions", {"prompt": "w5", "max_tokens": 2} | nothing)
    assert response.status_code == 200, response.text
    chat = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
    assert post(server, "/chat/completions", chat | nothing).status_code == 200
    for field, value in (("use_beam_search", True), ("priority", 1), ("spaces_between_special_tokens", False),
                         ("return_tokens_as_token_ids", True), ("return_token_ids", True), ("bad_words", ["w5"])):
        for path, body in (("/completions", {"prompt": "w5", "max_tokens": 2}), ("/chat/completions", chat)):
            err = error_of(post(server, path, body | {field: value}), 400)
            assert err["param"] == field and "not" in err["message"], (field, err)


def test_best_of_equal_to_n_is_taken_and_other_values_refused(server: ServerProcess) -> None:
    """vLLM takes best_of equal to n (1 without n) as asking for nothing more; kvseal does not
    rank extra candidates, so any other best_of is a 400 naming it, not ignored."""
    for fields, num_choices in (({"best_of": 1}, 1), ({"best_of": 2, "n": 2}, 2)):
        response = post(server, "/completions", {"prompt": "w5", "max_tokens": 2} | fields)
        assert response.status_code == 200 and len(response.json()["choices"]) == num_choices, response.text
    for fields in ({"best_of": 2}, {"best_of": 1, "n": 2}, {"best_of": 3, "n": 2}):
        err = error_of(post(server, "/completions", {"prompt": "w5", "max_tokens": 2} | fields), 400)
        assert err["param"] == "best_of" and "not implemented" in err["message"], err


def test_store_false_and_metadata_are_taken_store_true_refused(server: ServerProcess) -> None:
    """OpenAI's stored completions: vLLM takes store and metadata and ignores them; kvseal takes
    store=false and metadata (nothing is stored either way) and refuses store=true, which it
    could not honour."""
    chat = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
    response = post(server, "/chat/completions", chat | {"store": False, "metadata": {"team": "search"}})
    assert response.status_code == 200, response.text
    err = error_of(post(server, "/chat/completions", chat | {"store": True}), 400)
    assert err["param"] == "store" and "stores no completions" in err["message"]
    err = error_of(post(server, "/chat/completions", chat | {"metadata": {f"k{i}": "v" for i in range(17)}}), 400)
    assert err["param"] == "metadata"


def test_a_field_sent_as_null_is_not_sent(server: ServerProcess, alice: openai.OpenAI) -> None:
    """As OpenAI's API and vLLM take it: wrappers forward None for what they leave unset (an
    unsupported field sent as null asks for nothing)."""
    nulls = {"stream": None, "echo": None, "logprobs": None, "suffix": None, "best_of": None, "ignore_eos": None,
             "min_tokens": None, "temperature": None, "stop": None, "n": None}
    response = post(server, "/completions", {"prompt": "w5", "max_tokens": 2} | nulls)
    assert response.status_code == 200 and len(response.json()["choices"]) == 1, response.text
    chat = alice.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "w5"}],
                                         max_tokens=2, logprobs=None, stream=None,
                                         extra_body={"store": None, "skip_special_tokens": None})
    assert chat.choices[0].logprobs is None


@pytest.mark.parametrize("content", [b'{"prompt": ', b"[1, 2]", b"null", b"\xff\xfe", b"", b'{"prompt": NaN}'])
def test_malformed_json_is_400(server: ServerProcess, content: bytes) -> None:
    err = error_of(post(server, "/completions", content=content, headers=ALICE | {"content-type": "application/json"}),
                   400)
    assert err["code"] in ("invalid_json", "invalid_parameter")


@pytest.mark.parametrize("content", [b"[" * 100_000 + b"]" * 100_000,
                                     b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"], ids=["array", "prompt"])
def test_deeply_nested_body_is_invalid_json_on_every_route(server: ServerProcess, content: bytes) -> None:
    """/tokenize once sniffed the body with stdlib json first: a RecursionError, a 500."""
    for path in ("/v1/completions", "/tokenize"):
        response = httpx.post(f"{server.url}{path}", content=content, headers=ALICE | JSON, timeout=60)
        assert error_of(response, 400)["code"] == "invalid_json", path


def test_unknown_model_is_404(server: ServerProcess, alice: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        alice.completions.create(model="gpt-17", prompt="w5")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        alice.models.retrieve("gpt-17")


def test_body_over_the_limit_is_413(server: ServerProcess) -> None:
    big = b'{"prompt": "' + b"w5 " * (MAX_BODY_BYTES // 3 + 10) + b'"}'
    assert error_of(post(server, "/completions", content=big, headers=ALICE | JSON), 413)["code"] == "request_too_large"

    def chunked() -> Any:  # no content-length: the limit holds while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 30_000 + 2):
            yield b"w5 " * 10_000
        yield b'"}'

    err = error_of(post(server, "/completions", content=chunked(), headers=ALICE | JSON), 413)
    assert err["code"] == "request_too_large"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "key-alice"},
                                     {"Authorization": "Basic a2V5LWFsaWNl"}])
def test_missing_or_unknown_key_is_401(server: ServerProcess, headers: dict[str, str]) -> None:
    err = error_of(post(server, "/completions", {"prompt": "w5"}, headers=headers), 401)
    assert err["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/models", headers=headers).status_code == 401


def test_unauthenticated_malformed_request_is_401_not_400(server: ServerProcess) -> None:
    assert post(server, "/completions", content=b"{", headers={}).status_code == 401


def test_openai_client_sees_authentication_error(server: ServerProcess) -> None:
    with pytest.raises(openai.AuthenticationError):
        client_for(server, "wrong").completions.create(model=server.model_name, prompt="w5")


def test_tenant_max_tokens_cap(server: ServerProcess) -> None:
    capped = {"Authorization": "Bearer key-capped"}
    err = error_of(post(server, "/completions", {"prompt": "w5", "max_tokens": 33}, headers=capped), 400)
    assert err["param"] == "max_tokens" and "32" in err["message"]
    asked = {"messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 33}
    err = error_of(post(server, "/chat/completions", asked, headers=capped), 400)
    assert err["param"] == "max_completion_tokens" and err["message"].startswith("max_completion_tokens=33 ")
    chat = post(server, "/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "ignore_eos": True},
                headers=capped)
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 32


def test_tenant_concurrency_over_limit_is_429(server: ServerProcess) -> None:
    limited = {"Authorization": "Bearer key-limited"}
    body = {"prompt": "w5", "max_tokens": MAX_MODEL_LEN - 1, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, headers=limited, timeout=60) as first:
        lines = first.iter_lines()  # keep it: dropping the iterator closes the stream
        next(lines)  # the first request is now in flight
        err = error_of(post(server, "/completions", {"prompt": "w5"}, headers=limited), 429)
        assert err["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            client_for(server, "key-limited").completions.create(model=server.model_name, prompt="w5")
        assert post(server, "/completions", {"prompt": "w5", "max_tokens": 2}).status_code == 200  # other tenant
    wait_for(lambda: post(server, "/completions", {"prompt": "w5", "max_tokens": 2}, headers=limited).status_code
             == 200, "the limited tenant's slot to come back")


def test_unknown_route_and_method(server: ServerProcess) -> None:
    assert error_of(httpx.get(f"{server.url}/v1/nothing"), 404)["code"] == "not_found"
    assert error_of(httpx.get(f"{server.base_url}/completions"), 405)["code"] == "method_not_allowed"


def test_a_trailing_slash_is_a_404_not_a_redirect(server: ServerProcess) -> None:
    """No 307 to a URL built from the client's Host header."""
    for path in ("/v1/completions/", "/v1/chat/completions/", "/tokenize/"):
        response = httpx.post(f"{server.url}{path}", json={"prompt": "w5"}, headers=ALICE | {"Host": "evil.example"},
                              timeout=10)
        assert "location" not in response.headers, path
        err = error_of(response, 404)
        assert err["code"] == "not_found", path
    # /v1/models/{model} with no model: the path with a slash, not a model named ''
    err = error_of(httpx.get(f"{server.url}/v1/models/", headers=ALICE, timeout=10), 404)
    assert err["code"] == "not_found" and "GET /v1/models/{model}" in err["message"]


def test_the_404_lists_every_served_route(server: ServerProcess) -> None:
    message = error_of(httpx.get(f"{server.url}/v1/nothing"), 404)["message"]
    for route in ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /v1/models/{model}",
                  "POST /tokenize", "POST /detokenize", "GET /health", "GET /metrics", "GET /openapi.json",
                  "POST /admin/keys/reload", "POST /admin/models/{model}/disable",
                  "POST /admin/models/{model}/enable"):
        assert route in message, route


@pytest.mark.parametrize("fields", [{"guided_regex": "(w8 )+w9"},  # the vocabulary has no token for the space
                                    {"guided_choice": ["w9"], "allowed_token_ids": [5]}])
def test_constraints_that_leave_no_token_are_a_400_audited_by_their_code(server: ServerProcess,
                                                                         fields: dict[str, Any]) -> None:
    """A grammar the vocabulary cannot continue, or one sharing no token with allowed_token_ids:
    a 400 naming the field it can (none for a grammar alone), and one audit line with the code
    as its reason, so `kvseal audit --reason no_token_satisfies_constraints` finds every such
    request (a PD prefill's refusal of the first token is audited with the same code)."""
    response = post(server, "/completions", {"prompt": "w4", "max_tokens": 8, "temperature": 0} | fields)
    err = error_of(response, 400)
    assert err["code"] == "no_token_satisfies_constraints"
    assert err["param"] == ("allowed_token_ids" if "allowed_token_ids" in fields else None), err
    record = server.audit_for(response.headers["x-request-id"])
    assert (record["outcome"], record["reason"], record["http_status"]) == (
        "aborted", "no_token_satisfies_constraints", 400), record
