"""The SGLang integration's pieces that need no server: options, launch-time checks, per-request
checks and the drafter context pool (held to the drafter's own context K/V)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mfd_sglang.checkpoint import load_drafter
from mfd_sglang.drafter import MFDDrafter
from mfd_sglang.serving.draft_context_pool import DraftContextPool
from mfd_sglang.serving.launch.options import (MAX_BUDGET, budget_from_num_draft_tokens, default_num_draft_tokens,
                                               read_options)
from mfd_sglang.patches.request_checks import unsupported_request_features
from servers import resolve

REPO = Path(__file__).resolve().parents[1]


def test_options_defaults_and_errors():
    assert read_options(environ={}).switch_threshold == 3 and read_options(environ={}).num_modes is None
    opts = read_options(environ={"MFD_SGLANG_SWITCH_THRESHOLD": "5", "MFD_SGLANG_NUM_MODES": "2"})
    assert (opts.switch_threshold, opts.num_modes) == (5, 2)
    with pytest.raises(ValueError, match="MFD_SGLANG_SWITCH_THRESHOLD='zero' is not a positive integer"):
        read_options(environ={"MFD_SGLANG_SWITCH_THRESHOLD": "zero"})
    with pytest.raises(ValueError, match="MFD_SGLANG_NUM_MODES='0'"):
        read_options(environ={"MFD_SGLANG_NUM_MODES": "0"})
    assert read_options(environ={}).mode_subsets is None  # offered where they can be
    assert [read_options(environ={"MFD_SGLANG_MODE_SUBSETS": v}).mode_subsets for v in ("0", "1")] == [False, True]
    with pytest.raises(ValueError, match="MFD_SGLANG_MODE_SUBSETS='yes': set it to 1"):
        read_options(environ={"MFD_SGLANG_MODE_SUBSETS": "yes"})
    assert budget_from_num_draft_tokens(65) == 64
    with pytest.raises(ValueError, match="tree budget of 0 nodes"):
        budget_from_num_draft_tokens(1)
    assert default_num_draft_tokens("cuda") == 65 and default_num_draft_tokens("cpu") == 17


def _server_args(tiny_pair, **changes):
    args = dict(speculative_algorithm="MFD", model_path=str(tiny_pair / "target"),
                speculative_draft_model_path=str(tiny_pair / "drafter"), speculative_num_draft_tokens=9,
                page_size=1, pp_size=1, tp_size=1, dp_size=1, enable_dp_attention=False,
                disaggregation_mode="null", enable_hierarchical_cache=False,
                speculative_draft_window_size=None, speculative_adaptive=False, device="cpu")
    args.update(changes)
    return SimpleNamespace(**args)


@pytest.mark.parametrize("changes, message", [
    ({}, None),
    ({"tp_size": 2}, None),  # tensor parallelism is served (tests/test_tp_server.py)
    ({"pp_size": 2}, "--pp-size 2: pipeline parallelism"),
    ({"dp_size": 2}, None),  # replicas are served (tests/test_scale_out.py)
    ({"dp_size": 2, "enable_dp_attention": True}, "--attn-dp-size 2 .attention data parallelism"),
    ({"attn_dp_size": 2}, "--attn-dp-size 2 .attention data parallelism"),
    ({"disaggregation_mode": "decode"}, None),  # PD is served (tests/test_pd_disaggregation.py)
    ({"disaggregation_mode": "prefill", "attn_dp_size": 2, "enable_dp_lm_head": True},
     "--disaggregation-mode prefill with --attn-dp-size 2: PD disaggregation under attention data parallelism"),
    ({"page_size": 16}, None),  # pages are served (tests/test_mfd_server.py: exact at 4 and 16)
    ({"speculative_num_draft_tokens": 2000}, "tree budget of 1999 nodes"),
    ({"speculative_draft_model_path": None}, "needs --speculative-draft-model-path DIR"),
])
def test_validate_server_args(tiny_pair, changes, message):
    from mfd_sglang.serving.launch.resolve import validate_server_args

    args = _server_args(tiny_pair, **changes)
    if message is None:
        validate_server_args(args)
    else:
        with pytest.raises(ValueError, match=message.replace("-", r"\-")):
            validate_server_args(args)


def test_the_launch_says_what_it_changes_and_refuses_8_bit_kv_caches_and_larger_budgets(tiny_pair):
    """On SGLang's real argument parsing and resolution: every flag MFD sets or overrides is a warning naming it
    (as SGLang's DFLASH warns for the same ones); an 8-bit target or draft KV cache dtype is refused naming the
    flag (the drafter's context pool would not be in it); a bf16 one is served. A budget at the maximum that
    README's options table and docs/serving.md state, MAX_BUDGET (the largest at which every Triton kernel
    compiles: tests/test_gpu_ledger.py), is served, one past it refused naming the maximum."""
    documented = {path: re.findall(r"1 <= B <= (\d+)", (REPO / path).read_text())
                  for path in ("README.md", "docs/serving.md")}
    assert all(found == [str(MAX_BUDGET)] for found in documented.values()), documented
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # each resolution imports SGLang, on one core
        first = pool.submit(resolve, tiny_pair, [], with_log=True)
        second = pool.submit(resolve, tiny_pair, ["--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
                                                  "--enable-mixed-chunk", "--max-running-requests", "8",
                                                  "--speculative-num-draft-tokens", "9"], with_log=True)
        refusals = pool.submit(resolve, tiny_pair, ["--kv-cache-dtype", "fp8_e4m3"],
                               ["--speculative-draft-kv-cache-dtype", "fp8_e5m2"], ["--kv-cache-dtype", "bf16"],
                               ["--speculative-num-draft-tokens", str(MAX_BUDGET + 1)],
                               ["--speculative-num-draft-tokens", str(MAX_BUDGET + 2)])
    [plain], defaults = first.result()
    assert "error" not in plain, plain
    assert "speculative_num_draft_tokens is not set; defaulting to 17 for MFD" in defaults, defaults[-3000:]
    assert "Max running requests is reset to 48" in defaults, defaults[-3000:]
    assert "overriding" not in defaults, defaults[-3000:]
    [overridden], log = second.result()
    assert "error" not in overridden, overridden
    for said in ("overriding speculative_num_steps=3 to 1", "overriding speculative_eagle_topk=4 to 1",
                 "overriding --enable-mixed-chunk to off"):
        assert said in log, (said, log[-3000:])
    assert "Max running requests is reset" not in log and "is not set; defaulting" not in log, log[-3000:]
    target, draft, bf16, at_most, past = refusals.result()
    assert "--kv-cache-dtype fp8_e4m3: MFD keeps the drafter's context in the model dtype" in target.get("error", "")
    assert "--speculative-draft-kv-cache-dtype fp8_e5m2: MFD keeps" in draft.get("error", ""), draft
    assert "error" not in bf16, bf16
    assert "error" not in at_most, at_most
    assert (f"--speculative-num-draft-tokens {MAX_BUDGET + 2} gives MFD a tree budget of {MAX_BUDGET + 1} nodes; it "
            f"must be between 1 and {MAX_BUDGET}") in past.get("error", ""), past


def test_mfd_options_are_sglang_flags(tiny_pair, tmp_path):
    """MFD's options are flags of SGLang's own parser: listed in `python -m sglang.launch_server --help` under
    their group, set from a --config YAML as from the command line, checked at launch with messages naming
    the flag, and refused on a server that does not run MFD (a real CPU server reads them: the automatic-budget
    and MFD_D server tests pass them as flags)."""
    config = tmp_path / "mfd.yaml"
    config.write_text("mfd-num-modes: 2\nmfd-switch-threshold: 5\nmfd-mode-subsets: off\nmfd-kernels: torch\n")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # each imports SGLang, on one core
        resolved = pool.submit(
            resolve, tiny_pair, ["--config", str(config)],
            ["--mfd-num-modes", "2", "--mfd-switch-threshold", "5", "--mfd-mode-subsets", "off", "--mfd-kernels", "torch"],
            ["--mfd-num-modes", "9"], ["--mfd-auto-budget", "--mfd-switch-threshold", "2"],
            ["--speculative-algorithm", "EAGLE", "--mfd-auto-budget"])
        help_text = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True,
                                   text=True, timeout=300, cwd=tmp_path).stdout
    assert "MFD speculative decoding (mfd_sglang plugin" in help_text, help_text[-2000:]
    for flag in ("--mfd-switch-threshold", "--mfd-num-modes", "--mfd-auto-budget", "--mfd-mode-subsets", "--mfd-kernels"):
        assert flag in help_text, flag
    yaml, flags, too_many, both, plain = resolved.result()
    assert yaml == flags and flags["mfd_options"] == {"num_modes": 2, "switch_threshold": 5, "mode_subsets": False,
                                                      "kernels": "torch"}
    assert "--mfd-num-modes 9 but the drafter at" in too_many.get("error", ""), too_many
    assert "--mfd-auto-budget chooses MFD_D's drafting path itself; drop --mfd-switch-threshold 2" in \
        both.get("error", ""), both
    assert "--mfd-auto-budget: MFD options, for --speculative-algorithm MFD or MFD_D only (this server runs " \
           "EAGLE)" in plain.get("error", ""), plain


def test_validate_server_args_rejects_more_modes_than_the_drafter_has(tiny_pair, monkeypatch):
    from mfd_sglang.serving.launch.resolve import validate_server_args

    monkeypatch.setenv("MFD_SGLANG_NUM_MODES", "9")
    with pytest.raises(ValueError, match="has 4 mode"):
        validate_server_args(_server_args(tiny_pair))


def test_validate_server_args_refuses_the_automatic_budget_under_tensor_parallelism(tiny_pair, monkeypatch):
    from mfd_sglang.serving.launch.resolve import validate_server_args

    monkeypatch.setenv("MFD_SGLANG_AUTO_BUDGET", "1")
    validate_server_args(_server_args(tiny_pair))
    with pytest.raises(ValueError, match="MFD_SGLANG_AUTO_BUDGET=1 with --tp-size 2"):
        validate_server_args(_server_args(tiny_pair, tp_size=2))


def test_last_target_layer_is_rejected(tiny_pair, tmp_path):
    from mfd_sglang.checkpoint import CheckpointError
    from mfd_sglang.serving.launch.resolve import check_capturable_layers

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
    # Served: penalties, min_new_tokens, logit_bias, logprobs, constrained decoding.
    req = _request(presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.3, min_new_tokens=3,
                   logit_bias={"5": 1.0})
    req.return_logprob = True
    assert unsupported_request_features(req) == []
    assert unsupported_request_features(_request(json_schema="{}", regex="a+")) == []
    req = _request()
    req.return_hidden_states = True
    assert unsupported_request_features(req) == ["return_hidden_states"]


@pytest.mark.parametrize("page_size", [0, 4])
@torch.no_grad()
def test_context_pool_gathers_what_the_drafter_computes(tiny_pair, page_size):
    """Also when the K/V are the buffers of SGLang's MHATokenToKVPool (page_size > 0): what SGLang's PD
    transfer registers (its buffer infos) is the memory the drafter writes and reads."""
    torch.manual_seed(0)
    drafter = MFDDrafter.from_checkpoint(load_drafter(tiny_pair / "drafter"), dtype=torch.float32)
    features = drafter.fc.in_features
    pool = DraftContextPool(drafter, 64, device="cpu", dtype=torch.float32, page_size=page_size)
    assert pool.num_slots == 64
    if page_size:
        ptrs, lens, item_lens = pool.sglang_pool.get_contiguous_buf_infos()
        assert ptrs == [t.data_ptr() for t in pool.keys + pool.values]
        assert set(lens) == {pool.keys[0].numel() * 4} and set(item_lens) == {pool.keys[0][0].numel() * 4 * page_size}
    else:
        assert pool.sglang_pool is None
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


@torch.no_grad()
def test_deferred_context_writes_land_as_direct_writes_would(tiny_pair):
    """Plain-decoding rounds' context held by the pool's deferred writes (`deferred_for`) ends up in the
    pool as the same writes made at once. Nothing reaches the pool before a flush; a change of requests
    writes what is held first (request "b" leaves, its slot 4 goes to a new request "c": b's row lands
    before c's); a full buffer is written before it takes more; a round larger than the buffer is written
    at once; the pool's own reads and direct writes write what is held first."""
    torch.manual_seed(0)
    drafter = MFDDrafter.from_checkpoint(load_drafter(tiny_pair / "drafter"), dtype=torch.float32)
    features = drafter.fc.in_features
    direct = DraftContextPool(drafter, 32, device="cpu", dtype=torch.float32)
    pool = DraftContextPool(drafter, 32, device="cpu", dtype=torch.float32, deferred_rows=6)

    def snapshot(p):
        return [t.clone() for t in p.keys + p.values]

    def same(a, b):  # one projection of many rows may round differently from several of few rows
        return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))

    # (requests, slots, positions) of each round, and whether the pool must equal the direct writes
    # made before this round once the round's rows are handed over (what was held got written).
    rounds = [(("a", "b"), [1, 2], [7, 3], False), (("a", "b"), [3, 4], [8, 4], False),
              (("a", "c"), [5, 4], [9, 0], True),  # b left: its rows are written before c's
              (("a", "c"), [6, 7], [10, 1], False), (("a", "c"), [8, 9], [11, 2], False),
              (("a", "c"), [10, 11], [12, 3], True),  # 6 held + 2 > capacity 6: the 6 written first
              (("a", "c", "d", "e", "f", "g", "h"), [12, 13, 14, 15, 16, 17, 18], [13, 4, 0, 0, 0, 0, 0], True)]
    empty = snapshot(pool)
    for requests, slots, positions, written_before in rounds:
        before = snapshot(direct)
        hidden = torch.randn(len(slots), features)
        slots, positions = torch.tensor(slots), torch.tensor(positions)
        direct.write(drafter, hidden, positions, slots)
        deferred = pool.deferred_for(requests)
        deferred.write(drafter, hidden, positions, slots)
        if len(slots) > deferred.capacity:
            assert same(snapshot(pool), snapshot(direct))  # too many to hold: written at once
        elif written_before:
            assert same(snapshot(pool), before) and not same(before, empty)
        else:
            assert not same(snapshot(pool), snapshot(direct))  # held
    for read_or_write in (lambda: pool.gather(torch.tensor([[19]]), torch.tensor([1])),
                          lambda: pool.paged(torch.tensor([[19]]), torch.tensor([0]), torch.tensor([1]), "torch"),
                          lambda: pool.write(drafter, torch.zeros(1, features), torch.tensor([0]), torch.tensor([31]))):
        pool.deferred_for(("a", "c")).write(drafter, torch.randn(1, features), torch.tensor([5]), torch.tensor([19]))
        direct.write(drafter, pool.deferred.hidden[:1].clone(), torch.tensor([5]), torch.tensor([19]))
        below_31 = lambda p: [t[:31] for t in snapshot(p)]  # noqa: E731 (slot 31: the direct write's own)
        assert not same(below_31(pool), below_31(direct))  # held
        read_or_write()
        assert pool.deferred.count == 0 and same(below_31(pool), below_31(direct))


