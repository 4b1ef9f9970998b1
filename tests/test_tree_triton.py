"""The Triton build_mixture_tree against the torch reference, bit for bit.

On CPU the kernels run under the Triton interpreter. TRITON_INTERPRET is read when @triton.jit
decorates a kernel (at import), and other tests may import triton first, so each CPU group runs
this file as a script in a subprocess with TRITON_INTERPRET=1. The CUDA test runs in-process.
"""

import os

import pytest
import torch

from interpreted import main, run_cases
from mfd_sglang.cuda_graph import host_syncs_raise
from mfd_sglang.tree import build_mixture_tree, top_candidates

FIELDS = ("tokens", "parents", "depths", "scores", "modes", "valid")


def random_logprobs(seed: int, shape, dtype=torch.float32, spread: float = 1.0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    logprobs = (spread * torch.randn(*shape, generator=generator)).log_softmax(-1)
    return logprobs.to(device=device, dtype=dtype)


def assert_same_tree(logprobs: torch.Tensor, budget: int, *, sync_check: bool = False,
                     from_candidates: bool = False) -> None:
    """The Triton tree equals the torch tree, from the full log-probs and, with from_candidates, from
    their top candidates too (the serving path's input, which skips the vocabulary top-B kernel)."""
    expected = build_mixture_tree(logprobs, budget)
    inputs = [logprobs, top_candidates(logprobs, budget)] if from_candidates else [logprobs]
    for given in inputs:
        with host_syncs_raise(given.device if sync_check else "cpu"):  # a host sync in the launch path raises
            got = build_mixture_tree(given, budget, backend="triton")
        where = f"shape {tuple(logprobs.shape)} {logprobs.dtype} budget {budget} from {type(given).__name__}"
        for name in FIELDS:
            want, have = getattr(expected, name), getattr(got, name)
            assert have.dtype == want.dtype and have.shape == want.shape, f"{name}: {where}"
            assert have.device == want.device, f"{name}: {where}"
            assert torch.equal(have, want), f"{name} differs: {where}\n{want}\n{have}"


# (bs, K, D, V, budget): small enough for the interpreter (it runs every program in Python).
SHAPES = [
    (1, 1, 1, 3, 1),
    (2, 1, 3, 3, 50),  # K = 1; 39 prefixes < budget: padding
    (2, 2, 4, 2, 40),  # V = 2; 30 prefixes: padding
    (1, 3, 2, 5, 33),  # 30 prefixes: padding
    (3, 2, 5, 4, 6),
    (1, 4, 3, 5, 1),
    (2, 8, 3, 10, 12),  # K = 8
    (1, 2, 15, 5, 20),  # D = 15
    (1, 8, 6, 7, 16),
]


def case_shapes(device="cpu", dtypes=(torch.float32,), sync_check=False):  # other dtypes: wide, ties, CUDA
    for seed, shape in enumerate(SHAPES):
        *dims, budget = shape
        for dtype in dtypes:
            assert_same_tree(random_logprobs(seed, dims, dtype, device=device), budget,
                             sync_check=sync_check, from_candidates=dtype == dtypes[0])
    # Unbatched [K, D, V] input gives an unbatched tree.
    assert_same_tree(random_logprobs(99, (3, 4, 6), device=device), 10, sync_check=sync_check)


def case_wide(device="cpu", dtypes=(torch.float32, torch.float16, torch.bfloat16), sync_check=False):
    # Peaked distributions mix deep and wide parts; V not a power of two, larger budgets.
    for dtype in dtypes:
        assert_same_tree(random_logprobs(1, (2, 3, 5, 300), dtype, 4.0, device), 48,
                         sync_check=sync_check)
        assert_same_tree(random_logprobs(2, (1, 2, 4, 100), dtype, 3.0, device), 64,
                         sync_check=sync_check)


def case_large_vocab(device="cpu", dtypes=(torch.float32, torch.float16), sync_check=False):
    assert_same_tree(random_logprobs(3, (1, 2, 2, 32768), dtypes[0], 3.0, device), 8,
                     sync_check=sync_check)
    assert_same_tree(random_logprobs(4, (1, 1, 2, 40000), dtypes[-1], 3.0, device), 5,
                     sync_check=sync_check)


def case_ties(device="cpu", dtypes=(torch.float32, torch.float16), sync_check=False):
    for dtype in dtypes:
        # Two identical modes propose exactly the same prefixes with the same scores.
        logprobs = random_logprobs(5, (2, 3, 4, 6), dtype, device=device)
        logprobs[:, 2] = logprobs[:, 0]
        assert_same_tree(logprobs, 20, sync_check=sync_check)
        # Quantised logprobs: many exactly equal tokens, paths and cross-mode scores.
        logprobs = (random_logprobs(6, (2, 4, 5, 8), device=device) * 2).round() / 2
        assert_same_tree(logprobs.to(dtype), 24, sync_check=sync_check, from_candidates=True)
        # Uniform: every prefix of a depth ties.
        uniform = torch.full((1, 3, 4, 4), -1.3862943611198906, device=device, dtype=dtype)
        assert_same_tree(uniform, 30, sync_check=sync_check)
        # Certain drafters (0 / -inf): chains, then padding; -inf prefixes never included.
        tokens = torch.tensor([[3, 1, 4, 1], [1, 0, 2, 1]], device=device)
        certain = torch.nn.functional.one_hot(tokens, 5).to(dtype).log()[None]
        assert_same_tree(certain, 10, sync_check=sync_check)
        masked = random_logprobs(7, (2, 2, 3, 4), dtype, device=device)
        drop = torch.rand(masked.shape, generator=torch.Generator().manual_seed(8)) < 0.5
        masked[drop.to(device)] = float("-inf")
        for budget in (1, 5, 20, 90):
            assert_same_tree(masked, budget, sync_check=sync_check)


CASES = {fn.__name__: fn for fn in (case_shapes, case_wide, case_large_vocab, case_ties)}


def test_interpreter_matches_torch() -> None:
    """Every case in one interpreter process (each process spends seconds importing triton); its stdout
    lists the cases that finished and its traceback names the one that failed."""
    run_cases(__file__, CASES, timeout=900)


def test_cpu_without_interpreter_raises() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the CPU path is allowed")
    with pytest.raises(ValueError, match="CUDA tensors or TRITON_INTERPRET=1"):
        build_mixture_tree(torch.zeros(2, 2, 3, 4).log_softmax(-1), 4, backend="triton")


def test_float64_is_rejected() -> None:
    with pytest.raises(ValueError, match="float64"):
        build_mixture_tree(torch.zeros(1, 2, 3, 4, dtype=torch.float64), 4, backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter mode is on")
def test_cuda_matches_torch_without_sync() -> None:
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    for case in CASES.values():
        case(device="cuda", dtypes=dtypes, sync_check=True)
    # Bigger, realistic shapes only a GPU runs quickly.
    for dtype in (torch.float32, torch.bfloat16):
        logprobs = random_logprobs(9, (4, 8, 15, 151936), dtype, 4.0, "cuda")
        for budget in (64, 100):
            assert_same_tree(logprobs, budget, sync_check=True)


if __name__ == "__main__":
    main(CASES)
