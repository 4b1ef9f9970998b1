"""The drafter's context keys/values inside SGLang, indexed by the target's KV slot ids.

Every committed token has one target KV slot; the drafter's context K/V for that token (its target
hidden states projected by `fc` + `hidden_norm`, then each drafter layer's k/v projection, k-norm
and RoPE at the token's position) lives at the same index here. Radix-cache prefix hits therefore
reuse the drafter context together with the target KV, and freeing a slot needs nothing extra.

`paged(...)` hands the drafter a context it reads in place (`mfd_sglang.mode_attention`: the
reference in torch, the fused Triton kernel on CUDA); `gather(...)` copies it into a padded
DraftContext (needed by drafters with sliding-window layers).

The draft block itself (K modes x block rows) never enters this pool: its keys and values exist
only inside the drafter's forward, so no verify slots are borrowed for drafting.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from mfd_sglang.drafter import DraftContext, MFDDrafter
from mfd_sglang.mode_attention import mode_attention


class DraftContextPool:
    def __init__(self, drafter: MFDDrafter, num_slots: int, *, device, dtype: torch.dtype):
        cfg = drafter.cfg
        shape = (num_slots, cfg.num_key_value_heads, cfg.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[0]

    def write(self, drafter: MFDDrafter, target_hidden: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor) -> None:
        """Context K/V of tokens with target hidden states [T, F] at positions [T] into slots [T]."""
        context = drafter.context_kv(target_hidden[None], positions[None])
        for pool_k, pool_v, k, v in zip(self.keys, self.values, context.keys, context.values):
            pool_k[slots] = k[0].transpose(0, 1)
            pool_v[slots] = v[0].transpose(0, 1)

    def gather(self, slots: torch.Tensor, lengths: torch.Tensor) -> DraftContext:
        """The padded DraftContext of bs requests: slots [bs, L] of positions 0..L-1, the first
        lengths [bs] of them committed (the rest are masked out)."""
        bs, width = slots.shape
        positions = torch.arange(width, device=slots.device).expand(bs, width)
        return DraftContext(
            keys=[k[slots].transpose(1, 2) for k in self.keys],
            values=[v[slots].transpose(1, 2) for v in self.values],
            positions=positions,
            valid=positions < lengths[:, None],
        )

    def paged(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lengths: torch.Tensor,
              backend: str) -> "PagedDraftContext":
        """The context of bs requests read in place: positions 0..lengths[b]-1 of req_to_token's rows."""
        return PagedDraftContext(self, req_to_token, req_pool_indices, lengths, backend)


@dataclass
class PagedDraftContext:
    pool: DraftContextPool
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    lengths: torch.Tensor
    backend: str  # "torch" or "triton"

    def attend(self, layer: int, *, num_modes: int):
        """The drafter layer's attention: attend(q, k, v) -> [bs, heads, K*T, hd]."""
        return partial(mode_attention, pool_k=self.pool.keys[layer], pool_v=self.pool.values[layer],
                       req_to_token=self.req_to_token, req_pool_indices=self.req_pool_indices,
                       context_lens=self.lengths, num_modes=num_modes, backend=self.backend)
