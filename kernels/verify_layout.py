"""The Triton walk of a batched draft tree's parent links into its SGLang verify layout
(`mfd_sglang.tree_layout.tree_to_verify_layout`): one launch, bit-identical to that torch reference.

The reference builds the ancestor mask by log2(N) boolean matrix squarings and the links from [bs, N, N]
comparisons: ~60 small launches on CUDA. Here one program per request holds its budget tree nodes in registers
(the root, everyone's ancestor, apart): the links are a [B, B] comparison and a min, the ancestors a walk up the
parent links (parents precede children, so every walk ends at the root after the tree's depth steps, at most
the drafter's block size - 1; padding hangs off the root). The [B, B] comparisons run in tiles of TILE rows
(`kernels.common.tree_walk_config`: 64 x 64 cells, one tile up to B = 64), so that no budget spills registers.

Why not SGLang's (`sglang.kernels.ops.speculative`): `build_tree_kernel_efficient` builds the layout of EAGLE's
top-k-per-step trees from their parent lists and selection indices, which a mixture tree is not.

Fixed shapes, no host sync (CUDA-graph safe). Local index 0 is the root, tree node i is local i + 1.
"""

import torch
import triton
import triton.language as tl

from mfd_sglang.handoffs import DraftTree, VerifyLayout
from mfd_sglang.kernels.common import tree_walk_config


@triton.jit
def _verify_layout_kernel(
    tokens_ptr, parents_ptr, depths_ptr, valid_ptr, roots_ptr, seq_lens_ptr,
    draft_token_ptr, positions_ptr, retrive_index_ptr, next_token_ptr, next_sibling_ptr, ancestor_ptr,
    B, BP: tl.constexpr, TILE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    N = B + 1
    tree = b * B
    node = tl.arange(0, BP)  # tree node n is local n + 1; the root (local 0) is handled on its own
    is_node = node < B
    parent = tl.load(parents_ptr + tree + node, mask=is_node, other=-1).to(tl.int32)
    linked = tl.load(valid_ptr + tree + node, mask=is_node, other=0) != 0
    depth = tl.load(depths_ptr + tree + node, mask=is_node, other=0)
    root = b * N
    out = root + 1 + node
    tl.store(draft_token_ptr + root, tl.load(roots_ptr + b).to(tl.int64))
    tl.store(draft_token_ptr + out, tl.load(tokens_ptr + tree + node, mask=is_node), mask=is_node)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    tl.store(positions_ptr + root, seq_len)
    tl.store(positions_ptr + out, seq_len + depth, mask=is_node)
    tl.store(retrive_index_ptr + root, root)
    tl.store(retrive_index_ptr + out, out, mask=is_node)

    # Only linked (valid) nodes are anybody's child or sibling; children are linked in node order.
    root_child = tl.min(tl.where((parent == -1) & linked, node + 1, N), axis=0)
    tl.store(next_token_ptr + root, tl.where(root_child < N, root_child, -1))
    tl.store(next_sibling_ptr + root, -1)
    mask = ancestor_ptr + root * N
    tl.store(mask, True)
    tl.store(mask + node + 1, False, mask=is_node)
    tl.store(mask + (node + 1) * N, True, mask=is_node)
    cols = node[None, :]
    for first in range(0, BP, TILE):  # TILE nodes (rows) against every node (columns) at a time
        row = first + tl.arange(0, TILE)
        is_row = row < B
        rows = row[:, None]
        row_parent = tl.load(parents_ptr + tree + row, mask=is_row, other=-1).to(tl.int32)
        row_linked = tl.load(valid_ptr + tree + row, mask=is_row, other=0) != 0
        row_out = root + 1 + row
        first_child = tl.min(tl.where((parent[None, :] == rows) & linked[None, :], cols + 1, N), axis=1)
        tl.store(next_token_ptr + row_out, tl.where(first_child < N, first_child, -1), mask=is_row)
        later_sibling = (parent[None, :] == row_parent[:, None]) & linked[None, :] & (cols > rows)
        next_sibling = tl.min(tl.where(later_sibling, cols + 1, N), axis=1)
        tl.store(next_sibling_ptr + row_out, tl.where(row_linked & (next_sibling < N), next_sibling, -1), mask=is_row)
        # Row of local i: the root's column (everyone's ancestor), then the node's own path up the parent links.
        ancestor = cols == rows
        above = row_parent
        while tl.max(above, axis=0) >= 0:
            ancestor |= cols == above[:, None]
            above = tl.load(parents_ptr + tree + above, mask=above >= 0, other=-1).to(tl.int32)
        tl.store(mask + (rows + 1) * N + cols + 1, ancestor, mask=(rows < B) & (cols < B))


def verify_layout_triton(tree: DraftTree, root_tokens: torch.Tensor, seq_lens: torch.Tensor) -> VerifyLayout:
    """`tree_to_verify_layout` in one launch (same fields, dtypes and values)."""
    bs, budget, config = tree_walk_config(tree)
    nodes = budget + 1
    i64 = dict(dtype=torch.int64, device=tree.tokens.device)
    fields = [torch.empty(bs, nodes, **i64) for _ in range(5)]
    ancestor = torch.empty(bs, nodes, nodes, dtype=torch.bool, device=tree.tokens.device)
    _verify_layout_kernel[(bs,)](
        tree.tokens.contiguous(), tree.parents.contiguous(), tree.depths.contiguous(), tree.valid.contiguous(),
        root_tokens.contiguous(), seq_lens.contiguous(), *fields, ancestor, budget, **config)
    return VerifyLayout(*fields, ancestor_mask=ancestor)
