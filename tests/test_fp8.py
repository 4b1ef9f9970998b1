"""FP8 drafter linears (`mfd_sglang.fp8`, `MFDDrafter.quantize_linears_fp8`) held to references written here:
the e4m3 format from its definition (1 sign, 4 exponent bits of bias 7, 3 mantissa bits, subnormals, no
infinities, S.1111.111 NaN), round to nearest with ties to the even code, per-row absmax scales, and the
product of the dequantized operands in float64. Also what FP8 drafting quantizes in a drafter (attention
projections and MLP, nothing else), and the `eval` option that replays it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mfd_sglang.drafter import FP8_LINEARS, MFDDrafter, fp8_linear_shapes
from mfd_sglang.fp8 import FP8Linear, quantize_rows
from references import inputs, make_drafter


def e4m3_table() -> torch.Tensor:
    """The value of every one of the 256 codes, float64, NaN for the two NaN codes (from the definition)."""
    values = []
    for code in range(256):
        sign, exponent, mantissa = -1.0 if code & 0x80 else 1.0, (code >> 3) & 0xF, code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            values.append(float("nan"))
        elif exponent == 0:
            values.append(sign * mantissa / 8 * 2.0 ** -6)
        else:
            values.append(sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return torch.tensor(values, dtype=torch.float64)


TABLE = e4m3_table()


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """v (float64, |v| <= 448) to the nearest e4m3 value, ties to the code with an even mantissa; as codes."""
    codes = torch.arange(128)[~TABLE[:128].isnan()]  # the non-negative finite codes, increasing in value
    grid = TABLE[codes]
    magnitude = v.abs()
    upper = torch.searchsorted(grid, magnitude).clamp(max=len(grid) - 1)
    lower = (upper - 1).clamp(min=0)
    below, above = magnitude - grid[lower], grid[upper] - magnitude
    take_upper = (above < below) | ((above == below) & (codes[upper] % 2 == 0))
    chosen = torch.where(take_upper, codes[upper], codes[lower])
    return torch.where(v < 0, chosen | 0x80, chosen)  # a negative value keeps its sign, -0 too


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [..., K], float32 scales [..., 1]) of SGLang's per-row scheme in numpy float32: scale =
    max(max |x|, 1e-10) * float32(1 / 448), values x * (1 / scale), clamped to +-448, rounded to e4m3."""
    x = x.float().numpy()
    scale = np.maximum(np.abs(x).max(axis=-1, keepdims=True, initial=0), np.float32(1e-10)) * np.float32(1 / 448)
    scaled = np.clip(x * (np.float32(1) / scale), np.float32(-448), np.float32(448))
    assert scale.dtype == scaled.dtype == np.float32
    return round_to_e4m3(torch.from_numpy(scaled).double()), torch.from_numpy(scale)


def codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).long()


def test_torch_e4m3_is_the_defined_format():
    """torch's float8_e4m3fn decodes every code as the definition says, and 448 is its largest value: the
    cast the quantizer relies on is the format SGLang's kernels write."""
    decoded = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    assert torch.equal(decoded.isnan(), TABLE.isnan())
    assert torch.equal(decoded[~TABLE.isnan()], TABLE[~TABLE.isnan()])
    assert TABLE[~TABLE.isnan()].max() == 448.0 == torch.finfo(torch.float8_e4m3fn).max


ROWS = {
    "random": torch.randn(6, 48, generator=torch.Generator().manual_seed(0)),
    # per-row magnitudes 1e-6 .. 1e6: each row gets its own scale
    "channels": torch.randn(5, 32, generator=torch.Generator().manual_seed(1)) * torch.logspace(-6, 6, 5)[:, None],
    "zeros": torch.zeros(3, 16),
    "large": torch.tensor([[3.0e38, -1.0e38, 2.0, 0.0], [65504.0, -65504.0, 1.0, -1.0]]),
    "one value": torch.tensor([[0.0, 0.0, -7.5, 0.0]]),
    # exactly halfway between neighbouring e4m3 values once scaled (max 448 -> scale 1): ties to even
    "ties": torch.tensor([[448.0, 1.0625, 1.1875, 17.0, 0.0009765625 * 3, -2.0 ** -10, 240.0 + 8.0]]),
}


