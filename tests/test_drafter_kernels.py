"""The round's fused Triton steps (`kernels/norm_rope.py`, `kernels/residual_mlp.py`, `kernels/block_input.py`,
`kernels/commit_rows.py`) against the torch path they replace, on random inputs: each kernel alone (float32 /
bfloat16 / float16; norm + rope at head dims 8 / 48 / 128, queries and keys or keys alone under stacked
per-layer weights, positions up to 32K; residual add + RMSNorm and SiLU x up at widths that are and are not
powers of two; the block input with shared and per-request modes, one mode or several; the commit's rows at
widths 1 / 5 / 16 with paths of every length, bit for bit), and a drafter's block and context keys with the
serving stage's backend against the same drafter on torch.

On CPU the kernels run under the Triton interpreter, in a subprocess with TRITON_INTERPRET=1 (read when
triton decorates a kernel); the CUDA test runs in-process.
"""

import os

import pytest
import torch

from interpreted import main, run_cases
from mfd_sglang.cuda_graph import host_syncs_raise
from mfd_sglang.drafter import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq
from references import HIDDEN, VOCAB, inputs, make_drafter

# The kernels round once, the torch path after every step: they agree to a few units of the dtype's rounding.
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=6e-2, rtol=3e-2),
             torch.float16: dict(atol=8e-3, rtol=4e-3)}


def case_norm_rope(device="cpu"):
    from mfd_sglang.kernels.norm_rope import norm_rope_

    gen = torch.Generator().manual_seed(0)
    theta, eps = 1e6, 1e-6
    for dtype, dim, layers in [(torch.float32, 8, 1), (torch.float32, 48, 3), (torch.bfloat16, 128, 5),
                               (torch.float16, 128, 2)]:
        bs, t, q_heads, kv_heads = 2, 7, 4, 2

        def rand(*shape, scale=1.0, shift=0.0):
            return (torch.randn(*shape, generator=gen) * scale + shift).to(device=device, dtype=dtype)

        q, k = rand(bs, t, q_heads, dim, scale=3.0), rand(bs, t, layers * kv_heads, dim, scale=3.0)
        q_weight, k_weight = rand(dim, scale=0.2, shift=1.0), rand(layers, dim, scale=0.2, shift=1.0)
        positions = torch.randint(0, 32768, (bs, t), generator=gen).to(device)
        cos, sin = rope_cos_sin(positions, dim, theta, dtype)
        cos, sin = cos[:, :, None], sin[:, :, None]
        want_q = apply_rope(rms_norm(q, q_weight, eps), cos, sin)
        per_layer = k.view(bs, t, layers, kv_heads, dim)
        want_k = apply_rope(rms_norm(per_layer, None, eps) * k_weight[:, None], cos[:, :, None], sin[:, :, None])
        inv_freq = rope_inv_freq(dim, theta, device)
        for with_q in (True, False):
            got_q, got_k = q.clone(), k.clone()
            with host_syncs_raise(device):
                norm_rope_(got_q if with_q else None, q_weight, got_k, k_weight, positions, inv_freq, eps)
            where = f"{dtype} head_dim {dim} layers {layers} with q {with_q}"
            torch.testing.assert_close(got_k.view_as(want_k), want_k, **TOLERANCE[dtype], msg=where)
            torch.testing.assert_close(got_q, want_q if with_q else q, **TOLERANCE[dtype], msg=where)


def case_residual_mlp(device="cpu"):
    from mfd_sglang.kernels.residual_mlp import add_rms_norm, silu_mul

    gen = torch.Generator().manual_seed(1)
    eps = 1e-6
    for dtype, width in [(torch.float32, 48), (torch.bfloat16, 2560), (torch.float16, 1000)]:
        def rand(*shape, scale=1.0, shift=0.0):
            return (torch.randn(*shape, generator=gen) * scale + shift).to(device=device, dtype=dtype)

        x, delta, weight = rand(3, 5, width), rand(3, 5, width, scale=0.5), rand(width, scale=0.2, shift=1.0)
        with host_syncs_raise(device):
            total, normed = add_rms_norm(x, delta, weight, eps)
            gate_up = rand(3, 5, 2 * width, scale=2.0)
            product = silu_mul(gate_up)
        where = f"{dtype} width {width}"
        if dtype == torch.bfloat16 and device == "cpu":  # the interpreter rounds to bfloat16 toward zero
            torch.testing.assert_close(total, x + delta, **TOLERANCE[dtype], msg=where)
        else:
            assert torch.equal(total, x + delta), where  # one rounding of the same sum
        torch.testing.assert_close(normed, rms_norm(x + delta, weight, eps), **TOLERANCE[dtype], msg=where)
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(product, torch.nn.functional.silu(gate) * up, **TOLERANCE[dtype], msg=where)


