"""Bitonic top-k networks over int64 rank keys, shared by the Triton kernels: written with
reshape/split/join (tl.topk is ~25x slower under the Triton interpreter, which the CPU tests run on),
over a leading dimension of R rows, every row [N] ranked on its own (R = 1 for one vector). Keys are
distinct, so any exact network agrees with any other and with a stable sort."""

import triton
import triton.language as tl


@triton.constexpr_function
def _log2(n):
    return n.bit_length() - 1


@triton.jit
def exchange_rows(x, R: tl.constexpr, N: tl.constexpr, S: tl.constexpr, RUN: tl.constexpr,
                   ASCENDING: tl.constexpr):
    """One compare-exchange step over every row of x [R, N]: lanes i and i + S (i & S == 0) swap
    into order; runs of RUN lanes alternate direction, the first run descending (ascending if
    ASCENDING=1)."""
    a, b = tl.split(tl.permute(tl.reshape(x, [R, N // (2 * S), 2, S]), (0, 1, 3, 2)))
    first_lane = tl.arange(0, N // (2 * S))[None, :, None] * (2 * S)
    descending = (first_lane // RUN + ASCENDING) % 2 == 0
    hi = tl.maximum(a, b)
    lo = tl.minimum(a, b)
    y = tl.join(tl.where(descending, hi, lo), tl.where(descending, lo, hi))
    return tl.reshape(tl.permute(y, (0, 1, 3, 2)), [R, N])


@triton.jit
def sort_bitonic_runs_rows(x, R: tl.constexpr, N: tl.constexpr, RUN: tl.constexpr,
                            ASCENDING: tl.constexpr):
    """Sorts every run of RUN lanes of every row of x [R, N] whose lanes form a bitonic sequence."""
    for i in tl.static_range(_log2(RUN)):
        x = exchange_rows(x, R, N, RUN // (2 << i), RUN, ASCENDING)
    return x


@triton.jit
def top_k_rows(x, R: tl.constexpr, N: tl.constexpr, K: tl.constexpr, ASCENDING: tl.constexpr):
    """The K largest of every row of x [R, N] (powers of two, K <= N), sorted (descending;
    ascending if ASCENDING=1): [R, K]."""
    for i in tl.static_range(1, _log2(K) + 1):  # sort runs of K, alternating direction
        x = sort_bitonic_runs_rows(x, R, N, 1 << i, ASCENDING)
    for i in tl.static_range(_log2(N) - _log2(K)):
        # Lane-wise max of a run and its oppositely sorted neighbour: a bitonic run holding the K
        # largest of the two. (x has N >> i lanes per row here; static_range unrolls.)
        a, b = tl.split(tl.permute(tl.reshape(x, [R, (N >> i) // (2 * K), 2, K]), (0, 1, 3, 2)))
        half = tl.reshape(tl.maximum(a, b), [R, (N >> i) // 2])
        x = sort_bitonic_runs_rows(half, R, (N >> i) // 2, K, ASCENDING)
    return x


@triton.jit
def merge_top_rows(running, tile, R: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    """Per row, the K largest of running [R, K] (rows sorted descending) and tile [R, N >= K],
    sorted descending."""
    bitonic = tl.maximum(running, top_k_rows(tile, R, N, K, 1))
    return sort_bitonic_runs_rows(bitonic, R, K, K, 0)


@triton.jit
def merge_top(running, tile, N: tl.constexpr, K: tl.constexpr):
    """The K largest of running [K] (sorted descending) and tile [N >= K], sorted descending."""
    merged = merge_top_rows(tl.reshape(running, [1, K]), tl.reshape(tile, [1, N]), 1, N, K)
    return tl.reshape(merged, [K])