def midpoints_row() -> torch.Tensor:
    """448 (scale 1) then, for every two neighbouring e4m3 values, their midpoint and the float32 values
    just below and above it, positive and negative: every rounding decision of the format."""
    grid = TABLE[:127].float()  # the non-negative finite values, increasing (code 127 is NaN)
    mids = (grid[:-1] + grid[1:]) / 2  # exact in float32
    near = torch.cat([mids, mids.nextafter(torch.zeros_like(mids)), mids.nextafter(torch.full_like(mids, 448.0))])
    return torch.cat([torch.tensor([448.0]), near, -near])[None]


ROWS["midpoints"] = midpoints_row()


def test_rows_quantize_as_the_reference():
    """Codes and scales equal the independent reference exactly, for random rows, rows of very different
    magnitudes (per-channel scales), all-zero rows (zeros, no NaN), huge values, a single non-zero and
    values exactly between two e4m3 values; float32 and bfloat16 inputs."""
    for name, x in ROWS.items():
        for dtype in (torch.float32, torch.bfloat16):
            row = x.to(dtype)
            values, scales = quantize_rows(row)
            want_codes, want_scales = reference_quantize(row)
            assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32, name
            assert torch.equal(codes(values), want_codes), (name, dtype)
            assert torch.equal(scales, want_scales), (name, dtype)
    assert not codes(quantize_rows(ROWS["zeros"])[0]).any()
    ties = codes(quantize_rows(ROWS["ties"])[0])[0]
    # 1.0625 lies between 1.0 (code 0x38) and 1.125 (0x39): to 0x38; 1.1875 between 0x39 and 0x3A: to 0x3A
    assert ties[1].item() == 0x38 and ties[2].item() == 0x3A


# Run with TRITON_INTERPRET=1 in a subprocess: the variable is read when triton decorates a kernel, and
# other tests may import triton first.
TRITON_QUANTIZATION = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_fp8 import ROWS
from mfd_sglang.fp8 import quantize_rows
from mfd_sglang.kernels.draft_fp8_quant import quantize_rows_triton
gen = torch.Generator().manual_seed(3)
cases = dict(ROWS, wide=torch.randn(5, 2500, generator=gen) * torch.logspace(-8, 8, 5)[:, None],
             strided=torch.randn(4, 3000, generator=gen)[:, 7:2000], empty=torch.zeros(0, 64))
for name, x in cases.items():
    for dtype in (torch.float32, torch.bfloat16):
        want_values, want_scales = quantize_rows(x.to(dtype))
        values, scales = quantize_rows_triton(x.to(dtype))
        assert values.dtype == torch.float8_e4m3fn and scales.shape == want_scales.shape, name
        assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8)), (name, dtype)
        assert torch.equal(scales, want_scales), (name, dtype)
print("bit-equal", len(cases))
"""


def test_triton_quantization_is_bit_equal_to_torchs():
    """The fused Triton kernel FP8Linear quantizes CUDA activations with gives quantize_rows' codes and
    scales bit for bit (under the Triton interpreter): every case above (the midpoints row holds every
    rounding decision of the format), rows longer than its block, a strided view, no rows."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", TRITON_QUANTIZATION, str(Path(__file__).parent)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "bit-equal" in out.stdout, out.stderr[-3000:]


