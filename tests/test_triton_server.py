"""The GPU's serving path in a real SGLang server on CPU: `--mfd-kernels triton` runs every step of MFD's round
on the Triton kernels (draft: block input, norm + rope, residual norms, SiLU x up, mode attention over the pool
read in place, lm_head + top-B and its finish; the mixture tree; the verify layout and mask; the accept walk;
the commit's rows), under the Triton interpreter (the CPU launcher sets TRITON_INTERPRET=1), over the tensors
SGLang hands the worker (its int32 request table, its logits, its KV slots). What a GPU adds is not here: CUDA
graphs, the kernels' compiled code (the interpreter runs their Python semantics), real timings.

One MFD_D server (B = 8, switch at 2 running requests), fp32: three requests at once (the single-mode path,
batched kernels) and one request alone (the K-mode path), the alone one greedy and then seeded at T > 0;
every token equal to the target's own greedy decoding or, sampled, to plain autoregressive sampling with the
request's seed; the rounds accept long paths (mean tokens per round bounded below), and the worker logs that
it runs the Triton kernels.
"""

from __future__ import annotations

import concurrent.futures
import re

import pytest

from conftest import target_greedy
from references import TOP_K_ALL, reference_sample
from servers import admitted_together, generate_ids, log_tail, plugin_env, served_without_leaks, start_server

MAX_NEW = 16
MIN_MEAN_ACCEPT = 3.0  # tokens per round; the tiny pair accepts ~5 at B = 8 (greedy, alone)


@pytest.fixture(scope="module")
def triton_server(tiny_pair, tmp_path_factory):
    srv = start_server(tmp_path_factory, tiny_pair, tiny_pair / "drafter", "MFD_D", 8, threshold=2, log_level="info",
                       extra_args=("--mfd-kernels", "triton"), extra_env=plugin_env("hold_admission"))
    yield from served_without_leaks(srv)


def test_the_worker_runs_the_triton_kernels(triton_server):
    worker = re.search(r"MFD_D worker: .* kernels (\w+) \(--mfd-kernels (\w+)\), drafter context ([\w ]+)",
                       triton_server.log())
    assert worker and worker.groups() == ("triton", "triton", "read in place"), log_tail(triton_server.log_path)


def test_batched_and_single_requests_equal_greedy_and_accept_long_paths(triton_server, hf_target, tiny_prompts):
    model, tok = hf_target
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in tiny_prompts[:3]]
    with admitted_together(triton_server, 3), concurrent.futures.ThreadPoolExecutor(3) as pool:  # one batch
        batched = list(pool.map(lambda ids: generate_ids(triton_server, ids, MAX_NEW), prompts))
    alone = generate_ids(triton_server, prompts[0], MAX_NEW)
    for ids, (got, _) in zip(prompts + prompts[:1], batched + [alone]):
        assert got == target_greedy(model, ids, MAX_NEW), log_tail(triton_server.log_path)
    assert "switching to the single-mode path" in triton_server.log(), log_tail(triton_server.log_path)
    metas = [meta for _, meta in batched + [alone]]
    mean_accept = sum(m["completion_tokens"] for m in metas) / sum(m["spec_verify_ct"] for m in metas)
    print(f"mean accept length {mean_accept:.2f} (alone: {alone[1]['spec_accept_length']:.2f})")
    assert mean_accept >= MIN_MEAN_ACCEPT, [m["spec_accept_length"] for m in metas]


def test_a_seeded_request_samples_as_plain_decoding(triton_server, hf_target, tiny_prompts):
    model, tok = hf_target
    ids = tok(tiny_prompts[2], add_special_tokens=False)["input_ids"]
    expected = reference_sample(model, ids, MAX_NEW, (1.5, TOP_K_ALL, 0.95, 0.02), seed=3)
    got, _ = generate_ids(triton_server, ids, MAX_NEW, temperature=1.5, top_p=0.95, min_p=0.02, sampling_seed=3)
    assert got == expected
    assert expected != target_greedy(model, ids, MAX_NEW)  # the law has real spread