@pytest.mark.parametrize("device, given, flashinfer, expected", [
    ("cuda", {}, True, "flashinfer"),  # nothing resolved: FlashInfer first
    ("cuda", {}, False, "triton"),  # ... Triton where FlashInfer is not installed
    ("cuda", {"attention_backend": "fa3"}, True, "flashinfer"),  # SGLang's Hopper default cannot verify a tree
    ("cuda", {"attention_backend": "fa3"}, False, "triton"),
    ("cuda", {"decode_attention_backend": "trtllm_mha", "attention_backend": "triton"}, True, "flashinfer"),
    ("cuda", {"attention_backend": "triton"}, True, "triton"),
    ("cuda", {"attention_backend": "flashinfer"}, False, "flashinfer"),  # the user's choice is SGLang's to check
    ("cpu", {"attention_backend": "mfd_cpu"}, False, "mfd_cpu"),
])
def test_attention_backend_is_one_that_applies_the_tree_mask(device, given, flashinfer, expected, caplog,
                                                              monkeypatch):
    import importlib.util

    from mfd_sglang.serving.launch.resolve import resolve_attention_backend

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        (object() if flashinfer else None) if name == "flashinfer" else find_spec(name, *a)))
    args = SimpleNamespace(device=device, attention_backend=None, prefill_attention_backend=None,
                           decode_attention_backend=None)
    vars(args).update(given)
    with caplog.at_level("WARNING"):
        resolve_attention_backend(args)
    assert args.attention_backend == expected
    switched = expected != given.get("attention_backend")
    assert ("cannot verify a tree" in caplog.text) == (switched and bool(given))
    # one line says why Triton serves where FlashInfer would
    assert ("FlashInfer is not installed" in caplog.text) == (switched and expected == "triton")
    if switched:
        assert args.prefill_attention_backend is None and args.decode_attention_backend is None


