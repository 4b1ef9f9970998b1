"""The Triton vocab_candidates (fused lm_head + vocabulary top-B) against the torch reference.

Small-integer hidden states and weights make every dot product exact whatever the summation order,
so both backends see the same logits: the ids and logits must then be bit-equal, ties by lower id,
and the normaliser equal up to float32 rounding. On CPU the kernel runs under the Triton
interpreter. TRITON_INTERPRET is read when @triton.jit decorates a kernel (at import), and other
tests may import triton first, so the CPU groups run this file as a script in a subprocess with
TRITON_INTERPRET=1. The CUDA test runs in-process.
"""

import os

import pytest
import torch

from interpreted import main, run_cases
from mfd_sglang.cuda_graph import host_syncs_raise
from mfd_sglang.drafter import vocab_candidates
from mfd_sglang.tree import DraftCandidates
from references import HIDDEN, VOCAB, inputs, make_drafter

CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def small_ints(seed: int, shape, low: int = -3, high: int = 4) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed)).float()


def reference_top(hidden: torch.Tensor, weight: torch.Tensor, count: int):
    """(logits, ids) of the top min(count, V) of the full logits by a stable descending sort (equal
    logits: the lower id first; -0.0 is 0.0, which adding 0.0 makes it), and the float64 log-normaliser."""
    full = (hidden @ weight.T).float() + 0.0
    logits, ids = full.sort(dim=-1, descending=True, stable=True)
    keep = min(count, weight.shape[0])
    return logits[..., :keep], ids[..., :keep], torch.logsumexp(full.double(), dim=-1)


