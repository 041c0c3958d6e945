"""The gateway's token count of a generation from its responses' parameters (the llm backend's contract)."""

from __future__ import annotations

from aiworks.gateway.token_budget import TokenCount


def test_a_stream_cut_short_counts_one_token_a_response_or_the_joined_steps():
    count = TokenCount()
    count.see({"prompt_tokens": 12}, True)
    count.see({}, True)
    count.see({"tokens": 5}, True)  # five steps joined in one response
    count.see({}, False)  # no text: no token
    assert (count.prompt, count.completion) == (12, 7)


def test_the_last_response_counts_are_the_models():
    count = TokenCount()
    count.see({"prompt_tokens": 3, "tokens": 4}, True)
    count.see({"tokens": 9, "completion_tokens": 11, "finish_reason": "stop"}, True)
    assert (count.prompt, count.completion) == (3, 11)