@pytest.mark.parametrize("given", [{}, {"attention_backend": "torch_native"}])
def test_cpu_refuses_attention_backends_without_a_tree_mask(given):
    from mfd_sglang.serving.launch.resolve import resolve_attention_backend

    args = SimpleNamespace(device="cpu", attention_backend=None, prefill_attention_backend=None,
                           decode_attention_backend=None)
    vars(args).update(given)
    with pytest.raises(ValueError, match="MFD on CPU needs --attention-backend mfd_cpu"):
        resolve_attention_backend(args)


def _attention_backends():
    """SGLang's real attention backend classes (and the CPU one), which verify trees, and which do not."""
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.layers.attention.trtllm_mha_backend import TRTLLMHAAttnBackend

    from mfd_sglang.cpu.attention import CpuSdpaAttnBackend

    return (FlashInferAttnBackend, TritonAttnBackend, CpuSdpaAttnBackend), (TRTLLMHAAttnBackend, TorchNativeAttnBackend)


def test_instantiated_attention_backend_is_checked():
    """Instances of SGLang's real backend classes made with object.__new__ (their constructors need a
    model runner, and FlashInfer / TRT-LLM a GPU): the check sees the same types a server builds."""
    from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend
    from sglang.srt.layers.attention.tbo_backend import TboAttnBackend

    from mfd_sglang.serving.launch.target_checks import check_tree_verify_attention

    tree_mask, no_tree_mask = _attention_backends()
    for cls in tree_mask:
        check_tree_verify_attention(object.__new__(cls))
    for cls in no_tree_mask:
        with pytest.raises(RuntimeError, match=f"{cls.__name__} attention backend .* --attention-backend"):
            check_tree_verify_attention(object.__new__(cls))
    # Wrappers are resolved to the backend that runs TARGET_VERIFY: a hybrid prefill/decode backend
    # verifies on its decode backend only when speculative attention runs in decode mode.
    hybrid = object.__new__(HybridAttnBackend)
    hybrid.prefill_backend, hybrid.decode_backend = object.__new__(no_tree_mask[1]), object.__new__(tree_mask[0])
    hybrid.spec_attn_is_decode = True
    check_tree_verify_attention(hybrid)
    hybrid.spec_attn_is_decode = False
    with pytest.raises(RuntimeError, match=no_tree_mask[1].__name__):
        check_tree_verify_attention(hybrid)
    two_batch = object.__new__(TboAttnBackend)
    two_batch.primary = object.__new__(no_tree_mask[0])
    with pytest.raises(RuntimeError, match=no_tree_mask[0].__name__):
        check_tree_verify_attention(two_batch)