def assert_exact(hidden: torch.Tensor, weight: torch.Tensor, count: int, *, sync_check: bool = False,
                 public: bool = False, **launch) -> torch.Tensor:
    """Triton = torch for inputs whose logits are exact: ids and logits bit for bit, log-probs and
    normaliser up to float32 rounding. public: through `vocab_candidates(backend="triton")` (the
    default launch; a second kernel run, which the interpreter makes slow). Returns the ids."""
    from mfd_sglang.kernels.draft_vocab import vocab_top_logits_triton

    where = (f"hidden {tuple(hidden.shape)} weight {tuple(weight.shape)} {hidden.dtype} count {count} "
             f"launch {launch}")
    with host_syncs_raise(hidden.device if sync_check else "cpu"):  # a host sync in the launch path raises
        logits, ids, lognorm, logprobs = vocab_top_logits_triton(hidden, weight, count, **launch)
        got = (vocab_candidates(hidden, weight, count, backend="triton") if public
               else DraftCandidates(logprobs, ids, weight.shape[0]))
    want_logits, want_ids, want_lognorm = reference_top(hidden, weight, count)
    assert logits.dtype == torch.float32 and ids.dtype == torch.int64, where
    assert logits.shape == want_logits.shape and lognorm.shape == hidden.shape[:-1], where
    assert torch.equal(ids, want_ids), f"ids differ: {where}\n{want_ids}\n{ids}"
    assert torch.equal(logits.view(torch.int32), want_logits.view(torch.int32)), f"logits differ: {where}"
    assert torch.equal(logprobs, logits - lognorm[..., None]), where
    torch.testing.assert_close(lognorm.double(), want_lognorm, rtol=1e-6, atol=1e-6, msg=where)

    # The public contract: the torch backend's DraftCandidates (several chunks), same shapes and ids.
    want = vocab_candidates(hidden, weight, count, chunk_size=max(1, weight.shape[0] // 3))
    assert got.vocab == want.vocab == weight.shape[0], where
    for name in ("logprobs", "tokens"):
        have, expect = getattr(got, name), getattr(want, name)
        assert (have.dtype, have.shape, have.device) == (expect.dtype, expect.shape, expect.device), where
    assert torch.equal(got.tokens, want.tokens), where
    # The normalisers (logits - logprobs) agree up to float32 rounding (and the subtraction's).
    scale = 1 + logits.abs().amax().item() + want_lognorm.abs().amax().item()
    torch.testing.assert_close((logits - got.logprobs).double(), (logits - want.logprobs).double(),
                               rtol=1e-6, atol=2e-7 * scale, msg=where)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-6, atol=2e-7 * scale, msg=where)
    return ids


# (leading dims, H, V, counts, launch): tiny for the interpreter. |logit| <= 3 * 3 * H <= 243 stays
# exact in bfloat16 (8 significant bits), so the interpreter's bf16 rounding never comes into play.
SHAPES = [
    ((2, 3, 5), 27, 300, (1, 5, 16), {}),  # (bs, K, D); 3 vocabulary splits of one tile each
    ((7,), 20, 50, (1, 5, 16, 64), {}),  # V smaller than one tile; count > V
    ((2, 3, 5), 27, 300, (5,), dict(block_h=16, tile_v=32, max_splits=3)),  # H in 2 chunks, 4 tiles a split
    ((2, 20), 24, 70, (16,), dict(rows_per_block=16, tile_v=16)),  # 3 row blocks; count == tile
    ((), 20, 40, (3,), {}),  # one unbatched row
    ((5, 20), 16, 70, (8,), dict(block_h=16)),  # 100 rows: blocks of 64 (16-bit) or 32 (float32), one partial
    ((1,), 8, 1100, (64,), dict(tile_v=64)),  # 18 splits: the finishing merge takes 1152 keys in 2 tiles
]


def case_shapes(device="cpu", dtypes=CPU_DTYPES, sync_check=False):
    for seed, (lead, size, vocab, counts, launch) in enumerate(SHAPES):
        hidden, weight = small_ints(2 * seed, (*lead, size)), small_ints(2 * seed + 1, (vocab, size))
        for dtype in dtypes:
            for count in counts:
                assert_exact(hidden.to(device, dtype), weight.to(device, dtype), count,
                             sync_check=sync_check, public=count == counts[0] and not launch, **launch)


def case_ties(device="cpu", dtypes=CPU_DTYPES, sync_check=False):
    for dtype in dtypes:
        def put(t):
            return t.to(device, dtype)

        # 27 distinct rows among 300: long runs of equal logits, across tiles and splits.
        hidden, weight = small_ints(10, (3, 4, 3)), small_ints(11, (300, 3), -1, 2)
        for count in (1, 7, 64):
            assert_exact(put(hidden), put(weight), count, sync_check=sync_check, tile_v=64)
        # Every row equal: the candidates are rows 0 .. count - 1.
        ones = torch.ones(90, 17)
        assert_exact(put(small_ints(12, (2, 17))), put(ones), 10, sync_check=sync_check, tile_v=16)
        # Zero hidden states: every logit 0 (products -0.0 included), a uniform distribution.
        assert_exact(put(torch.zeros(2, 2, 17)), put(small_ints(13, (90, 17))), 5, sync_check=sync_check)
        # Five equal best rows spread over the splits, the rest strictly below them.
        weight = small_ints(14, (200, 20), -2, 3)
        weight[[150, 9, 77, 120, 33]] = 3.0
        ids = assert_exact(put(torch.full((2, 20), 3.0)), put(weight), 8, sync_check=sync_check, tile_v=16)
        assert ids[:, :5].tolist() == [[9, 33, 77, 120, 150]] * 2, ids
        # One split of 16 tiles, the best row in the first: the later tiles hold the rest of the top-8.
        weight = small_ints(15, (256, 20), -2, 2)
        weight[0] = 3.0
        assert_exact(put(torch.full((2, 20), 3.0)), put(weight), 8, sync_check=sync_check, tile_v=16, max_splits=1)
        if dtype != torch.float32:
            # 16-bit inputs rank int32 keys with an index local to the split, so a split spans at most 2^16
            # rows even when one is asked for: equal best rows at both ends of each of the two splits.
            weight = small_ints(16, (2**16 + 300, 4), -2, 2)
            best = [0, 2, 2**16 - 2, 2**16 - 1, 2**16, 2**16 + 299]
            weight[best] = 3.0
            ids = assert_exact(put(torch.full((1, 4), 3.0)), put(weight), 16, sync_check=sync_check, max_splits=1,
                               tile_v=2048)  # 33 tiles: the interpreter's time
            assert ids[0, :len(best)].tolist() == best, ids


def case_threshold(device="cpu", dtypes=CPU_DTYPES, sync_check=False):
    """The running threshold skips the merges of tiles that beat no row's current B-th key, and only those:
    64 rows far above the rest lead the first of two splits (its 8 later tiles are tails, skipped), and 16
    of them sit in the last tile of the second split, which must still enter."""
    hidden, weight = small_ints(20, (4, 5, 32), -1, 2), small_ints(21, (1100, 32), -1, 2)
    hidden[..., 0] = 10.0
    weight[:, 0] = 0.0
    head = [*range(64), *range(1084, 1100)]
    weight[head, 0] = 12.0  # +120 over logits of |.| <= 31: all exact in bfloat16
    for dtype in dtypes:
        skips = torch.zeros(2, dtype=torch.int32, device=device)
        ids = assert_exact(hidden.to(device, dtype), weight.to(device, dtype), 50, sync_check=sync_check,
                           tile_v=64, max_splits=2, threshold=True, skips=skips)
        assert set(ids[..., :16].flatten().tolist()) <= set(head), ids
        assert skips.tolist()[1] == 18, skips  # one row block x 18 tiles
        assert skips.tolist()[0] >= 8, skips  # split 0's tails at least
    # B <= 16 and one split of 69 tiles: the threshold is on by default.
    skips = torch.zeros(2, dtype=torch.int32, device=device)
    assert_exact(hidden.to(device), weight.to(device), 12, sync_check=sync_check, tile_v=16, max_splits=1, skips=skips)
    assert skips.tolist()[1] == 69 and skips.tolist()[0] >= 60, skips


def case_drafter(device="cpu", dtypes=(torch.float32,), sync_check=False):
    """MFDDrafter.block_candidates threads the backend: float32 random inputs, so the logits agree
    up to the GEMMs' summation order (no near-ties at this seed)."""
    drafter = make_drafter(num_modes=4).to(device)
    features, ctx_pos, _, _ = inputs(3, 7)
    context = drafter.context_kv(features.to(device), ctx_pos.to(device))
    gen = torch.Generator().manual_seed(5)
    embed, lm_head = (torch.randn(VOCAB, HIDDEN, generator=gen).to(device) for _ in range(2))
    roots, starts = torch.tensor([1, 8, 30], device=device), torch.full((3,), 7, device=device)
    with torch.no_grad():
        for budget in (1, 6, 64):
            got, want = (drafter.block_candidates(roots, starts, context, embed, lm_head, budget, backend=backend)
                         for backend in ("triton", "torch"))
            assert torch.equal(got.tokens, want.tokens), budget
            torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)