def test_fp8_linear_is_the_product_of_its_dequantized_operands():
    """FP8Linear: its weight is the reference's per-output-channel quantization of the linear's weight,
    and its output the float64 product of the reference-dequantized input rows and weight (plus the bias),
    within float32 accumulation; output dtype and leading shape follow the input. Channels of very
    different scales keep their own scale."""
    gen = torch.Generator().manual_seed(2)
    linear = nn.Linear(48, 40, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 48, generator=gen) * torch.logspace(-3, 3, 40)[:, None])
        linear.bias.copy_(torch.randn(40, generator=gen))
    for dtype in (torch.float32, torch.bfloat16):
        layer = linear.to(dtype)
        fp8 = FP8Linear.from_linear(layer)
        want_codes, want_scales = reference_quantize(layer.weight.detach())
        assert torch.equal(codes(fp8.weight), want_codes) and torch.equal(fp8.weight_scale, want_scales.view(-1))
        x = (torch.randn(3, 7, 48, generator=gen) * torch.logspace(-2, 2, 7)[None, :, None]).to(dtype)
        x[1, 2] = 0  # a zero token
        out = fp8(x)
        assert out.dtype == dtype and out.shape == (3, 7, 40)
        x_codes, x_scales = reference_quantize(x.reshape(-1, 48))
        want = (TABLE[x_codes] * x_scales.double()) @ (TABLE[want_codes] * want_scales.double()).T
        want = (want + layer.bias.detach().double()).view(3, 7, 40)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(out.double(), want, rtol=tol, atol=tol * want.abs().max().item())
        assert torch.equal(out[1, 2], layer.bias.detach())  # a zero token gives the bias alone


def test_drafter_quantizes_exactly_its_attention_and_mlp_linears():
    """quantize_linears_fp8 turns q/k/v/o and gate/up/down of every layer into FP8Linear (the listed
    shapes) and leaves fc, the norms and the mode embeddings as they were; the drafted hidden states move
    (the drafter runs the quantized layers) but stay close to the unquantized drafter's."""
    drafter = make_drafter(num_modes=3)
    fp8 = make_drafter(num_modes=3).quantize_linears_fp8()
    quantized = [(m.out_features, m.in_features) for m in fp8.modules() if isinstance(m, FP8Linear)]
    assert quantized == fp8_linear_shapes(fp8.cfg) and len(quantized) == len(FP8_LINEARS) * fp8.cfg.num_hidden_layers
    assert isinstance(fp8.fc, nn.Linear) and torch.equal(fp8.fc.weight, drafter.fc.weight)
    for name, tensor in drafter.state_dict().items():
        if not any(f".{proj}." in name for proj in FP8_LINEARS):
            assert torch.equal(fp8.state_dict()[name], tensor), name
    features, ctx_pos, block, block_pos = inputs(2, 9)
    want = drafter(block, block_pos, drafter.context_kv(features, ctx_pos))
    got = fp8(block, block_pos, fp8.context_kv(features, ctx_pos))
    assert got.shape == want.shape and not torch.equal(got, want)
    # e4m3 keeps 3 mantissa bits (up to 6% per value) through two random layers: about 11% here
    assert (got - want).norm() < 0.2 * want.norm()


def test_from_checkpoint_quantizes_after_the_dtype_cast(tiny_pair):
    """from_checkpoint(fp8_linears=True) is the drafter cast to the serving dtype, then quantized: the same
    codes and scales as quantizing the cast weights by hand."""
    from mfd_sglang.checkpoint import load_drafter

    ckpt = load_drafter(tiny_pair / "drafter")
    fp8 = MFDDrafter.from_checkpoint(ckpt, dtype=torch.bfloat16, fp8_linears=True)
    plain = MFDDrafter.from_checkpoint(ckpt, dtype=torch.bfloat16)
    for layer, reference in zip(fp8.layers, plain.layers):
        for name in FP8_LINEARS:
            want_codes, want_scales = reference_quantize(getattr(reference, name).weight.detach())
            assert torch.equal(codes(getattr(layer, name).weight), want_codes), name
            assert torch.equal(getattr(layer, name).weight_scale, want_scales.view(-1)), name
    assert fp8.fc.weight.dtype == torch.bfloat16 and not isinstance(fp8.fc, FP8Linear)