# Run in a fresh process: load_plugins() patches SGLang's classes for the whole process, as in a server.
RESOLVE_GRAPH_RUNNERS = """
import json
from sglang.srt.plugins import load_plugins
load_plugins()  # what every SGLang process does first: entry points, then the HookRegistry hooks
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

resolved = {}
for algorithm, is_draft_worker in [("MFD", False), ("MFD_D", False), ("MFD", True), ("EAGLE", False), ("NONE", False)]:
    runner = object.__new__(ModelRunner)  # the real class; its constructor loads a model
    runner.spec_algorithm = SpeculativeAlgorithm.from_string(algorithm)
    runner.is_draft_worker = is_draft_worker
    cls = runner._decode_cuda_graph_runner_cls()  # what SGLang's capture_decode_graph instantiates on CUDA
    resolved[algorithm + (" draft" if is_draft_worker else "")] = cls.__module__ + "." + cls.__qualname__
print("RESOLVED", json.dumps(resolved))
"""


def test_sglang_resolves_mfd_target_runners_to_the_tree_verify_graph_runner():
    """SGLang's own ModelRunner._decode_cuda_graph_runner_cls, after load_plugins() found the plugin
    through its entry point and applied its hooks, picks MFD's runner for MFD / MFD_D target runners
    only (graph capture itself needs a GPU: scripts/gpu_check.sh)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS", "MFD_SGLANG_CPU")}
    proc = subprocess.run([sys.executable, "-c", RESOLVE_GRAPH_RUNNERS], capture_output=True, text=True,
                          timeout=600, env=dict(env, HF_HUB_OFFLINE="1"), cwd=REPO)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESOLVED ")), None)
    assert proc.returncode == 0 and line, (proc.stdout + proc.stderr)[-4000:]
    stock, mfd = ("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner",
                  "mfd_sglang.serving.verify_graph.MFDVerifyCudaGraphRunner")
    assert json.loads(line[len("RESOLVED "):]) == {"MFD": mfd, "MFD_D": mfd, "MFD draft": stock, "EAGLE": stock,
                                                   "NONE": stock}


@pytest.mark.parametrize("backend", ["FlashInferAttnBackend", "TritonAttnBackend"])
def test_verify_graphs_are_captured_with_the_tree_mask(backend):
    """What a graph of SGLang's real DecodeCudaGraphRunner and of MFD's subclass is captured with, for
    an MFD target runner on the two GPU tree-verify backends. Runner, model runner and backend are the
    real classes made with object.__new__ (capture needs a GPU), holding what get_spec_info reads. The
    stock runner's DFlash-family input has no tree mask (why the hook exists); MFD's carries the
    runner's mask buffer and keeps every verified token's hidden states for the drafter."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.speculative.eagle_info import EagleVerifyInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from mfd_sglang.plugin import mfd_worker_class
    from mfd_sglang.serving.launch.algorithms import register_algorithms
    from mfd_sglang.serving.verify_graph import MFDVerifyCudaGraphRunner

    register_algorithms(mfd_worker_class)
    attn_backend = object.__new__(next(c for c in _attention_backends()[0] if c.__name__ == backend))

    def capture_input(cls):
        model_runner = object.__new__(ModelRunner)
        model_runner.spec_algorithm, model_runner.is_draft_worker = SpeculativeAlgorithm.from_string("MFD"), False
        model_runner.attn_backend = attn_backend
        graph_runner = object.__new__(cls)
        graph_runner.model_runner, graph_runner.captured_req_width = model_runner, 17
        graph_runner.ragged_verify_mode = False
        graph_runner.buffers = SimpleNamespace(custom_mask=torch.ones(64, dtype=torch.bool))
        return graph_runner, graph_runner.get_spec_info(num_tokens=34)

    _, stock = capture_input(DecodeCudaGraphRunner)
    assert stock.custom_mask is None  # SGLang 0.5.23: a chain; re-check verify_graph.py if this changes
    graph_runner, spec_info = capture_input(MFDVerifyCudaGraphRunner)
    assert isinstance(spec_info, EagleVerifyInput)
    assert spec_info.custom_mask is graph_runner.buffers.custom_mask
    assert spec_info.draft_token_num == 17 and spec_info.capture_hidden_mode == CaptureHiddenMode.FULL
    # Any other forward (no tree verify input) is not replayed on these graphs.
    assert not graph_runner.can_run_graph(SimpleNamespace(spec_info=stock))


