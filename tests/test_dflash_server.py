"""SGLang's own DFLASH (`--speculative-algorithm DFLASH`: its chain drafter and spec-V2 worker) in real CPU
servers through `python -m mfd_sglang.cpu.launch_server` (the hooks of `mfd_sglang/patches/cpu_dflash.py`),
fp32, overlap scheduling on: greedy output equals the target's plain greedy decoding token for token for
concurrent requests, with the accept length of the reference engine's chain rounds for the same drafter.

- The tiny pair with make-tiny's single-mode drafter (drafter-dflash): six requests at once; each one's
  verify rounds are also the reference engine's chain rounds with the same drafter (block 8: seven drafted
  tokens), so SGLang's DFlash drafter reads the checkpoint as this project's drafter does.
- SmolLM2-135M-Instruct with the shipped drafter `drafters/smollm2-135m/dflash`: three held-out chat
  prompts at once, accepting at least 95% of what the reference engine's chain rounds accept (SGLang
  drafts over the full vocabulary: it ignores the drafter's draft_vocab).
- SGLang's own argument resolution of a CPU DFLASH launch (a subprocess, as the launcher runs it): the
  drafter's block size, top-k 1, one step; the draft attention backend mfd_cpu by default, triton kept,
  any other replaced by mfd_cpu; a target attention backend without TARGET_VERIFY refused by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from conftest import target_greedy
from mfd_sglang.hf import SpeculativeGenerator
from servers import (admitted_together, chat_template_ids, free_port, generate_ids, launch_command, plugin_env,
                     served_without_leaks, start, start_server)

REPO = Path(__file__).resolve().parents[1]
SHIPPED_DRAFTER = REPO / "drafters" / "smollm2-135m" / "dflash"
MAX_NEW = 32


def generate_all(server, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], dict]]:
    """(output ids, meta_info) of greedy /generate requests, all in flight at once: admitted together (the
    server loads `plugin_env("hold_admission")`), so they share their first batch on any machine."""
    with admitted_together(server, len(prompts)), ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: generate_ids(server, ids, max_new_tokens), prompts))


def accept_length(metas: list[dict]) -> float:
    """SGLang's spec_accept_length over several requests: completion tokens per verify round."""
    return sum(m["completion_tokens"] for m in metas) / sum(m["spec_verify_ct"] for m in metas)


@pytest.fixture(scope="module")
def tiny_dflash_server(tiny_pair, tiny_dflash_drafter, tmp_path_factory):
    srv = start_server(tmp_path_factory, tiny_pair, tiny_dflash_drafter, "DFLASH", None, max_running=6,
                       extra_env=plugin_env("hold_admission"))
    yield from served_without_leaks(srv)


def test_tiny_pair_dflash_is_exact_for_concurrent_requests_with_the_chains_rounds(tiny_dflash_server, tiny_pair,
                                                                                  tiny_dflash_drafter, hf_target,
                                                                                  tiny_prompts):
    info = requests.get(tiny_dflash_server.base_url + "/server_info", timeout=60).json()
    assert (info["speculative_algorithm"], info["speculative_draft_attention_backend"], info["attention_backend"],
            info["dtype"], info["disable_overlap_schedule"]) == ("DFLASH", "mfd_cpu", "mfd_cpu", "float32", False)
    model, tokenizer = hf_target
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in tiny_prompts]
    served = generate_all(tiny_dflash_server, prompts, MAX_NEW)
    chain = SpeculativeGenerator.from_paths(tiny_pair / "target", tiny_dflash_drafter, tree="chain", budget=7,
                                            single_mode=True).generate_batch(prompts, MAX_NEW)
    for ids, (out, meta), reference in zip(prompts, served, chain):
        assert out == target_greedy(model, ids, MAX_NEW), (ids, out)
        assert meta["spec_verify_ct"] == len(reference.rounds), (ids, meta, [r.accepted for r in reference.rounds])
        assert meta["spec_accept_length"] == pytest.approx(MAX_NEW / meta["spec_verify_ct"])
    assert accept_length([meta for _, meta in served]) > 2.0


