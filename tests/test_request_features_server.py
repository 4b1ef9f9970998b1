"""Penalties, min_new_tokens, logit_bias, logprobs, stops and grammars through real SGLang servers on CPU (fp32, the
make-tiny pair), held to the plain server (same target, no speculation, no overlap scheduling: see
`plain_server`):

- greedy output with a frequency / presence / repetition penalty, min_new_tokens or a logit_bias equals
  the plain server's token for token, alone and in one batch with other requests (MFD_D, B = 16: alone
  its K-mode path, batched its single-mode path); each case changes the plain output, so the feature is
  really applied;
- the output logprobs, top logprobs and requested-id logprobs of greedy requests equal the plain
  server's (float tolerance), on /generate (with input logprobs) and /v1/completions streamed; at T = 1
  they equal the plain server's scoring of the same tokens (its input logprobs of prompt + output);
- stop tokens and stop strings met inside an accepted path, and n = 2, end as on the plain server;
- constrained decoding (regex, EBNF) gives the plain server's output and finish reason, also where the
  grammar ends the output, with a penalty or a logit bias on top and beside unconstrained requests.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re

import pytest
import requests

from conftest import target_greedy
from servers import (admitted_together, assert_healthy_without_leaks, generate_ids, plugin_env, post_json,
                     served_without_leaks, start_server)

MAX_NEW = 24
# (name, sampling params): each changes this prompt's plain greedy output (checked).
FEATURES = [
    ("frequency_penalty", {"frequency_penalty": 2.0}),
    ("presence_penalty", {"presence_penalty": 2.0}),
    ("repetition_penalty", {"repetition_penalty": 2.0}),
    ("frequency+presence", {"frequency_penalty": 1.0, "presence_penalty": 1.5}),
    ("min_new_tokens", {"min_new_tokens": 12}),
    ("logit_bias", {"logit_bias": {"8": 3.0, "65": -5.0}}),
]


@pytest.fixture(scope="module")
def mfd_server(tiny_pair, tmp_path_factory):
    # MFD_D at its default switch threshold (3): a request alone drafts with all K modes, the batched
    # cases (4 to 7 requests in flight) with the single-mode path, so both drafting paths are covered.
    # Its batched cases are admitted together (`servers.admitted_together`): one batch on any machine.
    srv = start_server(tmp_path_factory, tiny_pair, tiny_pair / "drafter", "MFD_D", 16, max_running=8,
                       extra_env=plugin_env("hold_admission"))
    yield from served_without_leaks(srv)


@pytest.fixture(scope="module")
def prompt_ids(tiny_pair) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_pair / "target"))
    # "monday tuesday": its greedy output cycles through seven tokens, so penalties bite.
    prompt = json.loads((tiny_pair / "prompts.json").read_text())[2]
    return tokenizer(prompt)["input_ids"]


_PLAIN_ANSWERS: dict[tuple, list[tuple]] = {}


def plain_finished(plain_server, payload: dict) -> list[tuple]:
    """`finished` on the plain server, memoised: several tests hold MFD to the same plain answers."""
    key = (plain_server.port, json.dumps(payload, sort_keys=True))
    if key not in _PLAIN_ANSWERS:
        _PLAIN_ANSWERS[key] = finished(plain_server, payload)
    return _PLAIN_ANSWERS[key]


def plain_greedy(plain_server, ids: list[int], **params) -> list[int]:
    """The plain server's greedy output ids for `params` (memoised)."""
    sampling = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True, **params}
    return plain_finished(plain_server, {"input_ids": ids, "sampling_params": sampling})[0][0]


def many(server, ids: list[int], cases: list[dict], *, together: bool = False) -> list[list[int]]:
    """Greedy outputs of one request per sampling-params dict, all in flight together (`together`: admitted
    together, on a server with the `hold_admission` plugin)."""
    with (admitted_together(server, len(cases)) if together else contextlib.nullcontext()), \
            concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(lambda params: generate_ids(server, ids, MAX_NEW, **params)[0], cases))