# Publishes a real SGLang config (ServerArgs of an MFD server at 9 draft tokens), as a scheduler does.
VERIFY_WIDTHS = """
import json, sys
import torch
from types import SimpleNamespace
from sglang.srt.runtime_context import get_spec, publish
from sglang.srt.server_args import ServerArgs
from mfd_sglang.plugin import mfd_worker_class
from mfd_sglang.serving.launch.algorithms import register_algorithms
from mfd_sglang.serving.verify_graph import VerifyGraphsByWidth, capture_verify_width

register_algorithms(mfd_worker_class)
pair = sys.argv[1]
publish(ServerArgs(model_path=pair + "/target", speculative_algorithm="MFD", speculative_draft_model_path=pair + "/drafter",
                   speculative_num_draft_tokens=9, device="cpu", attention_backend="triton", skip_tokenizer_init=True),
        role="scheduler")
built = []

class Backend:
    def __init__(self, init_new_workspace):
        self.width = get_spec().speculative_num_draft_tokens  # what a backend sizes its graph state from
        built.append(("backend", self.width, init_new_workspace))

class Runner:
    def __init__(self, model_runner, *, attn_backend, speculative_num_steps, speculative_num_draft_tokens):
        if speculative_num_draft_tokens == 3:
            raise RuntimeError("capture failed")
        self.width = speculative_num_draft_tokens
        built.append(("runner", speculative_num_draft_tokens, get_spec().speculative_num_draft_tokens,
                      attn_backend.width, attn_backend.decode_attention_backend_str))

def new_backend(init_new_workspace):
    runner.init_new_workspace = init_new_workspace  # as SGLang's get_attention_backend does
    return Backend(init_new_workspace)

runner = SimpleNamespace(attn_backend="launch backend", decode_cuda_graph_runner="launch graphs", init_new_workspace=False,
                         prefill_attention_backend_str="triton", decode_attention_backend_str="triton",
                         _get_attention_backend=new_backend)
capture = lambda model_runner, width: capture_verify_width(model_runner, width, runner_cls=Runner)
graphs = VerifyGraphsByWidth(runner, [1, 5, 9], capture=capture)
out = {"built": list(built), "widths": sorted(graphs.states), "spec_after": get_spec().speculative_num_draft_tokens,
       "workspace_flag": runner.init_new_workspace}
graphs.activate(5)
out["active_5"] = [runner.attn_backend.width, runner.decode_cuda_graph_runner.width]
graphs.activate(1)
out["active_1"] = [runner.attn_backend.width, runner.decode_cuda_graph_runner.width]
graphs.activate(9)
out["active_9"] = [runner.attn_backend, runner.decode_cuda_graph_runner]
try:
    capture(runner, 3)
except RuntimeError as exc:
    out["failed"] = [str(exc), get_spec().speculative_num_draft_tokens, runner.init_new_workspace]

def out_of_memory(model_runner, width):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory")

try:
    VerifyGraphsByWidth(runner, [1, 9], capture=out_of_memory)
except RuntimeError as exc:
    out["oom"] = str(exc)
print("WIDTHS " + json.dumps(out))
"""


