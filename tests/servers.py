"""Server helpers for tests: the package's ServerProcess, plus requests against an OpenAI-compatible
SGLang server that return generated token ids."""

from __future__ import annotations

from mfd_sglang.server_process import (  # noqa: F401 (re-exported)
    ServerProcess, free_port, generate_ids, log_tail, post_json,
)


# --- requests against an OpenAI-compatible SGLang server, returning generated token ids ---------
def completion_ids(server: ServerProcess, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy /v1/completions on a token-id prompt; checks the usage count too."""
    out = post_json(server, "/v1/completions", {
        "model": "default", "prompt": input_ids, "max_tokens": max_new_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    })
    assert out["usage"]["completion_tokens"] == max_new_tokens, out
    return out["choices"][0].get("token_ids")


def chat_ids(server: ServerProcess, messages: list[dict], max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids after the server's chat template, response ids) of a greedy /v1/chat/completions."""
    out = post_json(server, "/v1/chat/completions", {
        "model": "default", "messages": messages, "max_tokens": max_new_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, "return_prompt_token_ids": True,
    })
    choice = out["choices"][0]
    # 0.5.23 puts the ids of a chat choice in prompt_token_ids / response_token_ids
    return choice.get("prompt_token_ids"), choice.get("response_token_ids", choice.get("token_ids"))


def chat_template_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]
