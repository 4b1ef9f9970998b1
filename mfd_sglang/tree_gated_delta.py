"""Gated DeltaNet layers over a token tree: the exact reference for verifying an MFD tree on a hybrid
target (Qwen3.5 / Qwen3.6 / Qwen3-Next), in plain PyTorch.

A Gated DeltaNet layer carries per request a recurrent state S [H, dk, dv] and a short-convolution
state (the last W - 1 inputs of its causal depthwise conv). Run over a sequence, token t reads the
state left by token t - 1. Over a verify window that is a tree, node j must read the state left by
its PARENT instead, so that every node sees exactly the states of its own root-to-node path, as plain
decoding of that path would. Both functions here compute every node's output and the state after the
node; once a path is accepted, the state after its last node becomes the request's state.

Conventions (one verify window per request):
  * the window holds N tokens; `parents` [bs, N] int64 gives each token's parent as an index into the
    same window, -1 for a token that follows the request's committed state (the root), and
    parents[:, j] < j (parents precede children, as in `DraftTree` and SGLang's verify layout);
  * all heads are given expanded: q / k carry as many heads as v (grouped heads repeated by the caller);
  * the recurrence is the one of Hugging Face's `torch_recurrent_gated_delta_rule` and the FLA kernels:
    S <- S * exp(g); S <- S + k (x) beta * (v - k S); o = (q / sqrt(dk)) S, in float32;
  * the convolution is the one of `causal_conv1d_update`: out = act(sum_w window[w] * weight[:, w] + bias)
    over the window [W - 1 previous inputs along the path, the token's own input].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _from_parent(per_node: Tensor, initial: Tensor, parent: Tensor) -> Tensor:
    """Row b: per_node[b, parent[b]], or initial[b] where parent[b] < 0."""
    index = parent.clamp(min=0).view(-1, *([1] * (per_node.dim() - 1))).expand(-1, 1, *per_node.shape[2:])
    gathered = per_node.gather(1, index).squeeze(1)
    return torch.where((parent < 0).view(-1, *([1] * (initial.dim() - 1))), initial, gathered)


def tree_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, parents: Tensor,
                          initial_state: Tensor, *, use_qk_l2norm: bool = False) -> tuple[Tensor, Tensor]:
    """The gated delta rule over a tree of tokens.

    q, k [bs, N, H, dk]; v [bs, N, H, dv]; g (log decay), beta [bs, N, H]; parents [bs, N];
    initial_state [bs, H, dk, dv] (the request's committed state). Returns (outputs [bs, N, H, dv] in
    v's dtype, states [bs, N, H, dk, dv] float32: the state after each token)."""
    bs, n, heads, dk = k.shape
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q / dk**0.5
    initial = initial_state.float()
    states = torch.empty(bs, n, *initial.shape[1:], dtype=torch.float32, device=v.device)
    out = torch.empty(bs, n, heads, v.shape[-1], dtype=torch.float32, device=v.device)
    for j in range(n):
        state = _from_parent(states, initial, parents[:, j]) * g[:, j].exp()[..., None, None]
        k_j = k[:, j].unsqueeze(-1)  # [bs, H, dk, 1]
        delta = (v[:, j] - (state * k_j).sum(dim=-2)) * beta[:, j].unsqueeze(-1)
        state = state + k_j * delta.unsqueeze(-2)
        states[:, j] = state
        out[:, j] = (state * q[:, j].unsqueeze(-1)).sum(dim=-2)
    return out.to(v.dtype), states


def tree_causal_conv1d(x: Tensor, parents: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None,
                       activation: str | None = "silu") -> tuple[Tensor, Tensor]:
    """The depthwise causal convolution over a tree of tokens.

    x [bs, N, C]; parents [bs, N]; conv_state [bs, C, W - 1] (the request's last W - 1 inputs, oldest
    first); weight [C, W]; bias [C] or None; activation "silu" or None. Returns (outputs [bs, N, C] in
    x's dtype, states [bs, N, C, W - 1]: the last W - 1 inputs along each token's path, itself last)."""
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    bs, n, channels = x.shape
    states = torch.empty(bs, n, channels, conv_state.shape[-1], dtype=weight.dtype, device=x.device)
    out = torch.empty(bs, n, channels, dtype=weight.dtype, device=x.device)
    initial = conv_state.to(weight.dtype)
    for j in range(n):
        window = torch.cat([_from_parent(states, initial, parents[:, j]), x[:, j, :, None].to(weight.dtype)], dim=-1)
        y = (window * weight).sum(dim=-1)
        if bias is not None:
            y = y + bias
        out[:, j] = F.silu(y) if activation == "silu" else y
        states[:, j] = window[..., 1:]
    return out.to(x.dtype), states
