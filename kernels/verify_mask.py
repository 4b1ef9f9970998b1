"""Triton `full_custom_mask` (`mfd_sglang.tree_layout`): SGLang's flat FULL_MASK custom mask of a batch's tree
windows, bit-identical to the torch reference, in two launches (the all-True fill, then one program per
request writing its N x N tree cells) where the reference's index arithmetic takes a dozen.

Request b's block starts at N * sum(seq_lens[:b]) + b * N * N (each program sums the lengths before it), its
row i at + i * (seq_len + N); the row's prefix columns stay True, its tree columns are the ancestor mask's row.
Fixed shapes, no host sync.
"""

import torch
import triton
import triton.language as tl

from mfd_sglang.kernels.params import pow2
from mfd_sglang.kernels.common import require_cuda

_SUM_BLOCK = 128  # requests' lengths summed a step


# total_len changes every round (a bound of the batch's lengths): not specialised on, so one compile per window
# serves every round (`mfd_sglang.serving.warmup`); the batch size is a loop bound, not a constexpr.
@triton.jit(do_not_specialize=["total_len"])
def _tree_cells_kernel(ancestor_ptr, seq_lens_ptr, mask_ptr, N, total_len, SUM_BLOCK: tl.constexpr,
                       NP: tl.constexpr, ROWS: tl.constexpr):
    b = tl.program_id(0)
    lens_before = b.to(tl.int64) * 0
    for first in range(0, b, SUM_BLOCK):  # the lengths of the requests before b
        before = first + tl.arange(0, SUM_BLOCK)
        lens_before += tl.sum(tl.load(seq_lens_ptr + before, mask=before < b, other=0).to(tl.int64), axis=0)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    start = N * lens_before + b.to(tl.int64) * N * N
    col = tl.arange(0, NP)[None, :]
    for first in range(0, N, ROWS):  # ROWS rows at a time: a [ROWS, NP] tile of int64 addresses in registers
        row = first + tl.arange(0, ROWS)[:, None]
        inside = (row < N) & (col < N)
        cells = tl.load(ancestor_ptr + b.to(tl.int64) * N * N + row * N + col, mask=inside, other=0)
        at = start + seq_len + row * (seq_len + N) + col
        tl.store(mask_ptr + at, cells, mask=inside & (at < total_len))  # a short total_len: cut, never overrun


def full_custom_mask_triton(ancestor_mask: torch.Tensor, seq_lens: torch.Tensor, total_len: int) -> torch.Tensor:
    """`full_custom_mask` with a given total_len (N * sum(seq_lens) + bs * N * N, or any larger bound)."""
    require_cuda(ancestor_mask, "the Triton custom mask")
    bs, num_nodes, _ = ancestor_mask.shape
    mask = torch.ones(total_len, dtype=torch.bool, device=ancestor_mask.device)
    if bs:
        _tree_cells_kernel[(bs,)](ancestor_mask.contiguous(), seq_lens.contiguous(), mask, num_nodes, total_len,
                                  SUM_BLOCK=_SUM_BLOCK, NP=pow2(num_nodes), ROWS=16)
    return mask
