"""Real SGLang servers on a random Qwen3-4B-shaped target: MFD and MFD_D must emit exactly the
tokens of the same server without speculation (greedy, 8 concurrent requests so that batches of
several requests are verified).

    python benchmarks/gpu_check.py --only servers                      # on a GPU (SGLang from the device kit)
    python benchmarks/gpu_check.py --only servers --quick --device cpu # tiny shapes, fp32, the CPU launcher

On a GPU the matrix is {fp32, bf16} x {CUDA graphs + overlap scheduling on, graphs off}, plus fp32 with
graphs, overlap and KV pages of 16 tokens, each with a plain, an MFD (K = 8, B = 64) and an MFD_D
server, and on a GPU also an MFD_D server with the automatic budget (MFD_SGLANG_AUTO_BUDGET=1: draft
and verify graphs per budget, plain-decoding rounds; its row also requires the start-up log to list a
verify graph for every candidate budget's window, and the memory the extra windows took (torch's
reserved memory of that server's process) to be within what the launch plan counted for them; on CPU
tests/test_auto_budget.py holds it); the servers of one graph setting start together (one H200 holds
them all; start-up dominates the time). On a CPU: fp32 only, eager, one at a time, plain and MFD_D only.
The target is written as a Hugging Face Qwen3 checkpoint (random weights, the width of Qwen3-4B,
fewer layers: exactness does not depend on depth, start-up time does) with a random K = 8 drafter;
requests go by token ids (`--skip-tokenizer-init`: no tokenizer exists).

A row is `ok` when every request of both servers completed with all its tokens and, in fp32, the
token ids equal the plain server's. bf16 rows record exactness without requiring it: the verify
forward (many tokens) and the one-token decode round differently, so a near-tie of a random model
can part them; the row shows where (`first_divergence`).

Attention: `triton` in fp32 (FlashInfer has no fp32 kernels) and in bf16 unless FlashInfer is
importable; the device kit carries no FlashInfer (it compiles its kernels with nvcc at first use,
longer than a device call), so on the device every row says `attention: triton` and why.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mfd_sglang.checkpoint import save_drafter
from mfd_sglang.serving.budget import candidate_budgets
from mfd_sglang.server_process import ServerProcess, free_port, generate_ids, launch_command
from round_cost import TargetConfig, drafter_raw_config, random_drafter, spread_layer_ids

# (row name, algorithm, extra environment)
SERVERS = [("plain", None, {}), ("MFD", "MFD", {}), ("MFD_D", "MFD_D", {})]
AUTO_SERVER = ("MFD_D auto", "MFD_D", {"MFD_SGLANG_AUTO_BUDGET": "1"})


def servers(device: str) -> list[tuple[str, str | None, dict]]:
    # On a CPU (the smoke run) plain and MFD_D: tests/test_mfd_server.py holds MFD's CPU servers.
    return [SERVERS[0], SERVERS[2]] if device == "cpu" else [*SERVERS, AUTO_SERVER]


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


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    dtype: str
    cuda_graphs: bool  # on a GPU: graphs and overlap scheduling on together, or both off
    attention: str | None
    attention_note: str
    page_size: int = 1

    @property
    def name(self) -> str:
        return f"{self.dtype}-{'graphs' if self.cuda_graphs else 'eager'}-page{self.page_size}"


def attention_choice(dtype: str) -> tuple[str, str]:
    """(backend, why) for a GPU server of this dtype; every server of a config uses the same one."""
    if dtype == "float32":
        return "triton", "fp32: FlashInfer has no fp32 kernels"
    if importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer", "FlashInfer is importable"
    return "triton", "FlashInfer is not installed (the device kit carries none)"


def server_configs(device: str) -> list[ServerConfig]:
    if device == "cpu":  # the CPU launcher's defaults: mfd_cpu attention, no graphs, no overlap
        return [ServerConfig("float32", False, None, "CPU launcher default (mfd_cpu)")]
    # Pages of 16 tokens once, with graphs and overlap: verify windows, accepted-KV moves and the
    # graphs' buffers across page boundaries, exact in fp32. The servers start in this order.
    graphs = [ServerConfig(dtype, True, *attention_choice(dtype)) for dtype in ("float32", "bfloat16")]
    paged = ServerConfig("float32", True, *attention_choice("float32"), page_size=16)
    eager = [ServerConfig(dtype, False, *attention_choice(dtype)) for dtype in ("float32", "bfloat16")]
    return [*graphs, paged, *eager]


def standin_env() -> dict:
    """Server environment when `sgl_kernel` is this project's pure-torch stand-in rather than the CUDA
    wheel: SGLang's fused ops then take their torch reference path (`forward_native`), and its start-up
    check for an installed `sglang-kernel` wheel (CUDA only) is skipped: the stand-in is no wheel."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is not None and "sgl_kernel_standin" in str(spec.origin):
        return {"SGLANG_FORCE_FUSED_OP_BACKEND": "torch",  # KernelBackend.TORCH: forward_native
                "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1"}
    return {}


