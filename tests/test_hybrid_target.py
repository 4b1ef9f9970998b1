"""A hybrid Gated DeltaNet target (Qwen3.5-shaped, `make-tiny --hybrid`: two GDN layers, then full
attention) in real SGLang servers on CPU with MFD (B = 8) and MFD_D under the automatic budget (up to
B = 16: budgets 0 / 4 / 8 / 16 on both drafting paths, as it explores). SGLang's own hybrid
linear-attention backend runs on the stand-in's GDN ops (their prefill / decode / verify forms are held
to the tree reference in tests/test_gdn_standin.py); MFD verifies its tree through the backend's tree
path (each node's convolution over its ancestors, its recurrent state from its parent's) and commits
the state after the last accepted node. Both servers must give HF's greedy decoding token for token
(fp32), under concurrency, across chunked prefills (each chunk starts from the state the last one
left) and from radix-cache hits (a cached prefix's recurrent state instead of a full prefill). The
launcher adds what hybrid targets need on CPU by itself. (With the tree verified as a chain, the bug
this guards against, 2 of 8 such prompts came out wrong at B = 8.) Which arms the automatic budget times
after its first ones depends on round times, so only those first ones are checked."""

from __future__ import annotations

import concurrent.futures
import os
import random
import re

import pytest
import torch

from conftest import target_greedy
from mfd_sglang.server_process import launch_command
from servers import admitted_together, free_port, generate_ids, plugin_env, start

MAX_NEW = 24
SERVERS = {"MFD B=8": ("MFD", 8), "MFD_D auto": ("MFD_D", "auto")}


@pytest.fixture(scope="module")
def hybrid_prompts(hybrid_pair) -> list[list[int]]:
    """The pair's chat-free prompts and random word-id prompts of up to 40 tokens (longer than the
    8-token prefill chunks), the last sharing its first 20 tokens with another (a radix-cache hit once
    that one ran)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hybrid_pair / "target")
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("one two three four", "we may go home")]
    rng = random.Random(0)
    prompts += [[rng.randrange(12, len(tok)) for _ in range(n)] for n in (3, 14, 33, 40)]
    return prompts + [prompts[4][:20] + prompts[2]]


@pytest.fixture(scope="module")
def hybrid_greedy(hybrid_pair, hybrid_prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hybrid_pair / "target", dtype=torch.float32).eval()
    return [target_greedy(model, p, MAX_NEW) for p in hybrid_prompts]


@pytest.fixture(scope="module", params=list(SERVERS))
def hybrid_server(request, hybrid_pair, tmp_path_factory):
    algorithm, budget = SERVERS[request.param]
    port = free_port()
    log = tmp_path_factory.mktemp("hybrid_server") / "server.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", MFD_SGLANG_AUTO_BUDGET=str(int(budget == "auto")),
               MFD_TEST_HOLD_FILE=str(log.parent / "hold_admission"), **plugin_env("hold_admission"))
    env.setdefault("OMP_NUM_THREADS", "2")
    cmd = launch_command(hybrid_pair / "target", port=port, dtype="float32", algorithm=algorithm,
                         drafter=hybrid_pair / "drafter", budget=16 if budget == "auto" else budget, extra_args=[
                             "--context-length", "512", "--max-running-requests", "8", "--chunked-prefill-size", "8"])
    srv = start(cmd, log, port=port, env=env)
    srv.auto_budget = budget == "auto"
    yield srv
    srv.stop()


def test_the_launcher_adds_what_hybrid_targets_need(hybrid_pair):
    from mfd_sglang.cpu.launch_server import HYBRID_CPU_DEFAULTS, apply_cpu_defaults, hybrid_target

    assert hybrid_target(["--model-path", str(hybrid_pair / "target")])
    _, added = apply_cpu_defaults(["--model-path", str(hybrid_pair / "target"), "--max-mamba-cache-size", "64"])
    assert [f for f, _ in HYBRID_CPU_DEFAULTS if f != "--max-mamba-cache-size"] == \
        [f for f, _ in added if f in dict(HYBRID_CPU_DEFAULTS)]  # the user's value wins
    assert not hybrid_target(["--model", "not/a/local/dir"])


def test_the_tree_path_hooks_apply_to_mfd_only(monkeypatch):
    """What makes SGLang verify MFD's tree on a hybrid: the linear-attention backend's tree path (top-k > 1)
    on MFD target runners only, and dense per-step conv windows while MFD is served (the deduplicated
    ones assume a chain; they exist on CUDA only, so this is the only CPU check of that hook)."""
    from types import SimpleNamespace

    import sglang.srt.runtime_context as runtime_context

    from mfd_sglang.patches.hybrid_tree_verify import dense_conv_windows_around, tree_path_after

    for algorithm, draft, want in (("MFD_D", False, 2), ("EAGLE", False, 1), ("MFD", True, 1)):
        backend = SimpleNamespace(topk=1)
        runner = SimpleNamespace(spec_algorithm=SimpleNamespace(name=algorithm), is_draft_worker=draft)
        tree_path_after(None, backend, runner)
        assert backend.topk == want, (algorithm, draft)
    dedup = lambda *args: True  # noqa: E731  (SGLang's answer for a CUDA chain)
    for algorithm, want in (("MFD", False), ("MFD_D", False), ("EAGLE", True), (None, True)):
        monkeypatch.setattr(runtime_context, "get_spec", lambda: SimpleNamespace(speculative_algorithm=algorithm))
        assert dense_conv_windows_around(dedup, False, False, 1, False) is want, algorithm


def test_concurrent_chunked_and_cached_prefills_match_hf_greedy(hybrid_server, hybrid_prompts, hybrid_greedy):
    assert len({tuple(w) for w in hybrid_greedy}) >= 5, "the continuations must differ (a constant answer proves little)"
    with admitted_together(hybrid_server, len(hybrid_prompts)), \
            concurrent.futures.ThreadPoolExecutor(len(hybrid_prompts)) as pool:  # one batch on any machine
        together = list(pool.map(lambda p: generate_ids(hybrid_server, p, MAX_NEW), hybrid_prompts))
    assert [ids for ids, _ in together] == hybrid_greedy
    # Again one at a time: every prompt now starts from a cached prefix (its own, or a shared one).
    alone = [generate_ids(hybrid_server, p, MAX_NEW) for p in hybrid_prompts]
    assert [ids for ids, _ in alone] == hybrid_greedy
    assert max(meta.get("cached_tokens", 0) for _, meta in alone) > 0, "no radix-cache hit happened"
    # The trees were verified and accepted, not bypassed: at B = 8 as the drafter's greedy acceptance makes
    # it; under the automatic budget (which may choose budget 0 after) at least in its first rounds, where it
    # plays each drafting path's largest tree whatever the round times.
    rounds = sum(meta["spec_verify_ct"] for _, meta in together + alone)
    assert rounds < (1 if hybrid_server.auto_budget else 0.5) * MAX_NEW * len(together + alone)
    log = hybrid_server.log_path.read_text()
    assert "--mamba-radix-cache-strategy no_buffer" in log and "--disable-overlap-schedule" in log
    if hybrid_server.auto_budget:
        played = set(re.findall(r"timing (budget \d+, [\w-]+ draft)", log))
        assert {"budget 16, K-mode draft", "budget 16, single-mode draft"} <= played, played
