"""SGLang EAGLE tree-verify layout of a batched DraftTree.

Per request the verify step sees N = budget + 1 nodes: local index 0 is the root (the last verified
token, depth 0) and tree node i is local index i + 1. Children of a node are linked in node order,
i.e. best first. Padding nodes (valid False) keep their slot so every shape is fixed, but nothing
links to them: their token is 0, their position seq_len + 1 and their mask row sees the prefix,
the root and themselves.

Everything but `full_custom_mask` without `total_len` is fixed-shape and host-sync free. On the "triton"
backend (`mfd_sglang.backend`) the layout is one launch (`mfd_sglang.kernels.verify_layout`) and the custom mask
two (`mfd_sglang.kernels.verify_mask`), bit-identical to the torch references here.
"""

import torch
from torch import Tensor

from mfd_sglang.backend import check_backend
from mfd_sglang.handoffs import DraftTree, VerifyLayout


def with_root(root_value, nodes: Tensor) -> Tensor:
    """[bs, N]: a root column of root_value before the nodes' column values [bs, budget] (budget may be 0)."""
    return torch.cat([nodes.new_full((nodes.shape[0], 1), root_value), nodes], dim=1)


def local_parents(tree: DraftTree) -> Tensor:
    """[bs, N] local index of each layout node's parent: -1 for the root, 0 (root) for padding."""
    # Node parents are -1 for children of the root and for padding, which both map to the root.
    return with_root(-1, tree.parents + 1)


def tree_ancestor_mask(tree: DraftTree) -> Tensor:
    """[bs, N, N] bool: [b, i, j] is True when local node j is an ancestor of, or is, local i."""
    parents = local_parents(tree)
    num_nodes = parents.shape[1]
    nodes = torch.arange(num_nodes, device=parents.device)
    reach = (parents[:, :, None] == nodes) | (nodes[:, None] == nodes)
    # Each squaring doubles the covered path length; ceil(log2(N - 1)) of them cover every path.
    for _ in range((num_nodes - 2).bit_length()):
        reach = torch.bmm(reach.float(), reach.float()) > 0
    return reach


def runs_triton(backend: str, tensor: Tensor) -> bool:
    """Whether the verify layout, its custom mask or the accepted path of the batch `tensor` leads runs on the
    "triton" backend (`kernels.verify_layout`, `kernels.verify_mask`): backend "triton" and a batch that is not
    empty (an empty batch has nothing to launch for); ValueError for an unknown backend."""
    return check_backend(backend) == "triton" and tensor.shape[0] > 0


def tree_to_verify_layout(tree: DraftTree, root_tokens: Tensor, seq_lens: Tensor,
                          backend: str = "torch") -> VerifyLayout:
    """The verify layout of a batched tree ([bs, budget] fields).

    root_tokens: [bs] the last verified token of each request.
    seq_lens: [bs] tokens already in the KV cache before the root.
    backend: "torch" or "triton" (`mfd_sglang.backend`; see `runs_triton`).
    """
    if tree.tokens.dim() != 2:
        raise ValueError("tree_to_verify_layout needs a batched tree ([bs, budget] fields)")
    if runs_triton(backend, tree.tokens):
        from mfd_sglang.kernels.verify_layout import verify_layout_triton

        return verify_layout_triton(tree, root_tokens, seq_lens)
    bs, budget = tree.tokens.shape
    num_nodes = budget + 1
    device = tree.tokens.device
    parents = local_parents(tree)
    nodes = torch.arange(num_nodes, device=device)
    # Only valid tree nodes are linked; the root is nobody's child and padding is unreachable.
    linked = with_root(False, tree.valid)
    unlinked = torch.full_like(parents, num_nodes)
    linked_nodes = torch.where(linked, nodes, unlinked)
    first_child = unlinked.scatter_reduce(1, parents.clamp(min=0), linked_nodes, "amin")
    later_sibling = (parents[:, :, None] == parents[:, None, :]) & (nodes > nodes[:, None])
    next_sibling = torch.where(later_sibling & linked[:, None, :], nodes, num_nodes).amin(dim=-1)
    next_sibling = torch.where(linked, next_sibling, num_nodes)
    depths = with_root(0, tree.depths)
    return VerifyLayout(
        draft_token=torch.cat([root_tokens[:, None].long(), tree.tokens], dim=1),
        positions=seq_lens[:, None].long() + depths,
        retrive_index=torch.arange(bs * num_nodes, device=device).view(bs, num_nodes),
        retrive_next_token=torch.where(first_child < num_nodes, first_child, -1),
        retrive_next_sibling=torch.where(next_sibling < num_nodes, next_sibling, -1),
        ancestor_mask=tree_ancestor_mask(tree),
    )


def full_custom_mask(
    ancestor_mask: Tensor, seq_lens: Tensor, total_len: int | None = None, backend: str = "torch"
) -> Tensor:
    """SGLang's FULL_MASK custom_mask: flat bool, per request a row-major N x (seq_len + N) block.

    Prefix columns are True, tree columns are `ancestor_mask`; request b starts at
    N * sum(seq_lens[:b]) + b * N * N. `total_len` must be N * sum(seq_lens) + bs * N * N; when it
    is None it is read from `seq_lens`, which syncs with the device. backend: as `tree_to_verify_layout`'s.
    """
    bs, num_nodes, _ = ancestor_mask.shape
    if total_len is None:
        total_len = num_nodes * int(seq_lens.sum()) + bs * num_nodes * num_nodes  # an integer sum is int64
    if runs_triton(backend, ancestor_mask):
        from mfd_sglang.kernels.verify_mask import full_custom_mask_triton

        return full_custom_mask_triton(ancestor_mask, seq_lens, total_len)
    seq_lens = seq_lens.long()
    requests = torch.arange(bs, device=seq_lens.device)
    nodes = torch.arange(num_nodes, device=seq_lens.device)
    row_lens = seq_lens + num_nodes
    starts = num_nodes * (seq_lens.cumsum(0) - seq_lens) + requests * num_nodes**2
    # Flat index of the tree cell (b, i, j): request start + row i + the prefix + column j.
    tree_cells = (
        (starts + seq_lens)[:, None, None] + nodes[:, None] * row_lens[:, None, None] + nodes
    )
    mask = torch.ones(total_len, dtype=torch.bool, device=ancestor_mask.device)
    return mask.scatter_(0, tree_cells.flatten(), ancestor_mask.flatten())
