"""Mode attention: the torch reference against a per-request, per-mode computation, and the Triton
kernel against the reference (under the Triton interpreter on CPU, in a subprocess because
TRITON_INTERPRET is read when kernels are decorated; on CUDA in-process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mfd_sglang.mode_attention import mode_attention, random_inputs as random_case


def test_reference_is_per_mode_attention_over_context_and_own_block():
    case = random_case(0, bs=2, modes=3, block=4, heads=4, kv_heads=2, dim=8, context_lens=[5, 0])
    got = mode_attention(**case, num_modes=3)
    for b, length in enumerate([5, 0]):
        slots = case["req_to_token"][case["req_pool_indices"][b], :length].long()
        for m in range(3):
            rows = slice(m * 4, (m + 1) * 4)
            for h in range(4):
                kv = h // 2
                keys = torch.cat([case["pool_k"][slots, kv], case["block_k"][b, kv, rows]])
                values = torch.cat([case["pool_v"][slots, kv], case["block_v"][b, kv, rows]])
                want = F.softmax(case["q"][b, h, rows] @ keys.T / 8 ** 0.5, dim=-1) @ values
                torch.testing.assert_close(got[b, h, rows], want, atol=1e-5, rtol=1e-5)


# (bs, K, T, Hq, Hkv, d, context lengths): small enough for the interpreter.
SHAPES = [
    (1, 1, 4, 2, 2, 16, [0]),  # K = 1, no context yet
    (2, 4, 8, 4, 2, 16, [1, 37]),  # GQA 2, context across tiles
    (3, 8, 4, 2, 1, 32, [70, 5, 33]),  # K = 8, MQA
    (1, 2, 16, 8, 2, 64, [19]),  # rows x group > one row tile
    (2, 3, 5, 3, 3, 24, [12, 0]),  # head_dim and block not powers of two
    (2, 4, 1, 4, 2, 16, [9, 40]),  # a one-slot block: the mode gate's root-only pass (`gate_modes`)
]


INTERPRETER_DTYPES = (torch.float32, torch.float16)


def case_name(shape, dtype) -> str:
    return f"{'x'.join(str(n) for n in shape[:-1])}-{'/'.join(map(str, shape[-1]))}-{str(dtype)[6:]}"


def case_interpreter(device="cpu", dtypes=INTERPRETER_DTYPES):
    """Each shape and dtype; prints the case's name when it passed."""
    for seed, shape in enumerate(SHAPES):
        bs, modes, block, heads, kv_heads, dim, lens = shape
        for dtype in dtypes:
            case = random_case(seed, bs, modes, block, heads, kv_heads, dim, lens, dtype, device)
            want = mode_attention(**{k: (v.float() if v.is_floating_point() else v) for k, v in case.items()},
                                  num_modes=modes)
            got = mode_attention(**case, num_modes=modes, backend="triton")
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol,
                                       msg=lambda m: f"{(bs, modes, block, heads, kv_heads, dim, lens)} {dtype}: {m}")
            # The drafter's layout: q / k / v are [bs, K*T, heads, d] tensors seen as [bs, heads, K*T, d]; read
            # in place (no copy), the same numbers, the output in q's layout.
            as_drafter = {k: v.transpose(1, 2).contiguous().transpose(1, 2) if k in ("q", "block_k", "block_v") else v
                          for k, v in case.items()}
            in_place = mode_attention(**as_drafter, num_modes=modes, backend="triton")
            assert torch.equal(in_place, got) and in_place.stride() == as_drafter["q"].stride(), shape
            print(case_name(shape, dtype), flush=True)


def test_interpreter_matches_reference():
    """Every shape and dtype in one interpreter process; its stdout lists the cases that passed and its
    traceback names the one that failed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, __file__], cwd=Path(__file__).resolve().parents[1], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert result.stdout.split() == [case_name(shape, dtype) for shape in SHAPES for dtype in INTERPRETER_DTYPES]


def test_triton_on_cpu_without_interpreter_raises():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set")
    case = random_case(0, 1, 1, 4, 2, 2, 16, [3])
    with pytest.raises(ValueError, match="CUDA tensors or TRITON_INTERPRET=1"):
        mode_attention(**case, num_modes=1, backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter mode is on")
def test_cuda_matches_reference():
    case_interpreter(device="cuda", dtypes=(torch.float32, torch.bfloat16, torch.float16))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
    case_interpreter()