def test_verify_graphs_by_width_capture_each_width_and_activate_it(tiny_pair):
    """Under the automatic budget the target gets one tree-verify graph runner per window width: each
    built over a new attention backend while SGLang's resolved speculative_num_draft_tokens reads that
    width (backends size their graph state from it), the launch value restored afterwards (also when a
    capture fails); `activate(width)` puts that width's backend and runner on the model runner; running
    out of device memory while capturing is an error that names the window and what to lower. The
    config is SGLang's real published one; backend and runner are recording stand-ins (capture needs a
    GPU: the GPU check's automatic-budget server row holds the real graphs to plain decoding)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS",)}
    proc = subprocess.run([sys.executable, "-c", VERIFY_WIDTHS, str(tiny_pair)], capture_output=True, text=True,
                          timeout=600, env=dict(env, HF_HUB_OFFLINE="1", MFD_SGLANG_CPU="1"), cwd=REPO)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("WIDTHS ")), None)
    assert proc.returncode == 0 and line, (proc.stdout + proc.stderr)[-4000:]
    out = json.loads(line[len("WIDTHS "):])
    assert out["built"] == [["backend", 1, True], ["runner", 1, 1, 1, "triton"],
                            ["backend", 5, True], ["runner", 5, 5, 5, "triton"]]
    assert out["widths"] == [1, 5, 9] and out["spec_after"] == 9 and out["workspace_flag"] is False
    assert out["active_5"] == [5, 5] and out["active_1"] == [1, 1]
    assert out["active_9"] == ["launch backend", "launch graphs"]
    assert out["failed"] == ["capture failed", 9, False]
    assert out["oom"].startswith("MFD automatic budget: out of device memory capturing the tree-verify graphs of "
                                 "a 1-token window") and "without --mfd-auto-budget" in out["oom"]


DRAFT_STAGE_BUDGET = 12


def _draft_stage(tiny_pair, device: str):
    """A DraftStage over the tiny drafter with random borrowed weights and a filled context pool, its
    requests' rows of req_to_token a random table (no SGLang model runner)."""
    from mfd_sglang.backend import resolve_backend
    from mfd_sglang.serving.draft_stage import DraftStage

    drafter = MFDDrafter.from_checkpoint(load_drafter(tiny_pair / "drafter"), dtype=torch.float32).to(device)
    gen = torch.Generator().manual_seed(0)
    num_slots, max_len, vocab = 200, 40, drafter.cfg.vocab_size
    table = torch.stack([torch.randperm(num_slots, generator=gen)[:max_len] for _ in range(6)]).to(device)
    stage = DraftStage(drafter, torch.randn(vocab, drafter.cfg.hidden_size, generator=gen).to(device),
                       torch.randn(vocab, drafter.cfg.hidden_size, generator=gen).to(device),
                       backend=resolve_backend("auto", device))
    stage.init_context_pool(num_slots, SimpleNamespace(req_to_token=table.to(torch.int32)), device=device,
                            dtype=torch.float32)
    stage.write_context(torch.randn(num_slots, drafter.fc.in_features, generator=gen).to(device),
                        torch.arange(num_slots).to(device) % max_len, torch.arange(num_slots).to(device))
    return stage, table


