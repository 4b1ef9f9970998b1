"""Real SGLang servers on a random Qwen3-4B-shaped target: MFD and MFD_D must emit exactly the
tokens of the same server without speculation (greedy, concurrent requests so that batches of
several requests are verified, through the tree-verify CUDA graphs on a GPU).

    python benchmarks/gpu_check.py --only servers                      # on a GPU with SGLang 0.5.23 installed
    python benchmarks/gpu_check.py --only servers --quick --device cpu # tiny shapes, fp32, the CPU launcher

The target is written as a Hugging Face Qwen3 checkpoint (random weights, the width of Qwen3-4B,
fewer layers: exactness does not depend on depth, start-up time does) with a random K = 8 drafter;
requests go by token ids (`--skip-tokenizer-init`: no tokenizer exists).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mfd_sglang.checkpoint import save_drafter
from mfd_sglang.server_process import ServerProcess, free_port, generate_ids, launch_command
from round_cost import TargetConfig, drafter_raw_config, random_drafter, spread_layer_ids

SERVERS = [("plain", None), ("MFD", "MFD"), ("MFD_D", "MFD_D")]


def write_random_pair(outdir: Path, cfg: TargetConfig, num_modes: int, device: str) -> tuple[Path, Path]:
    """OUTDIR/target (HF Qwen3, random weights) and OUTDIR/drafter (MFD, random weights)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_eps,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3ForCausalLM(config)
    target.save_pretrained(outdir / "target", safe_serialization=True)
    layer_ids = spread_layer_ids(cfg.layers, cfg.draft_layers)
    drafter = random_drafter(cfg, layer_ids, num_modes, seed=1, device=device, dtype=torch.float32)
    save_drafter(outdir / "drafter", drafter_raw_config(cfg, layer_ids, num_modes), drafter.checkpoint_weights())
    return outdir / "target", outdir / "drafter"


def serve_and_generate(target: Path, drafter: Path, algorithm: str | None, prompts: list[list[int]], *,
                       device: str, dtype: str, attention: str | None, budget: int, max_new_tokens: int,
                       logdir: Path) -> dict:
    """Start one server, send every prompt at once, stop it; token ids and acceptance per prompt."""
    port = free_port()
    extra = ["--skip-tokenizer-init", "--max-running-requests", str(len(prompts)), "--mem-fraction-static", "0.6"]
    if attention is not None:  # the same kernels for every server: exactness compares like with like
        extra += ["--attention-backend", attention]
    cmd = launch_command(target, port=port, algorithm=algorithm, drafter=drafter, budget=budget, device=device,
                         dtype=dtype, extra_args=extra)
    start = time.perf_counter()
    log = logdir / f"{algorithm or 'plain'}-{dtype}.log"
    with ServerProcess(cmd, log, port=port, startup_timeout=600) as server:
        ready = time.perf_counter() - start
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: generate_ids(server, p, max_new_tokens), prompts))
    return {"ids": [ids for ids, _ in outs], "startup_s": round(ready, 1),
            "accept_length": [meta.get("spec_accept_length") for _, meta in outs]}


def server_section(device: str, quick: bool) -> list[dict]:
    """One row per speculative server and precision: exact (all prompts equal the plain server's),
    first divergence per prompt. fp32 must be exact; bf16 may part after a near-tie (the verify
    forward and the one-token decode round differently), which the row shows."""
    cfg = TargetConfig.tiny() if quick else dataclasses.replace(TargetConfig.qwen3_4b(), layers=8, draft_layers=2)
    # (dtype, attention backend): fp32 runs on Triton (FlashInfer has no fp32 kernels).
    precisions = [("float32", None)] if device == "cpu" else [("float32", "triton"), ("bfloat16", "flashinfer")]
    gen = torch.Generator().manual_seed(2)
    lengths = (5, 17, 40) if quick else (7, 60, 200, 500)
    prompts = [torch.randint(0, cfg.vocab - 1, (n,), generator=gen).tolist() for n in lengths]
    max_new_tokens, budget = (24, 16) if quick else (96, 64)
    with tempfile.TemporaryDirectory(prefix="mfd-server-exactness-") as tmp:
        tmp = Path(tmp)
        target, drafter = write_random_pair(tmp, cfg, num_modes=8, device="cpu" if quick else device)
        rows = []
        for dtype, attention in precisions:
            results = {name: serve_and_generate(target, drafter, algorithm, prompts, device=device, dtype=dtype,
                                                attention=attention, budget=budget, max_new_tokens=max_new_tokens,
                                                logdir=tmp)
                       for name, algorithm in SERVERS}
            plain = results["plain"]["ids"]
            for name, _ in SERVERS[1:]:
                ids = results[name]["ids"]
                diverge = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ids, plain)]
                rows.append({"server": name, "dtype": dtype, "attention": attention or "default", "B": budget,
                             "prompts": len(prompts), "max_new_tokens": max_new_tokens, "exact": ids == plain,
                             "first_divergence": diverge, "accept_length": results[name]["accept_length"],
                             "startup_s": results[name]["startup_s"], "plain_startup_s": results["plain"]["startup_s"]})
    return rows


def print_server_rows(rows: list[dict]) -> None:
    print("\nSGLang servers vs the same server without speculation (greedy token ids)")
    for r in rows:
        print(f"  {r['server']:>6} {r['dtype']} {r['attention']} B={r['B']}: {'EXACT' if r['exact'] else 'DIFFERS'} "
              f"({r['prompts']} concurrent prompts x {r['max_new_tokens']} tokens; first divergence "
              f"{r['first_divergence']}; accept length {r['accept_length']})")