CASES = {fn.__name__: fn for fn in (case_ties, case_shapes, case_drafter, case_threshold)}  # 2 per core


def test_interpreter_matches_torch() -> None:
    """Every case in one interpreter process (triton's import is paid once); its stdout lists the cases
    that ran to their end and its traceback names the one that failed."""
    run_cases(__file__, CASES)


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="backend 'bogus' is not one of 'torch', 'triton'"):
        vocab_candidates(torch.zeros(2, 4), torch.zeros(5, 4), 3, backend="bogus")


def test_cpu_without_interpreter_raises() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the CPU path is allowed")
    with pytest.raises(ValueError, match="CUDA tensors or TRITON_INTERPRET=1"):
        vocab_candidates(torch.zeros(2, 4), torch.zeros(5, 4), 3, backend="triton")


def test_float64_and_mixed_dtypes_are_rejected() -> None:
    with pytest.raises(ValueError, match="float64"):
        vocab_candidates(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(5, 4, dtype=torch.float64), 3,
                         backend="triton")
    with pytest.raises(ValueError, match="one dtype"):
        vocab_candidates(torch.zeros(2, 4), torch.zeros(5, 4, dtype=torch.bfloat16), 3, backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter mode is on")
def test_cuda_matches_torch_without_sync() -> None:
    for case in CASES.values():
        case(device="cuda", dtypes=CPU_DTYPES, sync_check=True)
    # Realistic shapes only a GPU runs quickly: integers stay exact in float32 / float16.
    hidden, weight = small_ints(20, (4, 8, 15, 256), -2, 3), small_ints(21, (151936, 256), -2, 3)
    for dtype in (torch.float32, torch.float16):
        for count in (16, 64):
            assert_exact(hidden.to("cuda", dtype), weight.to("cuda", dtype), count, sync_check=True)


def assert_close_random(hidden: torch.Tensor, weight: torch.Tensor, count: int) -> None:
    """Random 16-bit inputs: the two GEMMs may sum in different orders, so a logit can round to the
    neighbouring value and move across a run of equal logits. So: the candidates are ranked exactly
    by their own logits, each logit is its row's up to one rounding, nothing left out beats them
    (up to rounding), and they are the torch ones nearly everywhere."""
    from mfd_sglang.kernels.draft_vocab import vocab_top_logits_triton

    assert hidden.dtype in (torch.float16, torch.bfloat16)  # rounding dominates the accumulation error
    with host_syncs_raise(hidden.device):
        logits, ids, lognorm, _ = vocab_top_logits_triton(hidden, weight, count)
    want = vocab_candidates(hidden, weight, count)
    exact = hidden.double() @ weight.double().T  # [..., V]: the unrounded logits
    ulp = torch.finfo(hidden.dtype).eps * 2.0 ** torch.floor(torch.log2(logits.abs().double().clamp_min(1e-30)))
    assert (logits.double() - exact.gather(-1, ids)).abs().le(ulp).all()  # each value is its row's
    before, after = (logits[..., :-1], ids[..., :-1]), (logits[..., 1:], ids[..., 1:])
    assert ((after[0] < before[0]) | ((after[0] == before[0]) & (after[1] > before[1]))).all()  # ranked
    # Everything chosen beats, up to rounding, the count-th torch candidate (so all left out).
    floor = want.logprobs[..., -1:].double() + lognorm[..., None].double()
    assert (logits.double() >= floor - 2 * ulp.amax(-1, keepdim=True)).all()
    shared = (ids[..., :, None] == want.tokens[..., None, :]).any(-1).double().mean()
    assert shared > 0.97, f"only {shared:.3f} of the candidates are torch's"
    torch.testing.assert_close(logits - lognorm[..., None], want.logprobs, rtol=0, atol=4 * ulp.max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter mode is on")
def test_cuda_bfloat16_random_normal() -> None:
    gen = torch.Generator().manual_seed(22)
    hidden = torch.randn(4, 8, 15, 1024, generator=gen).to("cuda", torch.bfloat16)
    weight = (0.05 * torch.randn(151936, 1024, generator=gen)).to("cuda", torch.bfloat16)
    for count in (16, 64):
        assert_close_random(hidden, weight, count)
    assert_close_random(hidden.half(), weight.half(), 64)


if __name__ == "__main__":
    main(CASES)