def serve_and_generate(target: Path, drafter: Path, algorithm: str | None, prompts: list[list[int]], *,
                       device: str, config: ServerConfig, budget: int, max_new_tokens: int, logdir: Path,
                       mem_fraction: float, startup_timeout: float, name: str = "", env: dict | None = None,
                       extra_args: tuple[str, ...] = (), then_one_by_one: bool = False) -> dict:
    """Start one server, send every prompt at once (`then_one_by_one`: then each again alone, from the
    radix cache), stop it; token ids and acceptance per prompt, or the error that stopped it."""
    port = free_port()
    extra = ["--skip-tokenizer-init", "--max-running-requests", str(len(prompts)),
             "--mem-fraction-static", str(mem_fraction), *extra_args]
    if device != "cpu":
        extra += ["--max-total-tokens", "32768"]  # several servers share the GPU: bound each KV pool
        if not config.cuda_graphs:
            extra += ["--disable-cuda-graph", "--disable-overlap-schedule"]
    if config.attention is not None:  # the same kernels for every server: exactness compares like with like
        extra += ["--attention-backend", config.attention]
    if config.page_size != 1:
        extra += ["--page-size", str(config.page_size)]
    cmd = launch_command(target, port=port, algorithm=algorithm, drafter=drafter, budget=budget, device=device,
                         dtype=config.dtype, extra_args=extra)
    log = logdir / f"{(name or algorithm or 'plain').replace(' ', '-')}-{config.name}.log"
    start = time.perf_counter()
    try:
        with ServerProcess(cmd, log, port=port, env={**os.environ, **standin_env(), **(env or {})},
                           startup_timeout=startup_timeout) as server:
            ready = time.perf_counter() - start
            with ThreadPoolExecutor(len(prompts)) as pool:
                outs = list(pool.map(lambda p: generate_ids(server, p, max_new_tokens), prompts))
            if then_one_by_one:
                outs += [generate_ids(server, p, max_new_tokens) for p in prompts]
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    # The automatic budget's per-window verify graphs, as the worker logged them at start-up, and the
    # memory the launch plan counted for them.
    text = log.read_text()
    captured = re.search(r"tree-verify CUDA graphs captured for windows of \[([\d, ]*)\] tokens per request "
                         r"\(the extra widths took (-?\d+) MiB", text)
    planned = re.search(r"verify graphs of the other windows (\d+) MiB", text)
    return {"ids": [ids for ids, _ in outs], "startup_s": round(ready, 1),
            "accept_length": [meta.get("spec_accept_length") for _, meta in outs],
            "verify_graph_widths": [int(w) for w in captured.group(1).split(",")] if captured else None,
            "verify_graph_mib": {"measured": int(captured.group(2)) if captured else None,
                                 "planned": int(planned.group(1)) if planned else None}}


