"""FP8 drafting: the drafter's attention and MLP linears in e4m3 (`mfd_sglang.fp8`, a server's
--speculative-draft-model-quantization fp8) against the unquantized drafter, in the same run.

    fp8_rows("cuda", quick=False)   # the GPU check's part 2: Qwen3-4B shapes, bf16, CUDA graphs, bs 1 / 8 / 32
    fp8_rows("cpu", quick=True)     # tiny shapes, fp32, eager, bs 1 / 2 (tests/test_fp8.py)

Rows, in order:
  linear  (`ok`) per distinct quantized linear shape of the drafter and row count (one bs-1 block of K modes,
          and bs 32's): FP8Linear's output (on CUDA `torch._scaled_mm`) against the float64 product of its
          dequantized operands (the same quantized input and weight), in bf16 and float32 output; ok when the
          largest difference is within 2^-7 (bf16) / 2^-10 (float32) of the output's largest magnitude and
          its activation quantization (on CUDA the Triton kernel) is bit-equal to `quantize_rows`; with the
          ms of the FP8 layer and of the unquantized linear;
  round   per batch size and config (MFD: K = 8; MFD_D: its single-mode path) at B = 64, the round of
          `mfd_sglang/round_cost.py` (draft + tree + verify + commit, each a CUDA graph on a GPU) with the unquantized
          drafter and with an FP8 copy of it: draft and round ms of both, the round cost (in plain decode
          steps) of both and FP8's speed-up of each; `ok` when the FP8 round replayed from its graphs equals
          the same round run eagerly (`graphs_match_eager`: tree, accepted path, every cache write).
The random target accepts ~nothing, which does not change a round's cost (every shape is fixed).
"""

from __future__ import annotations

import copy
from typing import Iterator

import torch
import torch.nn.functional as F

from mfd_sglang.drafter import fp8_linear_shapes
from mfd_sglang.fp8 import FP8Linear, quantize_activations, quantize_rows
from mfd_sglang.round_cost import (BUDGET, CONFIGS, SpecRound, StaticTarget, TargetConfig, capture_decode_step,
                                   capture_round, graphs_match_eager, random_drafter, replay_ms)
from mfd_sglang.timing import mean_ms

ROUND_CONFIGS = ("mfd", "mfd_d")
# bf16: the output's rounding (2^-9) and more; float32: Hopper's FP8 MMA accumulates with fewer bits than
# float32 between its promotions to float32
TOLERANCE = {torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -10}


def linear_rows(device: str, shapes: list[tuple[int, int]], row_counts: tuple[int, ...],
                repeats: int) -> Iterator[dict]:
    """FP8Linear against the float64 product of its dequantized operands, per shape, row count and output
    dtype (see the module docstring); also whether its activation quantization (the Triton kernel on CUDA)
    is bit-equal to `quantize_rows`, and the ms of the layer and of the unquantized linear."""
    gen = torch.Generator(device).manual_seed(0)
    for (out_features, in_features), rows in ((s, m) for s in sorted(set(shapes)) for m in row_counts):
        weight = torch.randn(out_features, in_features, generator=gen, device=device) * in_features ** -0.5
        x = torch.randn(rows, in_features, generator=gen, device=device)
        for dtype in (torch.bfloat16, torch.float32):
            layer, inputs = FP8Linear(weight.to(dtype), None), x.to(dtype)
            layer.backend = "triton" if x.is_cuda else "torch"  # as a served drafter's on CUDA
            q_x, x_scale = quantize_rows(inputs)
            fused_q, fused_scale = quantize_activations(inputs, layer.backend)
            same_quantization = torch.equal(fused_q.view(torch.uint8), q_x.view(torch.uint8)) and torch.equal(
                fused_scale, x_scale)
            want = ((q_x.double() * x_scale.double())
                    @ (layer.weight.double() * layer.weight_scale.double()[:, None]).T)
            got = layer(inputs).double()
            error = ((got - want).abs().max() / want.abs().max()).item()
            unquantized = weight.to(dtype)
            yield {"kind": "linear", "out": out_features, "in": in_features, "rows": rows,
                   "dtype": str(dtype).removeprefix("torch."),
                   "path": "scaled_mm" if x.is_cuda and layer.on_tensor_cores else "reference",
                   "max_rel_error": round(error, 7), "quantization_bit_equal": same_quantization,
                   "linear_ms": round(mean_ms(lambda: F.linear(inputs, unquantized), device, repeats), 4),
                   "fp8_ms": round(mean_ms(lambda: layer(inputs), device, repeats), 4),
                   "ok": error <= TOLERANCE[dtype] and same_quantization}


