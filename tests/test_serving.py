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


@pytest.mark.parametrize("device, given, expected", [
    ("cuda", {}, "flashinfer"),  # nothing resolved: FlashInfer first
    ("cuda", {"attention_backend": "fa3"}, "flashinfer"),  # SGLang's Hopper default cannot verify a tree
    ("cuda", {"decode_attention_backend": "trtllm_mha", "attention_backend": "triton"}, "flashinfer"),
    ("cuda", {"attention_backend": "triton"}, "triton"),
    ("cpu", {"attention_backend": "mfd_cpu"}, "mfd_cpu"),
])
def test_attention_backend_is_one_that_applies_the_tree_mask(device, given, expected, caplog):
    from mfd_sglang.serving.algorithms import resolve_attention_backend

    args = SimpleNamespace(device=device, attention_backend=None, prefill_attention_backend=None,
                           decode_attention_backend=None)
    vars(args).update(given)
    with caplog.at_level("WARNING"):
        resolve_attention_backend(args)
    assert args.attention_backend == expected
    switched = expected != given.get("attention_backend")
    assert ("cannot verify a tree" in caplog.text) == (switched and bool(given))
    if switched:
        assert args.prefill_attention_backend is None and args.decode_attention_backend is None


@pytest.mark.parametrize("given", [{}, {"attention_backend": "torch_native"}])
def test_cpu_refuses_attention_backends_without_a_tree_mask(given):
    from mfd_sglang.serving.algorithms import resolve_attention_backend

    args = SimpleNamespace(device="cpu", attention_backend=None, prefill_attention_backend=None,
                           decode_attention_backend=None)
    vars(args).update(given)
    with pytest.raises(ValueError, match="MFD on CPU needs --attention-backend mfd_cpu"):
        resolve_attention_backend(args)


def test_instantiated_attention_backend_is_checked():
    from mfd_sglang.serving.algorithms import check_tree_verify_attention

    for name in ("FlashInferAttnBackend", "TritonAttnBackend", "CpuSdpaAttnBackend"):
        check_tree_verify_attention(type(name, (), {})())
    # A wrapper (hybrid / SWA) is resolved to the backend that runs the verify.
    wrapper = type("SomeWrapper", (), {})()
    wrapper.full_attn_backend = type("FlashAttentionBackend", (), {})()
    with pytest.raises(RuntimeError, match="FlashAttentionBackend attention backend .* --attention-backend"):
        check_tree_verify_attention(wrapper)


def test_verify_graph_runner_is_installed_for_mfd_target_runners_only():
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    from mfd_sglang.patches.verify_graph import decode_graph_runner_cls_around
    from mfd_sglang.serving.verify_graph import MFDVerifyCudaGraphRunner

    def runner(name, is_draft_worker=False):
        return SimpleNamespace(spec_algorithm=SimpleNamespace(name=name), is_draft_worker=is_draft_worker)

    def original(model_runner):
        return "stock runner"

    assert decode_graph_runner_cls_around(original, runner("MFD")) is MFDVerifyCudaGraphRunner
    assert decode_graph_runner_cls_around(original, runner("MFD_D")) is MFDVerifyCudaGraphRunner
    assert decode_graph_runner_cls_around(original, runner("EAGLE")) == "stock runner"
    assert decode_graph_runner_cls_around(original, runner("MFD", is_draft_worker=True)) == "stock runner"

    # The graphs are captured with the tree mask buffer and full hidden-state capture (what the
    # stock runner's DFlash-family input lacks), at the runner's verify width.
    graph_runner = object.__new__(MFDVerifyCudaGraphRunner)
    graph_runner.captured_req_width = 17
    graph_runner.buffers = SimpleNamespace(custom_mask=torch.ones(64, dtype=torch.bool))
    spec_info = graph_runner.get_spec_info(num_tokens=34)
    assert isinstance(spec_info, EagleVerifyInput)
    assert spec_info.custom_mask is graph_runner.buffers.custom_mask
    assert spec_info.draft_token_num == 17 and spec_info.capture_hidden_mode == CaptureHiddenMode.FULL
    # Any other forward (no tree verify input) is not replayed on these graphs.
    assert not graph_runner.can_run_graph(SimpleNamespace(spec_info=None))


