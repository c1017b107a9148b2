"""What a request has produced so far: text, logprobs, finish reason and token counts."""

from __future__ import annotations

from typing import Any

from kvseal.messages.msgs import RequestOutputMsg, TokenLogprobsMsg


class Transcript:
    def __init__(self) -> None:
        self._text_parts: list[str] = []
        self.token_ids: list[int] = []  # the output's
        self.logprobs: list[TokenLogprobsMsg] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # vLLM's: the stop string or token id that ended it
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[TokenLogprobsMsg | None] | None = None  # sent with the first token

    def add(self, out: RequestOutputMsg) -> None:
        self._text_parts.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.logprobs or ())
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = api_stop_reason(out)

    @property
    def text(self) -> str:
        return "".join(self._text_parts)



def usage(transcripts: list[Transcript], choices_per_prompt: int | None = None) -> dict[str, Any]:
    """OpenAI's usage for n choices of each prompt (`choices_per_prompt`; None: every choice is of
    one prompt): each prompt counted once, completion tokens summed;
    `prompt_tokens_details.cached_tokens`: prompt tokens each prompt's first choice found in the
    prefix cache."""
    firsts = transcripts[::choices_per_prompt or len(transcripts)]
    num_prompt = sum(t.num_prompt_tokens for t in firsts)
    num_output = sum(t.num_output_tokens for t in transcripts)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": sum(t.num_cached_tokens for t in firsts)}}


def api_stop_reason(out: RequestOutputMsg) -> str | int | None:
    """vLLM's `stop_reason`: the stop string or stop token id that ended the choice; None for
    anything else (not ended yet, the end-of-sequence token, the length, an abort)."""
    return out.stop_reason if out.finished and out.finish_reason == "stop" else None