def compare(name: str, config: ServerConfig, spec: dict, plain: dict, budget: int, prompts: list[list[int]],
            max_new_tokens: int) -> dict:
    row = {"server": name, "dtype": config.dtype, "cuda_graphs": config.cuda_graphs,
           "overlap": config.cuda_graphs, "page_size": config.page_size, "attention": config.attention or "default",
           "attention_note": config.attention_note, "B": budget, "prompts": len(prompts),
           "max_new_tokens": max_new_tokens, "exact_required": config.dtype == "float32"}
    errors = [f"{who}: {r['error']}" for who, r in ((name, spec), ("plain", plain)) if "error" in r]
    if errors:
        return {**row, "ok": False, "exact": False, "error": "\n".join(errors)}
    ids, ref = spec["ids"], plain["ids"]
    complete = all(len(x) == max_new_tokens for x in ids + ref)
    exact = ids == ref
    graphs_ok = True
    if name == AUTO_SERVER[0] and config.cuda_graphs:  # a verify graph for every budget it may play,
        row["verify_graph_widths"] = spec.get("verify_graph_widths")  # within the memory planned for them
        row["verify_graph_mib"] = mib = spec.get("verify_graph_mib") or {}
        graphs_ok = (row["verify_graph_widths"] == [b + 1 for b in candidate_budgets(budget)]
                     and None not in (mib.get("measured"), mib.get("planned")) and mib["measured"] <= mib["planned"])
    row.update(exact=exact, complete=complete, ok=complete and graphs_ok and (exact or not row["exact_required"]),
               first_divergence=[next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                                 for x, y in zip(ids, ref)],
               accept_length=spec["accept_length"], startup_s=spec["startup_s"],
               plain_startup_s=plain["startup_s"])
    return row


def server_section(device: str, quick: bool) -> list[dict]:
    """One row per speculative server and config (see the module docstring for what `ok` means)."""
    cfg = TargetConfig.tiny() if quick else dataclasses.replace(TargetConfig.qwen3_4b(), layers=8, draft_layers=2)
    gen = torch.Generator().manual_seed(2)
    lengths = (5, 17, 40, 9) if quick else (7, 40, 100, 180, 260, 350, 430, 500)
    prompts = [torch.randint(0, cfg.vocab - 1, (n,), generator=gen).tolist() for n in lengths]
    max_new_tokens, budget = (24, 16) if quick else (96, 64)
    configs = server_configs(device)
    # On a GPU every server of one graph setting starts at once (start-up is most of the time);
    # on a CPU one at a time (2 cores).
    parallel = 1 if device == "cpu" else len(servers(device)) * 2
    mem_fraction, startup_timeout = (0.6, 600) if device == "cpu" else (0.5, 300)
    with tempfile.TemporaryDirectory(prefix="mfd-server-exactness-") as tmp:
        tmp = Path(tmp)
        target, drafter = write_random_pair(tmp, cfg, num_modes=8, device="cpu" if quick else device)
        jobs = [(config, *server) for config in configs for server in servers(device)]
        with ThreadPoolExecutor(parallel) as pool:
            results = dict(zip(
                [(c.name, n) for c, n, _, _ in jobs],
                pool.map(lambda job: serve_and_generate(
                    target, drafter, job[2], prompts, device=device, config=job[0], budget=budget,
                    max_new_tokens=max_new_tokens, logdir=tmp, mem_fraction=mem_fraction,
                    startup_timeout=startup_timeout, name=job[1], env=job[3]), jobs)))
        return [compare(name, config, results[(config.name, name)], results[(config.name, "plain")], budget,
                        prompts, max_new_tokens)
                for config in configs for name, _, _ in servers(device)[1:]]


# (row name, algorithm, extra environment, tree budget) of the hybrid target's servers
HYBRID_SERVERS = [("plain", None, {}, 8), ("MFD", "MFD", {}, 8), ("MFD_D auto", "MFD_D", {"MFD_SGLANG_AUTO_BUDGET": "1"}, 16)]