def test_plugin_registers_the_verify_graph_hook():
    from mfd_sglang import plugin
    from mfd_sglang.patches import is_registered
    from mfd_sglang.patches.verify_graph import DECODE_GRAPH_RUNNER_CLS, decode_graph_runner_cls_around

    plugin.register()
    assert is_registered(DECODE_GRAPH_RUNNER_CLS, decode_graph_runner_cls_around)


def _draft_graph_worker(tiny_pair, device: str):
    """An MFDWorkerV2 with only what its draft + tree stage reads (no SGLang model runner)."""
    from mfd_sglang.serving.worker import MFDWorkerV2

    drafter = MFDDrafter.from_checkpoint(load_drafter(tiny_pair / "drafter"), dtype=torch.float32).to(device)
    gen = torch.Generator().manual_seed(0)
    num_slots, max_len, vocab = 200, 40, drafter.cfg.vocab_size
    worker = object.__new__(MFDWorkerV2)
    worker.drafter, worker.budget, worker.switch_threshold = drafter, 12, 3
    on_cuda = device.startswith("cuda")
    worker.tree_backend = worker.mode_attention_backend = "triton" if on_cuda else "torch"
    worker.embed_weight = torch.randn(vocab, drafter.cfg.hidden_size, generator=gen).to(device)
    worker.lm_head_weight = torch.randn(vocab, drafter.cfg.hidden_size, generator=gen).to(device)
    worker.context_pool = DraftContextPool(drafter, num_slots, device=device, dtype=torch.float32)
    worker.context_pool.write(drafter, torch.randn(num_slots, drafter.fc.in_features, generator=gen).to(device),
                              torch.arange(num_slots).to(device) % max_len, torch.arange(num_slots).to(device))
    table = torch.stack([torch.randperm(num_slots, generator=gen)[:max_len] for _ in range(6)]).to(device)
    worker.model_runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=table.to(torch.int32)))
    return worker, table


def check_draft_graphs_match_eager(tiny_pair, device: str, use_graph: bool):
    """The worker's draft + tree + layout, replayed at padded batch sizes (rows of other requests, or
    pad rows with an empty context, beside it), gives each request the tree and verify layout it gets
    when drafted alone."""
    from mfd_sglang.cuda_graph import BatchGraphs

    worker, table = _draft_graph_worker(tiny_pair, device)
    graphs = BatchGraphs(worker.draft_paged_tree,
                         lambda bs: [torch.zeros(bs, dtype=torch.int64, device=device) for _ in range(3)],
                         [1, 2, 4, 6], use_graph=use_graph)
    gen = torch.Generator().manual_seed(3)
    for bs, single_mode in [(3, False), (1, True), (5, False), (2, True), (6, False)]:
        requests_ = torch.randperm(table.shape[0], generator=gen)[:bs].to(device)
        roots = torch.randint(0, worker.drafter.cfg.vocab_size, (bs,), generator=gen).to(device)
        lens = torch.randint(1, table.shape[1] - 20, (bs,), generator=gen).to(device)
        tree, layout = graphs(roots, lens, requests_, key=single_mode)
        num_nodes = worker.budget + 1
        assert torch.equal(layout.retrive_index.flatten().cpu(), torch.arange(bs * num_nodes))
        for b in range(bs):
            alone, alone_layout = worker.draft_paged_tree(roots[b:b + 1], lens[b:b + 1], requests_[b:b + 1],
                                                          key=single_mode)
            torch.testing.assert_close(tree.scores[b:b + 1], alone.scores, rtol=1e-4, atol=1e-4)
            assert torch.equal(tree.tokens[b:b + 1], alone.tokens) and torch.equal(tree.parents[b:b + 1], alone.parents)
            for name in ("draft_token", "positions", "retrive_next_token", "retrive_next_sibling", "ancestor_mask"):
                assert torch.equal(getattr(layout, name)[b:b + 1], getattr(alone_layout, name)), name


def test_worker_draft_graphs_match_eager_drafting_on_cpu(tiny_pair):
    check_draft_graphs_match_eager(tiny_pair, "cpu", use_graph=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_worker_draft_graphs_match_eager_drafting_as_cuda_graphs(tiny_pair):
    check_draft_graphs_match_eager(tiny_pair, "cuda", use_graph=True)
