"""Triton walks of a batched draft tree's parent links: its SGLang verify layout
(`mfd_sglang.tree_layout.tree_to_verify_layout`) and its accepted path given the target's token at every
node (`mfd_sglang.verify.accept_path`), one launch each, bit-identical to those torch references.

The references build the ancestor mask by log2(N) boolean matrix squarings and the links from
[bs, N, N] comparisons: ~60 small launches each on CUDA. Here one program per request holds its budget
tree nodes in registers (the root, everyone's ancestor, apart): the links are a [B, B] comparison and
a min, the ancestors a walk up the parent links (parents precede children, so every walk ends at the
root after the tree's depth steps, at most the drafter's block size - 1; padding hangs off the root).
The [B, B] comparisons run in tiles of TILE rows (64 x 64 cells: one tile up to B = 64), so that no budget
spills registers.

Why not SGLang's (`sglang.kernels.ops.speculative`): `build_tree_kernel_efficient` builds the layout of
EAGLE's top-k-per-step trees from their parent lists and selection indices, which a mixture tree is not;
`verify_tree_greedy` walks the sibling lists serially and writes EAGLE's outputs (flat predicts, global
accept indices), which `TreeVerifyResult` would need several more launches to be made from.

Fixed shapes, no host sync (CUDA-graph safe). Local index 0 is the root, tree node i is local i + 1.
"""

import torch
import triton
import triton.language as tl

from mfd_sglang.kernels.params import pow2
from mfd_sglang.kernels.rank_keys import require_cuda
from mfd_sglang.handoffs import DraftTree, TreeVerifyResult, VerifyLayout

_TILE_CELLS = 64 * 64  # cells of a [rows, nodes] comparison tile: 32 a thread at 4 warps


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


@triton.jit
def _matched(tokens_ptr, valid_ptr, target_ptr, node, parent, mask):
    """Where mask: whether tree node `node` is valid and its token the target's token after its parent."""
    valid = tl.load(valid_ptr + node, mask=mask, other=0) != 0
    token = tl.load(tokens_ptr + node, mask=mask, other=0)
    return mask & valid & (token == tl.load(target_ptr + parent + 1, mask=mask, other=0))


@triton.jit
def _accept_path_kernel(
    tokens_ptr, parents_ptr, depths_ptr, valid_ptr, target_ptr,
    accept_lens_ptr, accepted_tokens_ptr, path_ptr, bonus_ptr,
    B, BP: tl.constexpr, TILE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    N = B + 1
    tokens_ptr += b * B
    parents_ptr += b * B
    valid_ptr += b * B
    target_ptr += b * N
    node = tl.arange(0, BP)  # tree node n is local n + 1
    is_node = node < B
    depth = tl.load(depths_ptr + b * B + node, mask=is_node, other=0)
    # Accepted: the node and every ancestor matched (the root always is).
    above = tl.load(parents_ptr + node, mask=is_node, other=-1).to(tl.int32)
    accepted = _matched(tokens_ptr, valid_ptr, target_ptr, node, above, is_node)
    while tl.max(above, axis=0) >= 0:
        on_path = above >= 0
        grand = tl.load(parents_ptr + above, mask=on_path, other=-1).to(tl.int32)
        accepted &= ~on_path | _matched(tokens_ptr, valid_ptr, target_ptr, above, grand, on_path)
        above = grand
    # The deepest accepted node, the first on ties; the root (local 0, depth 0) when none is.
    reach = tl.where(accepted, depth, 0)
    deepest = tl.max(reach, axis=0)
    last = tl.where(deepest > 0, tl.min(tl.where(reach == deepest, node, BP), axis=0) + 1, 0)
    bonus = tl.load(target_ptr + last)
    tl.store(accept_lens_ptr + b, deepest + 1)
    tl.store(bonus_ptr + b, bonus)
    # Column c: the accepted node at depth c + 1 (the largest local index, as the reference's amax), else -1;
    # the deepest's column holds the bonus (TILE columns against every node at a time). Column B (depth B + 1)
    # never holds a node.
    row = b * N
    for first in range(0, BP, TILE):
        column = first + tl.arange(0, TILE)
        hit = accepted[None, :] & (depth[None, :] == column[:, None] + 1)
        path = tl.max(tl.where(hit, node[None, :] + 1, -1), axis=1)
        path_token = tl.load(tokens_ptr + path - 1, mask=path >= 1, other=0)
        accepted_token = tl.where(column == deepest, bonus, tl.where(path >= 0, path_token, -1))
        tl.store(path_ptr + row + column, path.to(tl.int64), mask=column < B)
        tl.store(accepted_tokens_ptr + row + column, accepted_token, mask=column < B)
    tl.store(path_ptr + row + B, -1)
    tl.store(accepted_tokens_ptr + row + B, tl.where(deepest == B, bonus, -1))


def _launch_config(tree: DraftTree) -> tuple[int, int, dict]:
    if tree.tokens.dim() != 2:
        raise ValueError("the tree walk kernels need a batched tree ([bs, budget] fields)")
    require_cuda(tree.tokens, "the Triton tree walk")
    bs, budget = tree.tokens.shape
    # The [B, B] comparisons of a program over its tree nodes (the root on its own: B = 64 fills 64 lanes) in
    # tiles of _TILE_CELLS: one tile up to B = 64; a whole [256, 256] one spills on sm_90a and sm_80.
    nodes = pow2(budget)
    return bs, budget, dict(BP=nodes, TILE=min(nodes, max(1, _TILE_CELLS // nodes)), num_warps=4)


def verify_layout_triton(tree: DraftTree, root_tokens: torch.Tensor, seq_lens: torch.Tensor) -> VerifyLayout:
    """`tree_to_verify_layout` in one launch (same fields, dtypes and values)."""
    bs, budget, config = _launch_config(tree)
    nodes = budget + 1
    i64 = dict(dtype=torch.int64, device=tree.tokens.device)
    fields = [torch.empty(bs, nodes, **i64) for _ in range(5)]
    ancestor = torch.empty(bs, nodes, nodes, dtype=torch.bool, device=tree.tokens.device)
    _verify_layout_kernel[(bs,)](
        tree.tokens.contiguous(), tree.parents.contiguous(), tree.depths.contiguous(), tree.valid.contiguous(),
        root_tokens.contiguous(), seq_lens.contiguous(), *fields, ancestor, budget, **config)
    return VerifyLayout(*fields, ancestor_mask=ancestor)


def accept_path_triton(tree: DraftTree, target_tokens: torch.Tensor) -> TreeVerifyResult:
    """`accept_path` in one launch; target_tokens [bs, budget + 1] int64."""
    bs, budget, config = _launch_config(tree)
    i64 = dict(dtype=torch.int64, device=tree.tokens.device)
    accept_lens, bonus = torch.empty(bs, **i64), torch.empty(bs, **i64)
    accepted_tokens, path = torch.empty(bs, budget + 1, **i64), torch.empty(bs, budget + 1, **i64)
    _accept_path_kernel[(bs,)](
        tree.tokens.contiguous(), tree.parents.contiguous(), tree.depths.contiguous(), tree.valid.contiguous(),
        target_tokens.long().contiguous(), accept_lens, accepted_tokens, path, bonus, budget, **config)
    return TreeVerifyResult(accept_lens=accept_lens, accepted_tokens=accepted_tokens, accepted_local_indices=path,
                            bonus_tokens=bonus)
