"""The drafter's context keys/values inside SGLang, indexed by the target's KV slot ids.

Every committed token has one target KV slot; the drafter's context K/V for that token (its target
hidden states projected by `fc` + `hidden_norm`, then each drafter layer's k/v projection, k-norm
and RoPE at the token's position) lives at the same index here. Radix-cache prefix hits therefore
reuse the drafter context together with the target KV, and freeing a slot needs nothing extra.

`paged(...)` hands the drafter a context it reads in place (`mfd_sglang.mode_attention`: the
reference in torch, the fused Triton kernel on CUDA); `gather(...)` copies it into a padded
DraftContext (needed by drafters with sliding-window layers).

Plain-decoding rounds (the automatic budget's budget 0) may hand their rows to `deferred_for(requests)`
instead (`DeferredContextWrites`, when the pool was built with `deferred_rows`): the pool writes them in
one batch before anything else touches it. `write`, `gather` and `paged` flush first; a CUDA-graph
replay of a draft reads the tensors directly, so its caller flushes (`flush()`) before replaying.

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
    def __init__(self, drafter: MFDDrafter, num_slots: int, *, device, dtype: torch.dtype, deferred_rows: int = 0,
                 page_size: int = 0):
        """`num_slots` rows per layer. With the target's `page_size` the rows are the buffers of SGLang's own
        `MHATokenToKVPool` (`sglang_pool`, num_slots - page_size usable slots, as the target's pool has):
        SGLang's PD disaggregation moves a request's pages of it with the target's KV, as the spec
        worker's draft KV pool (`MFDWorkerV2.primary_draft_kv_pool`). Else one tensor of every layer's rows
        for the keys and one for the values (`key_rows`, `value_rows`: a commit writes each in one launch),
        each layer's a view (sglang_pool None)."""
        cfg = drafter.cfg
        if page_size:
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

            self.sglang_pool = MHATokenToKVPool(
                size=num_slots - page_size, page_size=page_size, dtype=dtype, head_num=cfg.num_key_value_heads,
                head_dim=cfg.head_dim, layer_num=cfg.num_hidden_layers, device=str(device), enable_memory_saver=False,
                enable_alt_stream=False)
            self.keys, self.values = list(self.sglang_pool.k_buffer), list(self.sglang_pool.v_buffer)
            self.key_rows = self.value_rows = None
        else:
            self.sglang_pool = None
            shape = (cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, cfg.head_dim)
            self.key_rows = torch.zeros(shape, device=device, dtype=dtype)
            self.value_rows = torch.zeros(shape, device=device, dtype=dtype)
            layers = range(cfg.num_hidden_layers)
            self.keys, self.values = [self.key_rows[i] for i in layers], [self.value_rows[i] for i in layers]
        self.deferred = (DeferredContextWrites(self, drafter, deferred_rows, device=device, dtype=dtype)
                         if deferred_rows else None)

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[0]

    def write(self, drafter: MFDDrafter, target_hidden: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor) -> None:
        """Context K/V of tokens with target hidden states [T, F] at positions [T] into slots [T]
        (held rows first: their slots may have been handed out again)."""
        self.flush()
        self.write_now(drafter, target_hidden, positions, slots)

    @torch.no_grad()  # a cache: no autograd history (an in-place write would stale the layers' views)
    def write_now(self, drafter: MFDDrafter, target_hidden: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor) -> None:
        k, v = drafter.context_rows(target_hidden[None], positions[None])  # [1, T, layers, kv_heads, hd]
        if self.key_rows is not None:
            self.key_rows[:, slots] = k[0].transpose(0, 1)
            self.value_rows[:, slots] = v[0].transpose(0, 1)
            return
        for layer, (pool_k, pool_v) in enumerate(zip(self.keys, self.values)):
            pool_k[slots] = k[0, :, layer]
            pool_v[slots] = v[0, :, layer]

    def deferred_for(self, requests: tuple) -> "DraftContextPool | DeferredContextWrites":
        """Where a plain-decoding round of `requests` (their ids) writes its context: the deferred writes
        held for them, or the pool itself when it defers nothing."""
        if self.deferred is None:
            return self
        self.deferred.hold_for(requests)
        return self.deferred

    def flush(self) -> None:
        """Write the held rows of plain-decoding rounds (a no-op when none are held)."""
        if self.deferred is not None:
            self.deferred.flush()

    def cpu_copy(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """The rows at slots [T] (every layer's keys, then its values) on the host: a retracted request's
        backup (`mfd_sglang/patches/retraction_backup.py`)."""
        self.flush()
        return [buffer[slots].cpu() for buffer in (*self.keys, *self.values)]

    def load_cpu_copy(self, rows: list[torch.Tensor], slots: torch.Tensor) -> None:
        """`cpu_copy`'s rows into slots [T] (a resumed request's; held rows first: they may target the same
        slots, handed out again)."""
        self.flush()
        for buffer, row in zip((*self.keys, *self.values), rows):
            buffer[slots] = row.to(buffer.device)

    def gather(self, slots: torch.Tensor, lengths: torch.Tensor) -> DraftContext:
        """The padded DraftContext of bs requests: slots [bs, L] of positions 0..L-1, the first
        lengths [bs] of them committed (the rest are masked out)."""
        self.flush()
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
        self.flush()
        return PagedDraftContext(self, req_to_token, req_pool_indices, lengths, backend)


class DeferredContextWrites:
    """The drafter context of plain-decoding rounds (budget 0 under the automatic budget), written
    later in one batch: nothing reads a token's context until a round drafts again, and one projection
    of many rows costs about what one of a few rows does (the fc weight is read once), so a run of
    plain rounds does not pay for a drafter it does not use.

    `hold_for(requests)` before a round's writes: rows held for another set of requests are written
    first, because a request that left (finished, aborted, retracted) may have freed slots the
    scheduler hands out again. `flush()` writes what is held, in order; the pool calls it before
    anything else writes to it (a prefill) or reads it (a drafting round). While the set of
    requests is unchanged their held slots stay theirs, so the rows' later write lands where a direct
    one would have. Holds at most `capacity` rows (target features [capacity, F] in the serving dtype);
    a round with more is written at once."""

    def __init__(self, pool: DraftContextPool, drafter: MFDDrafter, capacity: int, *, device, dtype: torch.dtype):
        self.pool, self.drafter, self.capacity = pool, drafter, capacity
        self.hidden = torch.empty(capacity, drafter.fc.in_features, device=device, dtype=dtype)
        self.positions = torch.empty(capacity, dtype=torch.int64, device=device)
        self.slots = torch.empty(capacity, dtype=torch.int64, device=device)
        self.count = 0
        self.requests: tuple | None = None

    def hold_for(self, requests: tuple) -> None:
        if requests != self.requests:
            self.flush()
            self.requests = requests

    def write(self, drafter: MFDDrafter, target_hidden: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor) -> None:
        """`DraftContextPool.write`, held: the rows are copied here (the target's output buffer is
        reused by its next forward) and written at the next flush."""
        rows = target_hidden.shape[0]
        if self.count + rows > self.capacity:
            self.flush()
        if rows > self.capacity:
            self.pool.write_now(drafter, target_hidden, positions, slots)
            return
        end = self.count + rows
        self.hidden[self.count:end] = target_hidden
        self.positions[self.count:end] = positions
        self.slots[self.count:end] = slots
        self.count = end

    def flush(self) -> None:
        if self.count:
            n, self.count = self.count, 0
            self.pool.write_now(self.drafter, self.hidden[:n], self.positions[:n], self.slots[:n])


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
