"""Mode attention: the drafter's attention for K modes over one shared, paged context.

The K x T query rows of a request (mode-major: row r belongs to mode r // T) attend to
  - the request's committed context keys/values, read from a pool indexed by KV slot
    (`req_to_token[req_pool_indices[b], :context_lens[b]]`, as SGLang pages its KV cache), and
  - the block keys/values of their own mode only (bidirectional inside the block).
GQA: query head h reads kv head h // (Hq / Hkv). Scale 1/sqrt(head_dim).

`backend="torch"` is the reference (gathers the context into a padded tensor, then one masked SDPA);
`backend="triton"` is the fused kernel in `mfd_sglang.kernels.draft_mode_attention`, which streams the
context tiles once for all the query rows of a program instead of once per mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mfd_sglang.backend import check_backend


def mode_attention(q: torch.Tensor, block_k: torch.Tensor, block_v: torch.Tensor, pool_k: torch.Tensor,
                   pool_v: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                   context_lens: torch.Tensor, *, num_modes: int, backend: str = "torch") -> torch.Tensor:
    """q [bs, Hq, K*T, d]; block_k / block_v [bs, Hkv, K*T, d]; pool_k / pool_v [slots, Hkv, d];
    req_to_token [R, max_len] slot ids; req_pool_indices [bs]; context_lens [bs]. Returns [bs, Hq, K*T, d]."""
    if check_backend(backend) == "triton":
        from mfd_sglang.kernels.draft_mode_attention import mode_attention_triton

        return mode_attention_triton(q, block_k, block_v, pool_k, pool_v, req_to_token, req_pool_indices,
                                     context_lens, num_modes=num_modes)
    bs, _, rows, _ = q.shape
    width = int(context_lens.max()) if bs else 0
    slots = req_to_token[req_pool_indices.long(), :width].long()
    ctx_k = pool_k[slots].transpose(1, 2)  # [bs, Hkv, L, d]
    ctx_v = pool_v[slots].transpose(1, 2)
    visible_ctx = torch.arange(width, device=q.device)[None, :] < context_lens[:, None]
    mode = torch.arange(rows, device=q.device) // (rows // num_modes)
    mask = torch.cat([visible_ctx[:, None, :].expand(bs, rows, width),
                      (mode[:, None] == mode[None, :]).expand(bs, rows, rows)], dim=2)
    return F.scaled_dot_product_attention(q, torch.cat([ctx_k, block_k], dim=2), torch.cat([ctx_v, block_v], dim=2),
                                          attn_mask=mask[:, None], enable_gqa=q.shape[1] != block_k.shape[1])


def random_inputs(seed: int, bs: int, modes: int, block: int, heads: int, kv_heads: int, dim: int,
                  context_lens: list[int], dtype=torch.float32, device="cpu") -> dict:
    """Random mode-attention inputs (for tests and benchmarks): scattered request rows and slots."""
    g = torch.Generator().manual_seed(seed)
    rows, slots = modes * block, 4 * max(max(context_lens), 1) + 8
    max_len = max(context_lens) + 5
    tensors = dict(
        q=torch.randn(bs, heads, rows, dim, generator=g),
        block_k=torch.randn(bs, kv_heads, rows, dim, generator=g),
        block_v=torch.randn(bs, kv_heads, rows, dim, generator=g),
        pool_k=torch.randn(slots, kv_heads, dim, generator=g),
        pool_v=torch.randn(slots, kv_heads, dim, generator=g),
    )
    # Requests live at scattered rows of req_to_token and hold scattered slots, as in SGLang.
    req_to_token = torch.randint(0, slots, (bs + 3, max_len), generator=g, dtype=torch.int32)
    req_pool_indices = torch.randperm(bs + 3, generator=g)[:bs].to(torch.int64)
    out = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    out.update(req_to_token=req_to_token.to(device), req_pool_indices=req_pool_indices.to(device),
               context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device))
    return out
