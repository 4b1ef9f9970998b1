"""Triton `vocab_candidates`: the drafter's vocabulary top-B fused with its lm_head, the same contract
as the torch reference `mfd_sglang.drafter.vocab_candidates` (candidates best first, equal logits
in row order, float32 log-probabilities, int64 ids).

Fixed shapes and no host sync, so it can be captured in a CUDA graph. Two launches:

  1. `_vocab_top_kernel`, grid (row blocks of ROWS rows, vocabulary splits): each program walks its
     split's tiles of TILE_V weight rows. Per tile, the logits [ROWS, TILE_V] are a `tl.dot` over H
     in BLOCK_H chunks (float32 accumulation), rounded to the input dtype like torch's
     `(hidden @ weight.T).float()`; they feed an online (max, rescaled sum of exp) per row and a
     running top-BB of rank keys per row (bitonic networks over [ROWS, N]). The logits never exist
     beyond one tile. Per (row, split) it writes BB keys, the max and the sum.
     The running threshold: where B <= 16 and a split has >= 64 tiles, a tile that beats no row's
     current BB-th key skips the merge. On SmolLM2's real logits (`benchmarks/vocab_threshold.py`) that
     skipped 17-22 % of the merges at bs 32's launch plan and B = 16, but <= 2 % at B = 64 and none at
     bs 1's (11 tiles a split), while the check costs ~6 % more instructions a tile (and, at B = 64, ~50
     more registers): elsewhere it is compiled out.
  2. `_vocab_finish_kernel`, one program per row: the top-`count` of its splits * BB keys, the
     splits' (max, sum) combined into the log-normaliser, the keys decoded, the log-probabilities.

Exactness. The ranking sorts distinct int64 keys (`rank_keys.rank_key`: the logit's
order-preserving bits, then 2^31 - 1 - id), built and decoded exactly as the reference's
`rank_keys` / `from_rank_keys`, so equal logits give bit-equal ids and logits: ties to the lower
id, -0.0 as +0.0. 16-bit inputs rank their tiles on the int32 twin of these keys
(`rank_keys.short_rank_key`: the logit's 16 bits, its row within the split, which is why a split
spans at most 2^16 rows), half the instructions of an int64 network per step, turned into the
int64 keys before they are written: the same order, so the same result. The logits themselves are
torch's up to the GEMM's summation order, i.e. bit-equal whenever the dot products are exact (e.g.
small-integer inputs) and otherwise within the float32 accumulation error of any two GEMMs, before
the rounding to the input dtype (which both do). The normaliser is the reference's up to float32
rounding (the order of the sum of exp, the exp's own approximation on GPU): ~1e-7 relative. NaN
logits are unsupported.

Launch: ROWS = 16 .. 64 rows per program, ROWS x TILE_V at most 64 x 128 keys, half that for float32
inputs' int64 keys (tl.dot needs >= 16 rows; more cut the weight's re-reads, one per row block, and the
issue per product, but the [ROWS, TILE_V] key tile and its bitonic network live in registers: 64 x 128
int32 keys fit sm_90a's / sm_80's without spills, 64 x 256 spill); BB = count rounded up to a power of
two (>= 2); TILE_V = max(BB, min(128, V)) (a power of two); splits = min(tiles, cdiv(512, row blocks),
`VOCAB_SPLITS` = 128, as the finish merges splits * BB keys a row): a few hundred programs (16-bit
inputs: at least cdiv(V, 2^16) splits). Scratch: rows * splits * (8 * BB + 8) bytes (keys, max, sum),
which the memory plan counts.
"""

import torch
import triton
import triton.language as tl

from mfd_sglang.kernels.params import VOCAB_SPLITS, VOCAB_TILE, pow2
from mfd_sglang.kernels.bitonic import merge_top, merge_top_rows
from mfd_sglang.kernels.common import is_interpreted, require_cuda
from mfd_sglang.kernels.rank_keys import (
    MIN_KEY, MIN_SHORT_KEY, key_index, key_score, rank_key,
    short_key_to_rank_key, short_rank_key,
)
from mfd_sglang.handoffs import DraftCandidates

_TARGET_PROGRAMS = 512  # stage-1 programs aimed at: a few per SM of a large GPU
_MAX_ROWS = 64  # rows per program at most (int32 keys; int64 half): bounds the key tile's registers
_BLOCK_H = 64  # hidden chunk of one tl.dot
_FINISH_TILE = 1024  # keys per merge of the finishing kernel
_SHORT_KEY_ROWS = 2**16  # vocabulary rows a split of 16-bit inputs spans at most
_THRESHOLD_MAX_BB, _THRESHOLD_MIN_TILES = 16, 64  # where the running threshold is on (module docstring)


