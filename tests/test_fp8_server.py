"""FP8 drafting in a real SGLang CPU server (`--speculative-draft-model-quantization fp8`, the make-tiny pair,
fp32 target): one shared MFD server at B = 8 whose drafter runs its attention and MLP linears in e4m3
(`mfd_sglang.fp8`, the reference path on CPU). Lossless as always: greedy output is the target's greedy
decoding, a seeded T > 0 request is plain autoregressive sampling with its seed's coins (docs/algorithm.md,
Verification: the output depends on the target and the seed only, whatever the drafter proposes), and the
server speculates (accept length > 1) with the rounds of the reference engine run with the same FP8 drafter.
At launch, SGLang's own argument resolution: the flag reaches MFD's memory plan, and a method MFD's drafter
cannot run is refused with a message naming the flag."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import target_greedy
from mfd_sglang.checkpoint import load_drafter
from mfd_sglang.drafter import MFDDrafter
from mfd_sglang.hf import SpeculativeGenerator, load_target
from references import TOP_K_ALL, reference_sample
from servers import admitted_together, generate_ids, log_tail, plugin_env, served_without_leaks, start_server

REPO = Path(__file__).resolve().parents[1]
BUDGET, MAX_NEW = 8, 24


@pytest.fixture(scope="module")
def fp8_server(tiny_pair, tmp_path_factory):
    srv = start_server(tmp_path_factory, tiny_pair, tiny_pair / "drafter", "MFD", BUDGET, log_level="info",
                       extra_args=("--speculative-draft-model-quantization", "fp8"),
                       extra_env=plugin_env("hold_admission"))
    yield from served_without_leaks(srv)


@pytest.fixture(scope="module")
def engines(tiny_pair):
    """The reference engine (fp32) with the pair's MFD drafter quantized as the server quantizes it, and
    with it unquantized."""
    target, ckpt = load_target(tiny_pair / "target"), load_drafter(tiny_pair / "drafter")
    return {fp8: SpeculativeGenerator(target, MFDDrafter.from_checkpoint(ckpt, dtype=torch.float32, fp8_linears=fp8),
                                      budget=BUDGET) for fp8 in (True, False)}


def prompt_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_server_drafts_with_fp8_linears(fp8_server):
    assert "linears fp8 e4m3" in fp8_server.log(), log_tail(fp8_server.log_path)
    assert "(attention and MLP linears in FP8)" in fp8_server.log(), log_tail(fp8_server.log_path)


def test_greedy_equals_the_target_and_speculates(fp8_server, hf_target, tiny_prompts):
    """Four concurrent greedy requests: each equals the target's greedy decoding, and the server accepts
    draft tokens (SGLang's spec_accept_length, tokens per verify round, above 1 on average)."""
    model, tok = hf_target
    prompts = [prompt_ids(tok, text) for text in tiny_prompts[:4]]
    with admitted_together(fp8_server, len(prompts)), concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda ids: generate_ids(fp8_server, ids, MAX_NEW), prompts))
    for ids, (got, _) in zip(prompts, outs):
        assert got == target_greedy(model, ids, MAX_NEW), log_tail(fp8_server.log_path)
    accept = [meta["spec_accept_length"] for _, meta in outs]
    assert sum(accept) / len(accept) > 1.5, accept


def test_rounds_accept_what_the_fp8_reference_engine_accepts(fp8_server, engines, hf_target, tiny_prompts):
    """Per prompt, the server's verify rounds accept what the reference engine's rounds accept with the
    FP8-quantized drafter (rounds and the histogram of accepted drafts per round), on prompts where the
    unquantized drafter's rounds differ: the server drafts with the quantized linears."""
    _, tok = hf_target
    differ = 0
    for text in tiny_prompts:
        ids = prompt_ids(tok, text)
        reference, unquantized = engines[True].generate(ids, 32), engines[False].generate(ids, 32)
        got, meta = generate_ids(fp8_server, ids, 32)
        assert got == reference.token_ids
        histogram = [0] * (max(r.accepted for r in reference.rounds) + 1)
        for r in reference.rounds:
            histogram[r.accepted] += 1
        assert (meta["spec_verify_ct"], meta["spec_correct_drafts_histogram"]) == (len(reference.rounds), histogram), \
            f"prompt {text!r}"
        differ += [r.accepted for r in reference.rounds] != [r.accepted for r in unquantized.rounds]
    assert differ > 0  # some prompt tells FP8 drafting from unquantized drafting