def check_draft_graphs_match_eager(tiny_pair, device: str, use_graph: bool):
    """The draft stage's draft + tree + layout, replayed at padded batch sizes (rows of other requests, or
    pad rows with an empty context, beside it), gives each request the tree and verify layout it gets
    when drafted alone, for each arm (drafting path, budget: the launch budget and a smaller one, as
    the automatic budget captures them)."""
    from mfd_sglang.cuda_graph import BatchGraphs
    from mfd_sglang.serving.budget.rule import Arm

    stage, table = _draft_stage(tiny_pair, device)
    graphs = BatchGraphs(stage.paged_tree,
                         lambda bs: [torch.zeros(bs, dtype=torch.int64, device=device) for _ in range(3)],
                         [1, 2, 4, 6], use_graph=use_graph)
    gen = torch.Generator().manual_seed(3)
    budget = DRAFT_STAGE_BUDGET
    small = min(4, budget - 1)
    for bs, arm in [(3, Arm(False, budget)), (1, Arm(True, budget)), (5, Arm(False, small)),
                    (2, Arm(True, small)), (6, Arm(False, budget))]:
        requests_ = torch.randperm(table.shape[0], generator=gen)[:bs].to(device)
        roots = torch.randint(0, stage.drafter.cfg.vocab_size, (bs,), generator=gen).to(device)
        lens = torch.randint(1, table.shape[1] - 20, (bs,), generator=gen).to(device)
        tree, layout = graphs(roots, lens, requests_, key=arm)
        num_nodes = arm.budget + 1
        assert torch.equal(layout.retrive_index.flatten().cpu(), torch.arange(bs * num_nodes))
        for b in range(bs):
            alone, alone_layout = stage.paged_tree(roots[b:b + 1], lens[b:b + 1], requests_[b:b + 1], key=arm)
            torch.testing.assert_close(tree.scores[b:b + 1], alone.scores, rtol=1e-4, atol=1e-4)
            assert torch.equal(tree.tokens[b:b + 1], alone.tokens) and torch.equal(tree.parents[b:b + 1], alone.parents)
            for name in ("draft_token", "positions", "retrive_next_token", "retrive_next_sibling", "ancestor_mask"):
                assert torch.equal(getattr(layout, name)[b:b + 1], getattr(alone_layout, name)), name


def test_worker_draft_graphs_match_eager_drafting_on_cpu(tiny_pair):
    check_draft_graphs_match_eager(tiny_pair, "cpu", use_graph=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_worker_draft_graphs_match_eager_drafting_as_cuda_graphs(tiny_pair):
    check_draft_graphs_match_eager(tiny_pair, "cuda", use_graph=True)
