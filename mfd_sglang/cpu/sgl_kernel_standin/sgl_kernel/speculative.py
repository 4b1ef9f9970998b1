"""``sgl_kernel.speculative`` stand-in (pure torch; see the package docstring)."""

from __future__ import annotations

import torch

from . import _trace


@_trace
def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,  # bool/uint8, flat [bs * n * n], row i = node i, column j = node j
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,  # mutable [bs * n]
    retrive_index: torch.Tensor,  # mutable [bs, n]
    retrive_next_token: torch.Tensor,  # mutable [bs, n]
    retrive_next_sibling: torch.Tensor,  # mutable [bs, n]
    batch_size: int,
    draft_token_num: int,
) -> None:
    """NGRAM verify metadata from a QLEN_ONLY ancestor mask (twin:
    ``_reconstruct_tree_mask_kernel`` in kernels/ops/speculative/reconstruct_tree.py):
    positions = #strict ancestors + seq_len, retrive_index = b*n + i, next_token = the first later
    node that has i as an ancestor, next_sibling = the first later node with the same parent
    (-1 for the root)."""
    bs, n = int(batch_size), int(draft_token_num)
    if bs == 0:
        return
    m = tree_mask.reshape(-1)[: bs * n * n].reshape(bs, n, n).to(torch.bool)
    idx = torch.arange(n, device=m.device)
    row, col = idx[:, None], idx[None, :]
    anc = m & (col < row)  # anc[b, i, j]: j is a strict ancestor of i
    depth = anc.sum(dim=2)
    positions.view(-1)[: bs * n] = (depth + verified_seq_len.reshape(-1)[:bs, None].to(torch.int64)).reshape(-1).to(positions.dtype)
    retrive_index.view(-1)[: bs * n] = torch.arange(bs * n, device=m.device).to(retrive_index.dtype)

    big = torch.full_like(anc, n, dtype=torch.int64)
    parent = torch.where(anc, col.expand_as(anc), torch.full_like(big, -1)).amax(dim=2)  # [bs, n]
    first_child = torch.where(anc, row.expand_as(anc), big).amin(dim=1)  # over rows k, per column
    next_token = torch.where(first_child < n, first_child, torch.full_like(first_child, -1))

    same = (parent[:, :, None] == parent[:, None, :]) & (row > col)  # [b, k, tid]: k after tid, same parent
    first_sib = torch.where(same, row.expand_as(same), big).amin(dim=1)
    next_sibling = torch.where((parent >= 0) & (first_sib < n), first_sib, torch.full_like(first_sib, -1))

    retrive_next_token.view(-1)[: bs * n] = next_token.reshape(-1).to(retrive_next_token.dtype)
    retrive_next_sibling.view(-1)[: bs * n] = next_sibling.reshape(-1).to(retrive_next_sibling.dtype)