def case_block_input(device="cpu"):
    from mfd_sglang.kernels.block_input import block_input

    gen = torch.Generator().manual_seed(2)
    eps, mask_id, vocab = 1e-6, 7, 40
    for dtype, width, bs, num_modes, block, per_request in [(torch.float32, 48, 3, 4, 5, False),
                                                             (torch.bfloat16, 1000, 2, 1, 16, False),
                                                             (torch.float16, 64, 2, 3, 4, True)]:
        def rand(*shape, scale=1.0, shift=0.0):
            return (torch.randn(*shape, generator=gen) * scale + shift).to(device=device, dtype=dtype)

        embed, weight = rand(vocab, width), rand(width, scale=0.2, shift=1.0)
        modes = rand(bs if per_request else 1, num_modes, width, scale=0.5)
        roots = torch.randint(0, vocab, (bs,), generator=gen).to(device)
        starts = torch.randint(0, 32768, (bs,), generator=gen, dtype=torch.int32).to(device)
        with host_syncs_raise(device):
            x, normed, positions = block_input(roots, starts, embed, modes, mask_id, weight, eps, block)
        tokens = torch.full((bs, block), mask_id, device=device)
        tokens[:, 0] = roots
        want_x = (embed[tokens][:, None] + modes[:, :, None]).reshape(bs, num_modes * block, width)
        where = f"{dtype} width {width} modes {num_modes} block {block}"
        if dtype == torch.bfloat16 and device == "cpu":  # the interpreter rounds to bfloat16 toward zero
            torch.testing.assert_close(x, want_x, **TOLERANCE[dtype], msg=where)
        else:
            assert torch.equal(x, want_x), where  # one rounding of the same sum
        torch.testing.assert_close(normed, rms_norm(x, weight, eps), **TOLERANCE[dtype], msg=where)
        want_positions = (starts[:, None].long() + torch.arange(block, device=device)).repeat(1, num_modes)
        assert torch.equal(positions, want_positions), where


def case_commit_rows(device="cpu"):
    from mfd_sglang.kernels.commit_rows import commit_rows
    from mfd_sglang.serving.commit import commit_rows as commit_rows_torch

    gen = torch.Generator().manual_seed(3)
    for dtype, features, width in [(torch.float32, 40, 5), (torch.bfloat16, 2100, 16), (torch.float16, 8, 1)]:
        bs, window = 3, 17
        hidden = torch.randn(bs, window, features, generator=gen).to(device, dtype)
        accepted = torch.randint(1, window, (bs, 15), generator=gen)
        for r, length in enumerate((0, 4, 15)):  # -1 past each request's accepted path
            accepted[r, length:] = -1
        seq_lens = torch.randint(0, 32768, (bs,), generator=gen, dtype=torch.int32).to(device)
        accepted = accepted.to(device)
        with host_syncs_raise(device):
            got = commit_rows(accepted, hidden, seq_lens, width)
        for have, want in zip(got, commit_rows_torch(accepted, hidden, seq_lens, width)):
            assert have.dtype == want.dtype and torch.equal(have, want), f"{dtype} width {width}"


def case_drafter(device="cpu"):
    """A drafter's block (every layer's queries and keys; from embeddings, and from root tokens through the
    block input kernel, K modes and the single-mode path) and its context keys, with the serving stage's
    fused steps and on torch: the same within float32 rounding."""
    for seed, bias in [(3, False), (4, True)]:
        drafter = make_drafter(seed=seed, attention_bias=bias).to(device).join_projections()
        features, ctx_pos, block, block_pos = (t.to(device) for t in inputs(2, 9, seed=seed))
        embed = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(device)
        outputs = {}
        for backend in ("torch", "triton"):
            drafter.kernel_backend = backend
            with torch.no_grad(), host_syncs_raise(device if backend == "triton" else "cpu"):
                context = drafter.context_kv(features, ctx_pos)
                blocks = [drafter.block_hidden(block_pos[:, 0] % VOCAB, block_pos[:, 0], context, embed,
                                               single_mode=single)[0] for single in (False, True)]
                outputs[backend] = (drafter(block, block_pos, context), *blocks, *context.keys)
        for want, got in zip(outputs["torch"], outputs["triton"]):
            torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


CASES = {fn.__name__: fn for fn in (case_norm_rope, case_residual_mlp, case_block_input, case_commit_rows,
                                    case_drafter)}


def test_interpreter_matches_torch() -> None:
    run_cases(__file__, CASES)


def test_serving_backend_is_torch_on_cpu_and_refuses_cpu_tensors_without_interpreter() -> None:
    from mfd_sglang.kernels.norm_rope import norm_rope_

    assert make_drafter().join_projections().kernel_backend == "torch"
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the CPU path is allowed")
    k = torch.zeros(1, 3, 2, 8)
    with pytest.raises(ValueError, match="CUDA tensors or TRITON_INTERPRET=1"):
        norm_rope_(None, None, k, torch.ones(8), torch.zeros(1, 3, dtype=torch.int64), rope_inv_freq(8, 1e4, "cpu"),
                   1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter mode is on")
def test_cuda_matches_torch_without_sync() -> None:
    for case in CASES.values():
        case(device="cuda")


if __name__ == "__main__":
    main(CASES)