@triton.jit
def _vocab_top_kernel(
    hidden_ptr, weight_ptr, keys_ptr, max_ptr, sum_ptr, skips_ptr,
    n_rows, V, H, tiles_per_split, n_splits,
    stride_hr, stride_hh, stride_wv, stride_wh,
    ROWS: tl.constexpr, TILE_V: tl.constexpr, BLOCK_H: tl.constexpr, BB: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, SHORT_KEYS: tl.constexpr, IS_BF16: tl.constexpr,
    THRESHOLD: tl.constexpr, COUNT_SKIPS: tl.constexpr,
):
    split = tl.program_id(1)  # row blocks vary fastest: programs sharing a split share its weight in L2
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    hidden_rows = hidden_ptr + rows.to(tl.int64)[:, None] * stride_hr
    lanes = tl.arange(0, TILE_V)
    chunk = tl.arange(0, BLOCK_H)
    if SHORT_KEYS:
        running = tl.full([ROWS, BB], MIN_SHORT_KEY, tl.int32)
    else:
        running = tl.full([ROWS, BB], MIN_KEY, tl.int64)
    row_max = tl.full([ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([ROWS], tl.float32)
    skipped = 0
    first = split.to(tl.int64) * tiles_per_split * TILE_V  # int64: no overflow near V = 2^31
    last = tl.minimum(V, first + tiles_per_split * TILE_V)
    for start in range(first, last, TILE_V):  # every tile holds >= 1 real row: start < V
        v = start + lanes
        v_ok = v < V
        weight_rows = weight_ptr + v[:, None] * stride_wv
        acc = tl.zeros([ROWS, TILE_V], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + chunk
            h_ok = h < H
            x = tl.load(hidden_rows + h[None, :] * stride_hh, mask=row_ok[:, None] & h_ok[None, :], other=0.0)
            w = tl.load(weight_rows + h[None, :] * stride_wh, mask=v_ok[:, None] & h_ok[None, :], other=0.0)
            if UPCAST:  # the interpreter's tl.dot cannot read bfloat16; the products are exact in fp32
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        # Rounded to the input dtype, as torch's matmul output is before `.float()`.
        logits = acc.to(hidden_ptr.dtype.element_ty).to(tl.float32)
        if SHORT_KEYS:  # the split spans < 2^16 rows: v - first fits a short key's index
            keys = tl.where(v_ok[None, :], short_rank_key(logits, (v - first).to(tl.int32)[None, :], IS_BF16),
                            MIN_SHORT_KEY)
        else:
            keys = tl.where(v_ok[None, :], rank_key(logits, v[None, :]), MIN_KEY)
        if THRESHOLD:
            # A tile with no key above any live row's current BB-th (`running` is sorted descending) cannot
            # change the top-BB: the program skips its merge (exact: keys are distinct).
            enters = (tl.max(keys, axis=1) > tl.min(running, axis=1)) & row_ok
            if tl.max(enters.to(tl.int32), axis=0) > 0:
                running = merge_top_rows(running, keys, ROWS, TILE_V, BB)
            elif COUNT_SKIPS:
                skipped += 1
        else:
            running = merge_top_rows(running, keys, ROWS, TILE_V, BB)
        real = tl.where(v_ok[None, :], logits, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(real, axis=1))  # finite: the tile has a real row
        row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(tl.exp(real - new_max[:, None]), axis=1)
        row_max = new_max
    out = rows.to(tl.int64) * n_splits + split
    slot = tl.arange(0, BB)
    if SHORT_KEYS:
        running = short_key_to_rank_key(running, first, IS_BF16)
    tl.store(keys_ptr + out[:, None] * BB + slot[None, :], running, mask=row_ok[:, None])
    tl.store(max_ptr + out, row_max, mask=row_ok)
    tl.store(sum_ptr + out, row_sum, mask=row_ok)
    if COUNT_SKIPS:
        tl.atomic_add(skips_ptr, skipped)
        tl.atomic_add(skips_ptr + 1, tl.cdiv(last - first, TILE_V).to(tl.int32))


@triton.jit
def _vocab_finish_kernel(
    keys_ptr, max_ptr, sum_ptr, logits_ptr, ids_ptr, lognorm_ptr, logprobs_ptr,
    n_keys, n_splits, count,
    BB: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr,
):
    """One program per row: the top-`count` of the splits' n_keys = splits * BB keys (TILE at a time),
    the splits' (max, sum) combined into the log-normaliser, the keys decoded, the log-probabilities."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.arange(0, SPLITS)
    split_ok = split < n_splits
    maxes = tl.load(max_ptr + row * n_splits + split, mask=split_ok, other=float("-inf"))
    sums = tl.load(sum_ptr + row * n_splits + split, mask=split_ok, other=0.0)
    top_max = tl.max(maxes, axis=0)  # finite: every split has a real row
    lognorm = top_max + tl.log(tl.sum(sums * tl.exp(maxes - top_max), axis=0))
    lanes = tl.arange(0, TILE)
    running = tl.full([BB], MIN_KEY, tl.int64)
    for start in range(0, n_keys, TILE):
        at = start + lanes
        tile = tl.load(keys_ptr + row * n_keys + at, mask=at < n_keys, other=MIN_KEY)
        running = merge_top(running, tile, TILE, BB)
    slot = tl.arange(0, BB)
    keep = slot < count
    logits = key_score(running)
    tl.store(logits_ptr + row * count + slot, logits, mask=keep)
    tl.store(ids_ptr + row * count + slot, key_index(running), mask=keep)
    tl.store(logprobs_ptr + row * count + slot, logits - lognorm, mask=keep)
    tl.store(lognorm_ptr + row, lognorm)


def _vocab_top_warps(block_rows: int, tile: int, bb: int) -> int:
    """Warps of a `_vocab_top_kernel` program: 4 for a key tile of at most 2048 keys with a running top of at most
    16, else 8. A 16 x 128 tile (one request's single mode: <= 16 rows) with a running top of 32 or 64 keeps 16
    bytes of local memory on 4 warps (128 registers, sm_90a at B = 32 and 64, sm_80 at 32); on 8 warps it has
    102-106 registers and none. The warps split the rows and tile, not the dot's hidden chunks: the same logits and
    candidates (the normaliser up to its float32 summation order, as the module docstring allows)."""
    return 4 if block_rows * tile <= 2048 and bb <= 16 else 8


def vocab_top_logits_triton(
    hidden: torch.Tensor, weight: torch.Tensor, count: int, *, tile_v: int | None = None,
    block_h: int | None = None, rows_per_block: int | None = None, max_splits: int | None = None,
    threshold: bool | None = None, skips: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `count` best rows of `hidden @ weight.T` per leading index: (logits [..., C] float32, ids
    [..., C] int64, log-normaliser [...] float32, log-probabilities = logits - log-normaliser [..., C]),
    C = min(count, V).

    hidden [..., H] and weight [V, H] of one dtype (float32, float16 or bfloat16), V < 2^31, CUDA
    tensors (or CPU ones under TRITON_INTERPRET=1 set before triton is imported), else ValueError.
    The keyword arguments tune the launch (powers of two; None picks a default): weight rows per
    tile (>= the top width), hidden chunk of one dot (>= 16), rows per program (>= 16), and an upper
    bound on the vocabulary splits (which 16-bit inputs exceed where a split would span > 2^16 rows).
    threshold: the running threshold on or off (None: where it pays, see the module docstring); skips: an
    int32 tensor [2] on hidden's device to which a launch with the threshold adds the (program, tile) merges
    it skipped and the (program, tile) pairs it ran (diagnostics).
    """
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden [..., H] and weight [V, H] do not match: {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if hidden.dtype not in (torch.float32, torch.float16, torch.bfloat16) or weight.dtype != hidden.dtype:
        raise ValueError(f"the Triton vocab_candidates takes float32/16 or bfloat16 hidden and weight of "
                         f"one dtype, not {hidden.dtype} and {weight.dtype}")
    if hidden.device != weight.device:
        raise ValueError(f"hidden is on {hidden.device}, weight on {weight.device}")
    require_cuda(hidden, "the Triton vocab_candidates")
    if skips is not None and (skips.shape != (2,) or skips.dtype != torch.int32 or skips.device != hidden.device):
        raise ValueError(f"skips must be an int32 tensor [2] on {hidden.device}, got {skips.dtype} "
                         f"{tuple(skips.shape)} on {skips.device}")
    vocab, size = weight.shape
    if not 0 < vocab < 2**31:
        raise ValueError(f"the vocabulary must have 1 .. 2^31 - 1 rows, not {vocab}")
    count = min(count, vocab)
    lead = hidden.shape[:-1]
    dev = hidden.device
    rows = hidden.reshape(-1, size)
    n_rows = rows.shape[0]
    if n_rows == 0:
        return (torch.empty(*lead, count, dtype=torch.float32, device=dev),
                torch.empty(*lead, count, dtype=torch.int64, device=dev),
                torch.empty(lead, dtype=torch.float32, device=dev),
                torch.empty(*lead, count, dtype=torch.float32, device=dev))

    bb = pow2(count)
    tile = max(bb, tile_v or min(VOCAB_TILE, pow2(vocab)))
    chunk = block_h or max(16, min(_BLOCK_H, triton.next_power_of_2(size)))
    short_keys = hidden.dtype != torch.float32 and tile <= _SHORT_KEY_ROWS
    # The [rows, tile] key tile is at most _MAX_ROWS x VOCAB_TILE int32 keys (int64 keys: half): at B = 256 a
    # 64 x 256 tile spills on sm_90a and sm_80, 32 x 256 does not.
    key_cells = _MAX_ROWS * VOCAB_TILE // (1 if short_keys else 2)
    block_rows = rows_per_block or max(16, min(_MAX_ROWS, key_cells // tile, triton.next_power_of_2(n_rows)))
    if tile & (tile - 1) or chunk & (chunk - 1) or block_rows & (block_rows - 1):
        raise ValueError(f"tile_v, block_h and rows_per_block must be powers of two: {tile}, {chunk}, "
                         f"{block_rows}")
    if chunk < 16 or block_rows < 16:
        raise ValueError(f"tl.dot needs block_h and rows_per_block >= 16, not {chunk}, {block_rows}")
    row_blocks = triton.cdiv(n_rows, block_rows)
    tiles = triton.cdiv(vocab, tile)
    splits = min(tiles, max(1, triton.cdiv(_TARGET_PROGRAMS, row_blocks)), VOCAB_SPLITS, max_splits or tiles)
    if short_keys:  # a split's rows must fit a short key's 16-bit index
        splits = max(splits, triton.cdiv(tiles, _SHORT_KEY_ROWS // tile))
    tiles_per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, tiles_per_split)  # no split without a tile
    if threshold is None:
        threshold = bb <= _THRESHOLD_MAX_BB and tiles_per_split >= _THRESHOLD_MIN_TILES
    if skips is not None and not threshold:
        raise ValueError("skips counts the running threshold's skipped merges: it needs threshold on")

    keys = torch.empty(n_rows, splits, bb, dtype=torch.int64, device=dev)
    maxes = torch.empty(n_rows, splits, dtype=torch.float32, device=dev)
    sums = torch.empty(n_rows, splits, dtype=torch.float32, device=dev)
    _vocab_top_kernel[(row_blocks, splits)](
        rows, weight, keys, maxes, sums, keys if skips is None else skips,
        n_rows, vocab, size, tiles_per_split, splits,
        rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1),
        ROWS=block_rows, TILE_V=tile, BLOCK_H=chunk, BB=bb,
        UPCAST=is_interpreted() and hidden.dtype == torch.bfloat16,
        # float32 inputs: full-precision products like torch's default matmul (no TF32); 16-bit
        # inputs ignore it (tensor cores, float32 accumulation).
        PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        SHORT_KEYS=short_keys, IS_BF16=hidden.dtype == torch.bfloat16, THRESHOLD=threshold,
        COUNT_SKIPS=skips is not None,
        num_warps=_vocab_top_warps(block_rows, tile, bb),
    )
    logits = torch.empty(n_rows, count, dtype=torch.float32, device=dev)
    ids = torch.empty(n_rows, count, dtype=torch.int64, device=dev)
    lognorm = torch.empty(n_rows, dtype=torch.float32, device=dev)
    logprobs = torch.empty(n_rows, count, dtype=torch.float32, device=dev)
    # Distinct keys: the merge's order is exact; padding keys (MIN_KEY) rank below the >= count real ones.
    _vocab_finish_kernel[(n_rows,)](
        keys, maxes, sums, logits, ids, lognorm, logprobs, splits * bb, splits, count,
        BB=bb, TILE=max(bb, min(_FINISH_TILE, pow2(splits * bb))), SPLITS=pow2(splits),
    )
    return (logits.view(*lead, count), ids.view(*lead, count), lognorm.view(lead),
            logprobs.view(*lead, count))


def vocab_candidates_triton(hidden: torch.Tensor, weight: torch.Tensor, count: int, **launch) -> DraftCandidates:
    """`mfd_sglang.drafter.vocab_candidates` on Triton: the `count` best rows of `hidden @ weight.T`
    per leading index as float32 log-probabilities, best first, equal logits in row order; the same
    shapes and dtypes. Ids (and logits) bit-equal to the reference's when the logits are (see the
    module docstring), log-probabilities up to the normaliser's float32 rounding. Inputs and
    `launch` keywords: `vocab_top_logits_triton`."""
    _, ids, _, logprobs = vocab_top_logits_triton(hidden, weight, count, **launch)
    return DraftCandidates(logprobs, ids, weight.shape[0])