def hybrid_server_section(device: str, quick: bool) -> list[dict]:
    """A hybrid Gated DeltaNet target (`make-tiny --hybrid`: Qwen3.5-shaped, two GDN layers and one
    full-attention layer, trained on the tiny language, with its MFD drafter; fp32) in a plain, an MFD
    (B = 8) and an MFD_D automatic-budget server, on a GPU with CUDA graphs and overlap on: 7 prompts at
    once over 8-token prefill chunks, then each again alone (radix-cache hits: a cached prefix's
    recurrent state). A row is `ok` when every token equals the plain server's. On a CPU
    tests/test_hybrid_target.py holds the same servers to HF's greedy decoding."""
    from mfd_sglang.lab.tiny import make_tiny

    config = (ServerConfig("float32", False, None, "CPU launcher default (mfd_cpu)") if device == "cpu"
              else ServerConfig("float32", True, *attention_choice("float32")))
    max_new_tokens, parallel = 24, 1 if device == "cpu" else len(HYBRID_SERVERS)
    with tempfile.TemporaryDirectory(prefix="mfd-hybrid-exactness-") as tmp:
        tmp = Path(tmp)
        pair = make_tiny(tmp / "pair", seed=0, num_modes=4, hybrid=True, log=lambda *a: None)
        vocab = json.loads((pair / "target" / "config.json").read_text())["vocab_size"]
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(12, vocab, (n,), generator=gen).tolist() for n in (3, 9, 14, 21, 33, 40)]
        prompts.append(prompts[4][:20] + prompts[1])  # shares a 20-token prefix with another
        # Bounded pools: on a GPU the three servers start together.
        extra = ("--chunked-prefill-size", "8", "--context-length", "512", "--max-mamba-cache-size", "64")
        with ThreadPoolExecutor(parallel) as pool:
            results = list(pool.map(lambda server: serve_and_generate(
                pair / "target", pair / "drafter", server[1], prompts, device=device, config=config,
                budget=server[3], max_new_tokens=max_new_tokens, logdir=tmp, mem_fraction=0.6 if device == "cpu" else 0.2,
                startup_timeout=600, name=f"hybrid {server[0]}", env=server[2], extra_args=extra,
                then_one_by_one=True), HYBRID_SERVERS))
        plain = results[0]
        return [{**compare(server[0], config, result, plain, server[3], prompts, max_new_tokens),
                 "target": "make-tiny --hybrid (Qwen3.5-shaped)", "then_one_by_one": True}
                for server, result in zip(HYBRID_SERVERS[1:], results[1:])]


def print_server_rows(rows: list[dict], target: str = "random Qwen3-4B-width target") -> None:
    print(f"\nSGLang servers vs the same server without speculation (greedy token ids), {target}")
    for r in rows:
        mode = "graphs+overlap" if r["cuda_graphs"] else "eager"
        head = f"  {r['server']:>6} {r['dtype']:>8} {mode:>14} page {r.get('page_size', 1):>2} {r['attention']} B={r['B']}:"
        if "error" in r:
            print(f"{head} ERROR {r['error'].strip().splitlines()[0]}")
            continue
        verdict = "EXACT" if r["exact"] else ("DIFFERS" if r["exact_required"] else "differs (bf16, not required)")
        print(f"{head} {verdict}{'' if r['complete'] else ' INCOMPLETE'} ({r['prompts']} concurrent prompts"
              f"{', then each alone' if r.get('then_one_by_one') else ''} x "
              f"{r['max_new_tokens']} tokens; first divergence {r['first_divergence']}; "
              f"accept length {r['accept_length']})")
    notes = sorted({f"{r['dtype']}: {r['attention']} ({r['attention_note']})" for r in rows})
    if notes:
        print("  attention: " + "; ".join(notes))