@pytest.fixture(scope="module")
def smollm2_dflash_server(tmp_path_factory):
    from mfd_sglang.lab import smollm2

    target = smollm2.prepare_target(progress=False).path
    port = free_port()
    cmd = launch_command(target, port=port, algorithm="DFLASH", drafter=SHIPPED_DRAFTER, dtype="float32",
                         extra_args=["--max-total-tokens", "4096", "--context-length", "1024",
                                     "--max-running-requests", "3", "--log-level", "warning"])
    folder = tmp_path_factory.mktemp("dflash_smollm2")
    env = dict(os.environ, HF_HUB_OFFLINE="1", SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="1",
               MFD_TEST_HOLD_FILE=str(folder / "hold_admission"), **plugin_env("hold_admission"))
    env.setdefault("OMP_NUM_THREADS", "2")
    srv = start(cmd, folder / "server.log", port=port, env=env)
    srv.target = target
    yield from served_without_leaks(srv)


def test_smollm2_dflash_with_the_shipped_drafter_is_exact_for_concurrent_chats(smollm2_dflash_server):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mfd_sglang.lab.prompts import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dflash_server.target)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dflash_server.target, dtype=torch.float32).eval()
    prompts = [chat_template_ids(tokenizer, [{"role": "user", "content": p.text}])
               for p in load_prompts("chat", split="heldout", limit=3)]
    served = generate_all(smollm2_dflash_server, prompts, MAX_NEW)
    for ids, (out, _) in zip(prompts, served):
        assert out == target_greedy(model, ids, MAX_NEW), tokenizer.decode(ids)
    chain = SpeculativeGenerator.from_paths(smollm2_dflash_server.target, SHIPPED_DRAFTER, tree="chain", budget=15,
                                            single_mode=True).generate_batch(prompts, MAX_NEW)
    reference = sum(len(r.token_ids) for r in chain) / sum(len(r.rounds) for r in chain)
    served_accept = accept_length([meta for _, meta in served])
    print(f"SmolLM2 DFLASH accept length {served_accept:.2f}, the reference engine's chain {reference:.2f}; "
          f"per request {[m['spec_verify_ct'] for _, m in served]} vs {[len(r.rounds) for r in chain]} rounds")
    # SGLang drafts over the full vocabulary, the reference engine over the drafter's draft_vocab: a round
    # apart here and there (1.20 vs 1.22 when written), where drafting without the context accepts next to
    # nothing (1.0).
    assert served_accept >= 0.95 * reference, (served_accept, reference)


RESOLVE = """
import json, sys
from mfd_sglang.cpu import prepare_environment
prepare_environment()  # what the CPU launcher does before SGLang is imported (MFD_SGLANG_CPU=1: the CPU hooks)
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.arg_groups.overrides import resolution_result
from sglang.srt.arg_groups.pipeline import run_resolution_pipeline
from sglang.srt.server_args import ServerArgs

pair = sys.argv[1]
for case, extra in [("default", {}), ("draft torch_native", {"speculative_draft_attention_backend": "torch_native"}),
                    ("draft triton", {"speculative_draft_attention_backend": "triton"}),
                    ("target torch_native", {"attention_backend": "torch_native"})]:
    args = ServerArgs(**{"model_path": pair + "/target", "device": "cpu", "speculative_algorithm": "DFLASH",
                         "speculative_draft_model_path": pair + "/drafter-dflash", "attention_backend": "mfd_cpu",
                         **extra})
    try:
        run_resolution_pipeline(args)
    except ValueError as e:
        print("RESOLVED", json.dumps({"case": case, "error": str(e)}))
        continue
    print("RESOLVED", json.dumps({"case": case, **{field: resolution_result(args, field) for field in (
        "speculative_draft_attention_backend", "speculative_num_draft_tokens", "speculative_eagle_topk",
        "speculative_num_steps")}}))
"""


def test_cpu_launch_resolves_dflash_with_a_cpu_draft_backend_and_refuses_a_target_without_verify(tiny_pair):
    proc = subprocess.run([sys.executable, "-c", RESOLVE, str(tiny_pair)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = {c.pop("case"): c for c in (json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
                                        if line.startswith("RESOLVED "))}
    chain = {"speculative_num_draft_tokens": 8, "speculative_eagle_topk": 1, "speculative_num_steps": 1}
    assert cases["default"] == {"speculative_draft_attention_backend": "mfd_cpu", **chain}
    assert cases["draft torch_native"] == {"speculative_draft_attention_backend": "mfd_cpu", **chain}
    assert "does not support attention_backend 'torch_native'" in proc.stderr
    assert cases["draft triton"] == {"speculative_draft_attention_backend": "triton", **chain}
    assert cases["target torch_native"]["error"].startswith(
        "DFLASH on CPU verifies its draft block in one TARGET_VERIFY forward, which attention backend 'torch_native' "
        "does not have: use --attention-backend mfd_cpu")
