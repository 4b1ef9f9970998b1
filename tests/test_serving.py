"""The SGLang integration's pieces that need no server: options, launch-time checks, per-request
checks and the drafter context pool (held to the drafter's own context K/V)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from mfd_sglang.checkpoint import load_drafter
from mfd_sglang.drafter import MFDDrafter
from mfd_sglang.serving.draft_context_pool import DraftContextPool
from mfd_sglang.serving.options import budget_from_num_draft_tokens, default_num_draft_tokens, read_options
from mfd_sglang.patches.request_checks import unsupported_request_features


def test_options_defaults_and_errors():
    assert read_options({}).switch_threshold == 3 and read_options({}).num_modes is None
    opts = read_options({"MFD_SGLANG_SWITCH_THRESHOLD": "5", "MFD_SGLANG_NUM_MODES": "2"})
    assert (opts.switch_threshold, opts.num_modes) == (5, 2)
    with pytest.raises(ValueError, match="MFD_SGLANG_SWITCH_THRESHOLD='zero' is not a positive integer"):
        read_options({"MFD_SGLANG_SWITCH_THRESHOLD": "zero"})
    with pytest.raises(ValueError, match="MFD_SGLANG_NUM_MODES='0'"):
        read_options({"MFD_SGLANG_NUM_MODES": "0"})
    assert budget_from_num_draft_tokens(65) == 64
    with pytest.raises(ValueError, match="tree budget of 0 nodes"):
        budget_from_num_draft_tokens(1)
    assert default_num_draft_tokens("cuda") == 65 and default_num_draft_tokens("cpu") == 17


def _server_args(tiny_pair, **changes):
    args = dict(speculative_algorithm="MFD", model_path=str(tiny_pair / "target"),
                speculative_draft_model_path=str(tiny_pair / "drafter"), speculative_num_draft_tokens=9,
                page_size=1, pp_size=1, tp_size=1, dp_size=1, enable_dp_attention=False,
                disaggregation_mode="null", enable_hierarchical_cache=False,
                speculative_draft_window_size=None, speculative_adaptive=False)
    args.update(changes)
    return SimpleNamespace(**args)


@pytest.mark.parametrize("changes, message", [
    ({}, None),
    ({"tp_size": 2}, "--tp-size 2: tensor parallelism is not supported"),
    ({"pp_size": 2}, "--pp-size 2: pipeline parallelism"),
    ({"enable_dp_attention": True}, "--enable-dp-attention is not supported"),
    ({"page_size": 16}, "--page-size 16: MFD needs page size 1"),
    ({"speculative_num_draft_tokens": 2000}, "tree budget of 1999 nodes"),
    ({"speculative_draft_model_path": None}, "needs --speculative-draft-model-path DIR"),
])
def test_validate_server_args(tiny_pair, changes, message):
    from mfd_sglang.serving.algorithms import validate_server_args

    args = _server_args(tiny_pair, **changes)
    if message is None:
        validate_server_args(args)
    else:
        with pytest.raises(ValueError, match=message.replace("-", r"\-")):
            validate_server_args(args)


def test_validate_server_args_rejects_more_modes_than_the_drafter_has(tiny_pair, monkeypatch):
    from mfd_sglang.serving.algorithms import validate_server_args

    monkeypatch.setenv("MFD_SGLANG_NUM_MODES", "9")
    with pytest.raises(ValueError, match="has 4 mode"):
        validate_server_args(_server_args(tiny_pair))


def test_last_target_layer_is_rejected(tiny_pair, tmp_path):
    from mfd_sglang.checkpoint import CheckpointError
    from mfd_sglang.serving.algorithms import check_capturable_layers

    ckpt = load_drafter(tiny_pair / "drafter")
    check_capturable_layers(ckpt, tiny_pair / "target")
    ckpt = dataclasses.replace(ckpt, config=dataclasses.replace(ckpt.config, target_layer_ids=(0, 2)))
    with pytest.raises(CheckpointError, match="last layer cannot be captured"):
        check_capturable_layers(ckpt, tiny_pair / "target")


def _request(**params):
    base = dict(min_p=0.0, frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0,
                min_new_tokens=0, logit_bias=None, json_schema=None, regex=None, ebnf=None, structural_tag=None)
    base.update(params)
    return SimpleNamespace(sampling_params=SimpleNamespace(**base), return_logprob=False,
                           return_hidden_states=False, custom_logit_processor=None, lora_id=None)


def test_unsupported_request_features():
    assert unsupported_request_features(_request()) == []
    assert unsupported_request_features(_request(temperature=0.7)) == []
    req = _request(presence_penalty=0.3, json_schema="{}")
    assert unsupported_request_features(req) == [
        "presence_penalty", "json_schema / regex / ebnf / structural_tag (constrained decoding)"]
    req = _request()
    req.return_logprob = True
    assert unsupported_request_features(req) == ["return_logprob"]


def test_context_pool_gathers_what_the_drafter_computes(tiny_pair):
    torch.manual_seed(0)
    drafter = MFDDrafter.from_checkpoint(load_drafter(tiny_pair / "drafter"), dtype=torch.float32)
    features = drafter.fc.in_features
    pool = DraftContextPool(drafter, 64, device="cpu", dtype=torch.float32)
    lengths = [5, 9]
    slots = [torch.randperm(63)[:n] + 1 for n in lengths]  # scattered slots, as the KV allocator gives
    hidden = [torch.randn(n, features) for n in lengths]
    # Written in two pieces (prefill, then a commit) per request.
    for h, s in zip(hidden, slots):
        pool.write(drafter, h[:3], torch.arange(3), s[:3])
        pool.write(drafter, h[3:], torch.arange(3, len(s)), s[3:])
    width = max(lengths) + 2
    table = torch.zeros(2, width, dtype=torch.long)
    for b, s in enumerate(slots):
        table[b, : len(s)] = s
    context = pool.gather(table, torch.tensor(lengths))
    for b, (h, n) in enumerate(zip(hidden, lengths)):
        want = drafter.context_kv(h[None], torch.arange(n)[None])
        assert context.valid[b].tolist() == [i < n for i in range(width)]
        for layer in range(len(pool.keys)):
            torch.testing.assert_close(context.keys[layer][b, :, :n], want.keys[layer][0])
            torch.testing.assert_close(context.values[layer][b, :, :n], want.values[layer][0])