def test_a_seeded_request_is_the_targets_own_sampling(fp8_server, hf_target, tiny_prompts):
    """T > 0 with top-p and min-p: a seeded request's tokens are plain autoregressive sampling of the
    target with its seed's coins, alone and among three unseeded requests."""
    model, tok = hf_target
    ids = prompt_ids(tok, tiny_prompts[2])
    law, n = dict(temperature=1.5, top_p=0.95, min_p=0.02), 20
    expected = reference_sample(model, ids, n, (1.5, TOP_K_ALL, 0.95, 0.02), seed=5)
    assert generate_ids(fp8_server, ids, n, **law, sampling_seed=5)[0] == expected

    def run(i):
        return generate_ids(fp8_server, ids, n if i == 0 else 2 * n, **law, **({"sampling_seed": 5} if i == 0 else {}))

    with admitted_together(fp8_server, 4), concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(run, range(4)))[0][0] == expected


# SGLang's own argument resolution of an MFD launch at device cuda, run on CPU with an H200's capacity (as
# tests/test_memory_plan.py does): the drafter quantization it resolves, MFD's reading of it and the plan's line.
RESOLVE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
import sglang.srt.arg_groups.memory_hook as memory_hook
import sglang.srt.utils.common as common
from sglang.srt.arg_groups.overrides import resolution_result
from sglang.srt.arg_groups.pipeline import run_resolution_pipeline
from sglang.srt.server_args import ServerArgs
import mfd_sglang.plugin
from mfd_sglang.serving.launch.options import draft_quantization

mfd_sglang.plugin.register()
common.get_device_memory_capacity = memory_hook.get_device_memory_capacity = lambda device=None: 143_771.0
extra = json.loads(sys.argv[2])
args = ServerArgs(model_path=sys.argv[1] + "/target", device="cuda", speculative_algorithm="MFD",
                  speculative_draft_model_path=sys.argv[1] + "/drafter", speculative_num_draft_tokens=17,
                  attention_backend="flashinfer", **extra)
try:
    run_resolution_pipeline(args)
except ValueError as exc:
    print(json.dumps({"error": str(exc)}))
    sys.exit(0)
method = resolution_result(args, "speculative_draft_model_quantization")
print(json.dumps({"method": method, "mfd": draft_quantization(args)}))
"""


def resolve(tiny_pair, **extra) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", RESOLVE, str(tiny_pair), json.dumps(extra)], cwd=REPO,
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, MFD_SGLANG_AUTO_BUDGET="0"))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1]), out.stderr


def planned_weights_mib(log: str) -> tuple[int, bool]:
    import re

    found = re.search(r"drafter weights (\d+) MiB( \(attention and MLP linears in FP8\))?", log)
    assert found, log[-3000:]
    return int(found.group(1)), found.group(2) is not None


def test_launch_reads_sglangs_draft_quantization_flag(tiny_pair):
    """--speculative-draft-model-quantization fp8 resolves to MFD's FP8 drafting and the launch's memory
    plan counts the quantized linears; unset or `unquant`, the drafter stays unquantized; a method MFD's
    drafter cannot run (awq) is refused at launch by a message naming the flag and what to pass."""
    methods = ("fp8", None, "unquant", "awq")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # each imports SGLang, on one core
        (fp8, fp8_log), *plains, (refused, _) = pool.map(lambda method: resolve(tiny_pair, **(
            {} if method is None else {"speculative_draft_model_quantization": method})), methods)
    assert fp8 == {"method": "fp8", "mfd": "fp8"}
    assert planned_weights_mib(fp8_log)[1]
    for plain, plain_log in plains:  # unset, unquant
        assert plain == {"method": None, "mfd": None} and not planned_weights_mib(plain_log)[1]
    assert "--speculative-draft-model-quantization awq" in refused["error"]
    assert "pass fp8 or unquant" in refused["error"]