def test_penalties_and_bias_equal_the_plain_server(plain_server, mfd_server, prompt_ids):
    unpenalised = plain_greedy(plain_server, prompt_ids)
    # min_new_tokens: stop at the plain output's 4th token unless 12 tokens are out.
    stop = {"stop_token_ids": [unpenalised[3]], "ignore_eos": False}
    cases = [{**params, **(stop if name == "min_new_tokens" else {})} for name, params in FEATURES]
    for (name, _), params in zip(FEATURES, cases):
        plain = plain_greedy(plain_server, prompt_ids, **params)
        without = plain_greedy(plain_server, prompt_ids, **{k: v for k, v in params.items()
                                                            if k in ("stop_token_ids", "ignore_eos")})
        assert plain != without, f"{name} does not change this prompt's output: the case proves nothing"
        assert generate_ids(mfd_server, prompt_ids, MAX_NEW, **params)[0] == plain, name
    # All in one batch, with an unpenalised request beside them.
    plain_all = many(plain_server, prompt_ids, cases + [{}])
    assert many(mfd_server, prompt_ids, cases + [{}], together=True) == plain_all


def test_penalties_survive_retraction(tiny_pair, tmp_path_factory, hf_target, tiny_prompts):
    """A request that SGLang retracts (KV pool full; forced every third forward with SGLANG_TEST_RETRACT)
    and prefills again keeps its penalty counts: penalised greedy output equals the target's, while
    SGLang 0.5.23's plain server forgets the counts there (its penalizers restart at zero).

    Certain on any machine: the server admits none of the three requests until all have arrived
    (`hold_admission`), so they prefill in one batch and decode together; each needs at least three rounds
    (23 tokens after the prefill's, at most 9 a round at budget 8), and of three consecutive forwards one is
    a retraction forward."""
    model, tokenizer = hf_target
    prompts = [tokenizer(text)["input_ids"] for text in tiny_prompts[:3]]
    srv = start_server(tmp_path_factory, tiny_pair, tiny_pair / "drafter", "MFD_D", 8, max_running=8,
                       log_level="info", extra_env={"SGLANG_TEST_RETRACT": "1", **plugin_env("hold_admission")})
    try:
        with admitted_together(srv, len(prompts)), concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(lambda ids: generate_ids(srv, ids, 24, frequency_penalty=1.5)[0], prompts))
        retracted = sum(map(int, re.findall(r"Testing retraction\. #retracted_reqs: (\d+)", srv.log())))
        assert retracted > 0, "no request was retracted: the case proves nothing"
        assert_healthy_without_leaks(srv)  # retraction frees KV and takes it again: nothing may leak
    finally:
        srv.stop()
    assert outputs == [target_greedy(model, ids, 24, frequency_penalty=1.5) for ids in prompts]


def logprob_request(server, ids: list[int], **extra) -> dict:
    return post_json(server, "/generate", {
        "input_ids": ids, "return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": [1, 5, 9],
        "logprob_start_len": 0,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True, **extra}})["meta_info"]


def assert_logprob_lists_close(ours, theirs, what: str) -> None:
    """Lists of (logprob, token id, ...) tuples, or lists of such lists (top / requested ids)."""
    assert len(ours) == len(theirs), what
    for a, b in zip(ours, theirs):
        if a is None or b is None:
            assert a == b, what
        elif isinstance(a[0], (list, tuple)):
            assert_logprob_lists_close(a, b, what)
        else:
            assert a[1] == b[1], f"{what}: token {a} vs {b}"
            assert a[0] == pytest.approx(b[0], abs=2e-4), f"{what}: {a} vs {b}"


def test_greedy_logprobs_equal_the_plain_server(plain_server, mfd_server, prompt_ids):
    for extra in ({}, {"frequency_penalty": 0.7}):
        plain, ours = logprob_request(plain_server, prompt_ids, **extra), logprob_request(mfd_server, prompt_ids, **extra)
        for field in ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs",
                      "output_token_ids_logprobs"):
            assert_logprob_lists_close(ours[field], plain[field], f"{field} {extra}")
        assert len(ours["output_token_logprobs"]) == MAX_NEW


def test_sampled_logprobs_are_the_targets_for_the_tokens_emitted(plain_server, mfd_server, prompt_ids):
    """T = 1: the plain server scores MFD's output tokens as input; MFD's output logprobs are those."""
    meta = post_json(mfd_server, "/generate", {
        "input_ids": prompt_ids, "return_logprob": True,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": MAX_NEW, "ignore_eos": True,
                            "sampling_seed": 7}})["meta_info"]
    output = [token for _, token, _ in meta["output_token_logprobs"]]
    scored = post_json(plain_server, "/generate", {
        "input_ids": prompt_ids + output, "return_logprob": True, "logprob_start_len": len(prompt_ids) - 1,
        "sampling_params": {"temperature": 0, "max_new_tokens": 1}})["meta_info"]["input_token_logprobs"]
    # input_token_logprobs[k] is the logprob of input token len(prompt) - 1 + k given what precedes it.
    assert_logprob_lists_close(meta["output_token_logprobs"], scored[1:], "T = 1 output logprobs")