def test_eval_replays_fp8_drafters_beside_the_unquantized_ones(tiny_pair, tiny_dflash_drafter):
    """`eval --fp8-draft`: per set, the unquantized results are what a run without the option gives, and
    the "fp8" results are what a run with FP8-quantized drafters gives (same continuations)."""
    from mfd_sglang.checkpoint import load_drafter
    from mfd_sglang.lab import evaluate

    target, drafters, prompt_sets, eos = evaluate.load_inputs(
        tiny_pair / "target", tiny_dflash_drafter, tiny_pair / "drafter", torch.float32,
        prompts_file=tiny_pair / "prompts.json", limit=2)
    run = lambda single, mfd, **kw: evaluate.evaluate(target, single, mfd, prompt_sets, [4, 16], 12, eos,
                                                      log=lambda *a: None, **kw)
    both = run(drafters["single"], drafters["mfd"], fp8=True)["prompts"]
    plain = run(drafters["single"], drafters["mfd"])["prompts"]
    quantized = run(*(MFDDrafter.from_checkpoint(load_drafter(path), dtype=torch.float32, fp8_linears=True)
                      for path in (tiny_dflash_drafter, tiny_pair / "drafter")))["prompts"]
    assert {k: v for k, v in both.items() if k != "fp8"} == plain
    assert both["fp8"] == {k: v for k, v in quantized.items() if k != "prompts"}
    assert both["fp8"]["mfd"]["16"]["tau"] > 1  # the FP8 drafters still draft accepted tokens
    table = evaluate.format_table({"prompts": both}, [4, 16])
    assert "mfd fp8" in table and "x)" in table


