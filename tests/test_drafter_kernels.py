"""The round's fused Triton steps (`kernels/draft_norm_rope.py`, `kernels/draft_residual_mlp.py`, `kernels/draft_block_input.py`,
`kernels/commit_rows.py`) against the torch path they replace, on random inputs: each kernel alone (the first
three through the self-check's own comparisons, `mfd_sglang.check.kernels`, at these shapes; float32 /
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
from mfd_sglang.check.kernels import TOLERANCE
from mfd_sglang.drafter import rope_inv_freq
from references import HIDDEN, VOCAB, inputs, make_drafter


def assert_rows_ok(rows) -> None:
    rows = list(rows)
    assert rows and all(row.get("ok") for row in rows), [row for row in rows if not row.get("ok")]


def case_norm_rope(device="cpu"):
    from mfd_sglang.check.kernels import norm_rope_rows

    # (dtype, bs, T, q heads, kv heads, head dim, layers, rope theta, eps)
    assert_rows_ok(norm_rope_rows(device, [(dtype, 2, 7, 4, 2, dim, layers, 1e6, 1e-6) for dtype, dim, layers in [
        (torch.float32, 8, 1), (torch.float32, 48, 3), (torch.bfloat16, 128, 5), (torch.float16, 128, 2)]]))


def case_residual_mlp(device="cpu"):
    from mfd_sglang.check.kernels import residual_mlp_rows

    # (dtype, rows, width, intermediate): widths that are and are not powers of two
    assert_rows_ok(residual_mlp_rows(device, [(torch.float32, 15, 48, 48), (torch.bfloat16, 15, 2560, 2560),
                                              (torch.float16, 15, 1000, 1000)]))


def case_block_input(device="cpu"):
    from mfd_sglang.check.kernels import block_input_rows

    # (dtype, bs, modes, block, width, vocab, mask id), each with modes shared and per request
    assert_rows_ok(block_input_rows(device, [(torch.float32, 3, 4, 5, 48, 40, 7),
                                             (torch.bfloat16, 2, 1, 16, 1000, 40, 7),
                                             (torch.float16, 2, 3, 4, 64, 40, 7)]))


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
        drafter = make_drafter(seed=seed, attention_bias=bias).to(device)
        features, ctx_pos, block, block_pos = (t.to(device) for t in inputs(2, 9, seed=seed))
        embed = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(device)
        outputs = {}
        for backend in ("torch", "triton"):
            drafter.join_projections(backend)
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


def test_joined_drafter_runs_the_given_backend_and_triton_refuses_cpu_tensors_without_interpreter() -> None:
    from mfd_sglang.kernels.draft_norm_rope import norm_rope_

    assert make_drafter().join_projections().backend == "torch"
    assert make_drafter().join_projections("triton").backend == "triton"
    with pytest.raises(ValueError, match="backend 'cuda' is not one of 'torch', 'triton'"):
        make_drafter().join_projections("cuda")
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