def fp8_rows(device: str, quick: bool, batch_sizes: tuple[int, ...] | None = None) -> Iterator[dict]:
    """The linear rows, then the round rows (see the module docstring), a row at a time."""
    cfg = TargetConfig.tiny() if quick else TargetConfig.qwen3_4b()
    use_graph = device.startswith("cuda")
    dtype = torch.bfloat16 if use_graph and not quick else torch.float32
    batch_sizes = batch_sizes or ((1, 2) if quick else (1, 8, 32))
    prompt_len, repeats = (16, 3) if quick else (512, 20)
    modes = CONFIGS[ROUND_CONFIGS[0]][0]
    target = StaticTarget(cfg, device, dtype, seed=0)
    drafters = {"base": random_drafter(cfg, target.feature_layers, modes, seed=modes, device=device, dtype=dtype)}
    drafters["fp8"] = copy.deepcopy(drafters["base"]).quantize_linears_fp8()
    block_rows = modes * cfg.block_size
    yield from linear_rows(device, fp8_linear_shapes(drafters["base"].cfg), (block_rows, max(batch_sizes) * block_rows),
                           repeats)
    gen = torch.Generator(device).manual_seed(1)
    for bs in batch_sizes:
        target.allocate(bs, prompt_len + BUDGET + 1)  # replays do not advance: the prompt and one window
        prompts = torch.randint(0, cfg.vocab, (bs, prompt_len), generator=gen, device=device)
        ar_ms = None
        for name in ROUND_CONFIGS:
            single_mode = CONFIGS[name][1]
            row = {"kind": "round", "config": name, "bs": bs, "K": 1 if single_mode else modes, "B": BUDGET,
                   "dtype": str(dtype).removeprefix("torch.")}
            for variant, drafter in drafters.items():
                spec = SpecRound(target, drafter, budget=BUDGET, single_mode=single_mode,
                                 backend="triton" if use_graph else "torch")
                roots, cache_lens = spec.prefill(prompts)
                if ar_ms is None:
                    ar_step, _ = capture_decode_step(target, roots, cache_lens, use_graph=use_graph)
                    ar_ms = replay_ms(ar_step, device, repeats)
                    del ar_step
                graphs = capture_round(spec, roots, cache_lens, use_graph=use_graph)
                suffix = "_fp8" if variant == "fp8" else ""
                row[f"draft_ms{suffix}"] = round(replay_ms(graphs.replays["draft"], device, repeats), 4)
                row[f"round_ms{suffix}"] = round(replay_ms(graphs.replay_round, device, repeats), 4)
                row[f"round_cost{suffix}"] = round(row[f"round_ms{suffix}"] / ar_ms, 3)
                if variant == "fp8":
                    row["ok"] = graphs_match_eager(spec, graphs, roots, cache_lens)
                del spec, graphs  # free this variant's graphs and context pool before the next
                if use_graph:
                    torch.cuda.empty_cache()
            row["ar_step_ms"] = round(ar_ms, 4)
            row["draft_speedup"] = round(row["draft_ms"] / row["draft_ms_fp8"], 3)
            row["round_speedup"] = round(row["round_ms"] / row["round_ms_fp8"], 3)
            yield row


def print_fp8_rows(rows: list[dict]) -> None:
    print("\nFP8 drafter linears (e4m3) vs the unquantized drafter, same run")
    for r in rows:
        if r["kind"] == "linear":
            print(f"  linear {r['out']}x{r['in']} rows {r['rows']} {r['dtype']} {r['path']}: "
                  f"max rel error {r['max_rel_error']:.2e}, quantization bit-equal {r['quantization_bit_equal']}, "
                  f"{r['linear_ms']:.4f} -> {r['fp8_ms']:.4f} ms  {r['ok']}")
        else:
            print(f"  {r['config']:>5} bs {r['bs']:>2}: draft {r['draft_ms']:.3f} -> {r['draft_ms_fp8']:.3f} ms "
                  f"({r['draft_speedup']:.2f}x), round cost {r['round_cost']:.3f} -> {r['round_cost_fp8']:.3f} "
                  f"({r['round_speedup']:.2f}x)  graph = eager {r['ok']}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes")
    args = parser.parse_args()
    rows = []
    for row in fp8_rows(args.device, args.quick):
        rows.append(row)
        print(row, flush=True)
    print_fp8_rows(rows)