def test_the_gpu_checks_fp8_section_runs_on_cpu(tmp_path):
    """`gpu_check.py --cpu --part 2 --only fp8_draft` (benchmarks/fp8_draft.py's rows on tiny shapes; the
    device runs them at Qwen3-4B's): every linear row holds FP8Linear to the float64 product of its dequantized
    operands, and the round rows have both drafters' draft and round times at bs 2 for MFD and MFD_D, the FP8
    round replayed equal to the eager one; the part passes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from mfd_sglang.round_cost import TargetConfig, drafter_raw_config

    from mfd_sglang.checkpoint import parse_drafter_config

    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu", "--part", "2", "--only", "fp8_draft",
                          "--out-dir", str(tmp_path)], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=900)
    report = json.loads((tmp_path / "report.json").read_text())
    assert out.returncode == 0 and report["passed"], (report.get("failures"), out.stdout[-3000:], out.stderr[-3000:])
    rows = report["sections"]["fp8_draft"]["rows"]
    linear, rounds = [r for r in rows if r["kind"] == "linear"], [r for r in rows if r["kind"] == "round"]
    shapes = set(fp8_linear_shapes(parse_drafter_config(drafter_raw_config(TargetConfig.tiny(), [1, 2], 8))))
    assert {(r["out"], r["in"]) for r in linear} == shapes and len(linear) == len(shapes) * 2 * 2  # x rows x dtypes
    assert all(r["ok"] for r in linear), [r for r in linear if not r["ok"]]
    assert [(r["config"], r["bs"]) for r in rounds] == [("mfd", 2), ("mfd_d", 2)]
    for r in rounds:
        assert r["ok"] and min(r["draft_ms"], r["draft_ms_fp8"], r["round_cost"], r["round_cost_fp8"]) > 0, r


def module_weight_bytes(drafter: MFDDrafter) -> int:
    """Bytes of a drafter module's own floating-point tensors (parameters and buffers, e4m3 ones included),
    measured on the module."""
    tensors = list(drafter.parameters()) + [b for b in drafter.buffers() if b is not None]
    return sum(t.numel() * t.element_size() for t in tensors if t.is_floating_point())


def test_memory_plan_and_inspect_count_the_fp8_weights(tiny_pair):
    """The weight bytes the memory plan and `inspect` give for FP8 drafting are the bytes the quantized
    module holds (e4m3 linears, float32 scales, the rest in the serving dtype), in bf16 and fp32 serving;
    the quantized linears' bytes halve in bf16; the plan's working set grows by the activation
    quantization's, and its log line says so."""
    from mfd_sglang.checkpoint import load_drafter
    from mfd_sglang.cli import describe_drafter
    from mfd_sglang.serving.launch.memory import drafter_weight_bytes, memory_plan

    ckpt = load_drafter(tiny_pair / "drafter")
    elements = sum(t.numel() for t in ckpt.weights.values() if t.is_floating_point())
    for dtype in (torch.bfloat16, torch.float32):
        size = torch.finfo(dtype).bits // 8
        plain = MFDDrafter.from_checkpoint(ckpt, dtype=dtype)
        fp8 = MFDDrafter.from_checkpoint(ckpt, dtype=dtype, fp8_linears=True)
        assert drafter_weight_bytes(ckpt.config, elements, size) == module_weight_bytes(plain)
        assert drafter_weight_bytes(ckpt.config, elements, size, "fp8") == module_weight_bytes(fp8)
        plans = {q: memory_plan(ckpt.config, elements, dtype_bytes=size, budget=16, vocab=ckpt.config.vocab_size,
                                draft_quantization=q) for q in (None, "fp8")}
        assert plans["fp8"].weight_bytes - plans[None].weight_bytes == module_weight_bytes(fp8) - module_weight_bytes(plain)
        # the working set counts the activations' quantization where the layers' activations are the largest
        # part (here once the vocabulary is scored a row at a time), and never shrinks
        narrow = {q: replace(plan, vocab_chunk=1) for q, plan in plans.items()}
        assert narrow["fp8"].draft_bytes(4) > narrow[None].draft_bytes(4)
        assert plans["fp8"].draft_bytes(4) >= plans[None].draft_bytes(4)
        assert "linears in FP8" in plans["fp8"].describe(4) and "FP8" not in plans[None].describe(4)
    bf16 = MFDDrafter.from_checkpoint(ckpt, dtype=torch.bfloat16)
    bf16_fp8 = MFDDrafter.from_checkpoint(ckpt, dtype=torch.bfloat16, fp8_linears=True)
    linear_bytes = lambda drafter: sum(getattr(layer, name).weight.nbytes for layer in drafter.layers
                                       for name in FP8_LINEARS)
    assert linear_bytes(bf16) == 2 * linear_bytes(bf16_fp8)
    info = describe_drafter(ckpt)
    stored = MFDDrafter.from_checkpoint(ckpt)
    assert info["weight_bytes"] == module_weight_bytes(stored)
    assert info["weight_bytes_fp8"] == module_weight_bytes(MFDDrafter.from_checkpoint(ckpt, fp8_linears=True))


