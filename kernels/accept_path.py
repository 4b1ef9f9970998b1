"""The Triton walk of a batched draft tree's parent links to its accepted path given the target's token at every
node (`mfd_sglang.acceptance.accept_path`): one launch, bit-identical to that torch reference.

One program per request holds its budget tree nodes in registers: a node is accepted when it and every ancestor
matched (a walk up the parent links, at most the tree's depth steps); the path's columns are a [B, B] comparison
in tiles (`kernels.common.tree_walk_config`), as the verify layout's walk.

Why not SGLang's (`sglang.kernels.ops.speculative`): `verify_tree_greedy` walks the sibling lists serially and
writes EAGLE's outputs (flat predicts, global accept indices), which `TreeVerifyResult` would need several more
launches to be made from.

Fixed shapes, no host sync (CUDA-graph safe). Local index 0 is the root, tree node i is local i + 1.
"""

import torch
import triton
import triton.language as tl

from mfd_sglang.handoffs import DraftTree, TreeVerifyResult
from mfd_sglang.kernels.common import tree_walk_config


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


def accept_path_triton(tree: DraftTree, target_tokens: torch.Tensor) -> TreeVerifyResult:
    """`accept_path` in one launch; target_tokens [bs, budget + 1] int64."""
    bs, budget, config = tree_walk_config(tree)
    i64 = dict(dtype=torch.int64, device=tree.tokens.device)
    accept_lens, bonus = torch.empty(bs, **i64), torch.empty(bs, **i64)
    accepted_tokens, path = torch.empty(bs, budget + 1, **i64), torch.empty(bs, budget + 1, **i64)
    _accept_path_kernel[(bs,)](
        tree.tokens.contiguous(), tree.parents.contiguous(), tree.depths.contiguous(), tree.valid.contiguous(),
        target_tokens.long().contiguous(), accept_lens, accepted_tokens, path, bonus, budget, **config)
    return TreeVerifyResult(accept_lens=accept_lens, accepted_tokens=accepted_tokens, accepted_local_indices=path,
                            bonus_tokens=bonus)