def sampling_masks(meta: dict) -> list[dict[int, float]]:
    """One {token id: log-probability} per output token of a "support"-mode request: its sampling support."""
    return [dict(zip(mask, lp)) for mask, lp in zip(meta["output_token_sampling_mask"],
                                                     meta["output_token_sampling_logprobs"])]


def test_sampling_masks_are_the_plain_servers_at_every_token(plain_server, mfd_server, prompt_ids):
    """return_sampling_mask, T = 1 with top-k and top-p (support and selected modes) beside a greedy request:
    each output token's support and log-probabilities are the plain server's for the same prefix (the plain
    server draws one token after prompt + MFD's output so far, with the same settings)."""
    sampled = {"temperature": 1.0, "top_k": 12, "top_p": 0.9, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    greedy = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    with admitted_together(mfd_server, 3):  # one batch (SGLang sends a batch's requests one by one)
        outs = post_json(mfd_server, "/generate", {
            "input_ids": [prompt_ids] * 3, "sampling_params": [sampled, sampled, greedy],
            "return_sampling_mask": True, "sampling_logprobs_mode": ["support", "selected", "support"]})
    support_out, selected_out, greedy_out = outs
    ids, masks = support_out["output_ids"], sampling_masks(support_out["meta_info"])
    assert len(ids) == len(masks) == MAX_NEW
    assert any(len(mask) > 1 for mask in masks), "every support is a single token: the case proves nothing"
    plain = post_json(plain_server, "/generate", {
        "input_ids": [prompt_ids + ids[:i] for i in range(MAX_NEW)],
        "sampling_params": [{**sampled, "max_new_tokens": 1}] * MAX_NEW,
        "return_sampling_mask": True, "sampling_logprobs_mode": "support"})
    for i, (token, mask, reference) in enumerate(zip(ids, masks, plain)):
        expected = sampling_masks(reference["meta_info"])[0]
        assert token in mask and set(mask) == set(expected), f"token {i}"
        assert [mask[t] for t in expected] == pytest.approx(list(expected.values()), abs=2e-4), f"token {i}"
    # selected mode: the drawn token's log-probability under its (renormalised) support, one float per token.
    sel_ids, sel_masks = selected_out["output_ids"], selected_out["meta_info"]["output_token_sampling_logprobs"]
    sel_support = selected_out["meta_info"]["output_token_sampling_mask"]
    assert len(sel_ids) == len(sel_masks) == MAX_NEW and all(t in s for t, s in zip(sel_ids, sel_support))
    plain = post_json(plain_server, "/generate", {
        "input_ids": [prompt_ids + sel_ids[:i] for i in range(MAX_NEW)],
        "sampling_params": [{**sampled, "max_new_tokens": 1}] * MAX_NEW,
        "return_sampling_mask": True, "sampling_logprobs_mode": "support"})
    for i, (token, lp, reference) in enumerate(zip(sel_ids, sel_masks, plain)):
        assert lp == pytest.approx(sampling_masks(reference["meta_info"])[0][token], abs=2e-4), f"token {i}"
    # greedy: the token alone, log-probability 0, and the plain server's greedy output.
    assert greedy_out["output_ids"] == plain_greedy(plain_server, prompt_ids)
    assert sampling_masks(greedy_out["meta_info"]) == [{t: 0.0} for t in greedy_out["output_ids"]]


def test_streamed_completion_logprobs_equal_the_plain_server(plain_server, mfd_server, prompt_ids):
    def streamed(server) -> list[tuple]:
        r = requests.post(server.base_url + "/v1/completions", json={
            "model": "default", "prompt": prompt_ids, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "stream": True}, stream=True, timeout=300)
        assert r.status_code == 200, r.text
        rows = []
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("logprobs"):
                lp = choice["logprobs"]
                rows += list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
        return rows

    plain, ours = streamed(plain_server), streamed(mfd_server)
    assert len(ours) == len(plain) == MAX_NEW
    for (tok_a, lp_a, top_a), (tok_b, lp_b, top_b) in zip(ours, plain):
        assert tok_a == tok_b
        assert lp_a == pytest.approx(lp_b, abs=2e-4)
        assert sorted(top_a) == sorted(top_b)
        assert [top_a[k] for k in sorted(top_a)] == pytest.approx([top_b[k] for k in sorted(top_b)], abs=2e-4)


def finished(server, payload: dict) -> list[tuple]:
    """(output ids, finish reason) of each choice of a /generate request (n > 1 gives a list)."""
    out = post_json(server, "/generate", payload)
    outs = out if isinstance(out, list) else [out]
    return [(o.get("output_ids") or o["meta_info"]["output_ids"], json.dumps(o["meta_info"]["finish_reason"]))
            for o in outs]


def test_stops_and_n_equal_the_plain_server(plain_server, mfd_server, prompt_ids, tiny_pair):
    """A stop token and a stop string met inside an accepted path, and n = 2, end as on the plain server."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_pair / "target"))
    reference = plain_greedy(plain_server, prompt_ids)
    text = tokenizer.decode(prompt_ids)
    stop_word = tokenizer.decode([reference[9]]).strip()
    base = {"temperature": 0, "max_new_tokens": MAX_NEW}
    payloads = [
        {"input_ids": prompt_ids, "sampling_params": {**base, "stop_token_ids": [reference[6]]}},
        {"text": text, "sampling_params": {**base, "stop": [stop_word]}},
        {"text": text, "sampling_params": {**base, "stop": [stop_word], "no_stop_trim": True}},
        {"input_ids": prompt_ids, "sampling_params": {**base, "n": 2, "frequency_penalty": 1.0}},
    ]
    for payload in payloads:
        plain, ours = plain_finished(plain_server, payload), finished(mfd_server, payload)
        assert ours == plain, payload
        assert all(len(ids) < MAX_NEW for ids, _ in plain[:1]) or "n" in payload["sampling_params"], plain


# Constrained decoding over the tiny pair's word-level vocabulary (xgrammar matches the concatenated token
# strings, no spaces): (kind, grammar, a second adjustment for the batched run). Each grammar changes this
# prompt's greedy output; the bounded ones end it (finish reason stop). The adjustments are ones the plain
# server serves with that grammar: with some others it fails itself on this vocabulary (HTTP 500, "Grammar
# accept_token failed" at token 0), and MFD fails in the same way there.
GRAMMARS = [
    ("regex", "(friday|saturday|sunday|one|two)+", {"frequency_penalty": 0.3}),
    ("regex", "(monday|friday|two){5}", {"frequency_penalty": 1.0}),  # terminates after five tokens
    ("ebnf", 'root ::= "thursday" ("sunday" | "april")* "."', {"presence_penalty": 1.0}),
    ("ebnf", 'root ::= ("friday" | "saturday" | "one" | "two")+', {"logit_bias": {"60": -3.0}}),
]


@pytest.mark.parametrize("kind, grammar, adjustment", GRAMMARS,
                         ids=[f"{k}{i}" for i, (k, _, _) in enumerate(GRAMMARS)])
def test_constrained_decoding_equals_the_plain_server(plain_server, mfd_server, prompt_ids, kind, grammar, adjustment):
    greedy = {"temperature": 0, "max_new_tokens": MAX_NEW}
    unconstrained = plain_finished(plain_server, {"input_ids": prompt_ids, "sampling_params": greedy})
    payload = {"input_ids": prompt_ids, "sampling_params": {**greedy, kind: grammar}}
    plain = plain_finished(plain_server, payload)
    assert plain != unconstrained, "the grammar does not change this prompt's output: the case proves nothing"
    assert finished(mfd_server, payload) == plain
    # With a penalty or bias too, beside an unconstrained request in one batch.
    adjusted = {**payload, "sampling_params": {**payload["sampling_params"], **adjustment}}
    with admitted_together(mfd_server, 2), concurrent.futures.ThreadPoolExecutor(2) as pool:
        ours = list(pool.map(lambda p: finished(mfd_server, p),
                             [adjusted, {"input_ids": prompt_ids, "sampling_params": greedy}]))
    assert ours == [plain_finished(plain_server, adjusted), unconstrained]