def test_inspect_says_what_fp8_does_to_the_weight_bytes(tiny_pair):
    out = subprocess.run([sys.executable, "-m", "mfd_sglang", "inspect", str(tiny_pair / "drafter")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("weight_bytes_fp8"))
    assert "--speculative-draft-model-quantization fp8" in line and "x, with" in line


def test_draft_quantization_follows_sglangs_resolution():
    """fp8 or unset as resolved; a method inherited from the target's --quantization that the drafter
    cannot run leaves it unquantized; the same method set for the drafter is refused naming the flag."""
    from types import SimpleNamespace

    from mfd_sglang.serving.launch.options import draft_quantization

    args = lambda method, explicit: SimpleNamespace(speculative_draft_model_quantization=method,
                                                    _speculative_draft_quantization_explicitly_set=explicit)
    assert draft_quantization(args("fp8", True)) == draft_quantization(args("fp8", False)) == "fp8"
    assert draft_quantization(args(None, False)) is None
    assert draft_quantization(args("awq", False)) is None
    with pytest.raises(ValueError, match="--speculative-draft-model-quantization awq"):
        draft_quantization(args("awq", True))


def test_fp8_drafting_needs_compute_capability_8_9(monkeypatch, caplog):
    """On a CUDA GPU below compute capability 8.9 (faked at an A100's 8.0), fp8 set for the drafter is refused by
    a message naming the flag, the GPU's capability, the 8.9 it needs and the fix; fp8 inherited from the target's
    --quantization fp8 leaves the drafter unquantized with one warning saying why, however often the launch and
    the ranks ask. At 8.9 (Ada) and 9.0 (Hopper) fp8 stays fp8; on the CPU too, without reading a capability."""
    import logging
    from types import SimpleNamespace

    import mfd_sglang.fp8 as fp8
    from mfd_sglang.serving.launch import options

    def capability(value):
        monkeypatch.setattr(fp8, "cuda_capability", lambda device: value)

    args = lambda explicit, device="cuda": SimpleNamespace(
        speculative_draft_model_quantization="fp8", _speculative_draft_quantization_explicitly_set=explicit,
        device=device, base_gpu_id=0)
    monkeypatch.setattr(options, "_WARNED_NO_FP8", set())  # warned once per process: not by an earlier test
    capability((8, 0))
    with pytest.raises(ValueError) as refused:
        options.draft_quantization(args(True))
    message = str(refused.value)
    assert message.startswith("--speculative-draft-model-quantization fp8: ")
    assert "compute capability 8.0" in message and "8.9" in message and "Ada, Hopper" in message
    assert "Drop the flag, or pass unquant" in message
    with caplog.at_level(logging.WARNING, logger=options.logger.name):
        assert options.draft_quantization(args(False)) is None
        assert options.draft_quantization(args(False)) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "--quantization fp8" in warnings[0] and "serving dtype" in warnings[0]
    assert "compute capability 8.0" in warnings[0] and "8.9" in warnings[0]
    for value in ((8, 9), (9, 0)):
        capability(value)
        assert options.draft_quantization(args(True)) == options.draft_quantization(args(False)) == "fp8"
    monkeypatch.setattr(fp8, "cuda_capability", lambda device: pytest.fail(f"the CPU read {device}'s capability"))
    assert options.draft_quantization(args(True, "cpu")) == options.draft_quantization(args(False, "cpu")) == "fp8"


def test_fp8_linear_keeps_off_fp8_hardware_below_compute_capability_8_9(monkeypatch):
    """FP8Linear takes `torch._scaled_mm` (which torch refuses below compute capability 8.9) on a CUDA GPU of 8.9
    or more only: not at a faked 8.0, nor on the CPU; and where FP8 drafting is not supported its activations
    skip the Triton quantizer (e4m3 conversions) for the torch one."""
    import mfd_sglang.fp8 as fp8
    from mfd_sglang.fp8 import quantize_activations

    layer = FP8Linear.from_linear(nn.Linear(64, 32))
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(fp8, "cuda_capability", lambda device: (9, 0))
    assert layer.takes_scaled_mm(gpu) and not layer.takes_scaled_mm(torch.device("cpu"))
    assert not FP8Linear.from_linear(nn.Linear(64, 24)).takes_scaled_mm(gpu)  # a width _scaled_mm does not take
    monkeypatch.setattr(fp8, "cuda_capability", lambda device: (8, 0))
    assert not layer.takes_scaled_mm(gpu)
    monkeypatch.setattr(fp8, "fp8_drafting_supported", lambda device: False)
    monkeypatch.setattr("mfd_sglang.kernels.draft_fp8_quant.quantize_rows_triton",
                        lambda rows: pytest.fail("the Triton quantizer ran"))
    rows = ROWS["random"]
    values, scales = quantize_activations(rows, "triton")
    want_values, want_scales = quantize_rows(rows)
    assert torch.equal(codes(values), codes(want_values)) and torch.equal(scales, want_scales)
