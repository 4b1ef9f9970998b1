"""A plain-torch SGLang attention backend for CPU: ``--attention-backend mfd_cpu``.

SGLang's ``torch_native`` backend serves EXTEND and DECODE only; speculative verification
(TARGET_VERIFY, with or without a tree mask) fails there, and the Triton backend under
``TRITON_INTERPRET=1`` is correct but far too slow to serve. This backend covers every
forward mode a speculative run on CPU needs, over SGLang's paged KV cache (any page size: the
pool is indexed by token slot, and every key is read through ``req_to_token``, whose page layout
is the allocator's business):

- EXTEND / MIXED / DRAFT_EXTEND_V2 / SPLIT_PREFILL (prefill, chunked prefill, prefix-cached
  requests): per request, the queries of the new tokens attend to the request's cached prefix
  (read from the pool through ``req_to_token``) and to the new tokens (causal, or all of them
  for ``AttentionType.ENCODER_ONLY`` / cross-free non-causal layers).
- DECODE: one query per request over the request's ``seq_len`` cached tokens (the new token's
  K/V is written first, as every SGLang backend does). All requests in one SDPA call.
- TARGET_VERIFY: ``N`` queries per request (``N = num_tokens // bs``, checked against
  ``spec_info.num_tokens_per_req`` / ``draft_token_num`` when set). ``forward_batch.seq_lens``
  are the COMMITTED prefix lengths (the draft tokens are not counted), as in SGLang. Each query
  sees the whole prefix of its request, plus, among the request's N draft tokens:
    * with ``spec_info.custom_mask``: exactly the tokens its mask row allows. The mask is read
      in EAGLE's FULL_MASK layout, exactly as ``triton_backend.py`` + ``extend_attention_fwd``
      read it: per request a row-major ``N x (seq_len + N)`` block, blocks concatenated, block
      b starting at ``sum_{j<b} N * (seq_len_j + N)``; row i column ``seq_len + j`` says whether
      draft token i sees draft token j. Like Triton (``skip_prefix_custom_mask=True``), the
      prefix columns are NOT read: the prefix is always visible. This holds for causal and
      non-causal layers alike (Triton with a causal layer additionally skips keys past the
      query's 64/128-row tile, which only matters for masks that are not lower-triangular;
      here the mask alone decides).
    * without a custom mask: causal among the draft tokens (a chain), or all of them for
      non-causal layers (``ENCODER_ONLY``: the DFlash drafter's block forward, which SGLang runs
      as TARGET_VERIFY on the draft runner with ``custom_mask=None``).
  The draft tokens' K/V are written to ``out_cache_loc`` (unless ``save_kv_cache=False``) and
  read for attention from the ``k``/``v`` arguments, as Triton does.
  An MFD drafter running K copies of a block per request as one forward can pass any
  FULL_MASK-shaped bool mask (e.g. "own mode's block only") through ``spec_info.custom_mask``.
- IDLE: an empty output.

Numerics: ``torch.nn.functional.scaled_dot_product_attention`` with ``enable_gqa``, in the
query dtype (bf16 or fp32); masks are additive (0 / -inf) in that dtype (about 2x faster than a
bool mask on CPU). A query row whose mask allows no key gives NaN (Triton gives NaN/0 there
too); SGLang's own masks never do that.

Not supported (a clear error, never a silent wrong answer): CUDA/CPU graphs, cross attention,
sliding-window layers in TARGET_VERIFY, the hybrid SWA pool, translating (unified / fused-draft)
KV pools, logit soft-capping, attention sinks, fp8 KV scales, xai temperature,
DLLM extend, ragged verify layouts.

Register with ``register_cpu_attention_backend()`` (idempotent); the plugin entry point calls it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

BACKEND_NAME = "mfd_cpu"

_GRAPH_ERROR = (
    "the mfd_cpu attention backend does not support CUDA/CPU graphs; "
    "run the server with --disable-cuda-graph (graphs are off on CPU anyway)"
)


# ---------------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------------


def _create_backend(model_runner):
    return CpuSdpaAttnBackend(model_runner)


def register_cpu_attention_backend(name: str = BACKEND_NAME) -> str:
    """Register the backend under ``name`` with SGLang (idempotent); return the name.

    - ``attention_registry.ATTENTION_BACKENDS[name]``: what ``ModelRunner`` builds from
      ``--attention-backend`` / ``--prefill-attention-backend`` / ``--decode-attention-backend``
      and from ``--speculative-draft-attention-backend`` (draft runners).
    - ``arg_groups.choices.add_attention_backend_choices``: the argparse choices of those
      three flags (the choices list is shared by reference, so extending it before argv is
      parsed is enough; ``load_plugins()`` runs before parsing).
    - ``add_draft_attention_backend_choices``: without it the DFlash-family draft worker
      silently falls back to ``flashinfer`` (``resolve_draft_worker_attention_backend``).
    """
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    if ATTENTION_BACKENDS.get(name) is not _create_backend:
        register_attention_backend(name)(_create_backend)
    if name not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([name])
    if name not in choices.DRAFT_ATTENTION_BACKEND_CHOICES:
        choices.add_draft_attention_backend_choices([name])
    return name


# ---------------------------------------------------------------------------------------------
# per-forward metadata
# ---------------------------------------------------------------------------------------------


@dataclass
class _ExtendMeta:
    """EXTEND-like: one SDPA call per request."""

    q_starts: List[int]
    q_lens: List[int]
    prefix_lens: List[int]
    prefix_idx: List[torch.Tensor]  # per request [p] int64 pool slots
    # (causal, dtype, request) -> additive mask or None; filled lazily
    masks: Dict[Tuple[bool, torch.dtype, int, int], Optional[torch.Tensor]] = field(
        default_factory=dict
    )


@dataclass
class _BatchedMeta:
    """DECODE and TARGET_VERIFY: all requests in one padded SDPA call."""

    bs: int
    n_q: int  # queries per request (1 for decode, N for verify)
    n_ext: int  # keys taken from the k/v arguments per request (0 decode, N verify)
    kv_idx: torch.Tensor  # [bs, P] int64 pool slots (padded with the request's slot 0)
    kv_valid: Optional[torch.Tensor]  # [bs, P] bool, None when no padding
    ext_block: Optional[torch.Tensor]  # [bs, N, N] bool from the custom mask, or None
    seq_lens: torch.Tensor  # [bs] int64 (prefix length for verify, full for decode)
    masks: Dict[Tuple[bool, torch.dtype, int], Optional[torch.Tensor]] = field(
        default_factory=dict
    )


def _as_host_list(t, fallback) -> List[int]:
    src = t if t is not None else fallback
    if src is None:
        raise ValueError("mfd_cpu: EXTEND batch without extend_seq_lens / extend_prefix_lens")
    if isinstance(src, list):
        return [int(x) for x in src]
    return [int(x) for x in src.tolist()]


def extract_full_mask_blocks(
    custom_mask: torch.Tensor, seq_lens: torch.Tensor, n: int
) -> torch.Tensor:
    """The draft-by-draft part ``[bs, n, n]`` (bool) of an EAGLE FULL_MASK ``custom_mask``.

    Request b's block starts at ``sum_{j<b} n*(seq_len_j + n)``; its row i has
    ``seq_len_b + n`` entries and the draft columns start at ``seq_len_b``.
    """
    seq_lens = seq_lens.to(torch.int64)
    bs = seq_lens.shape[0]
    row_len = seq_lens + n  # [bs]
    block_len = n * row_len
    starts = torch.cumsum(block_len, 0) - block_len  # exclusive cumsum
    ar = torch.arange(n, dtype=torch.int64, device=seq_lens.device)
    idx = (
        starts[:, None, None]
        + ar[None, :, None] * row_len[:, None, None]
        + seq_lens[:, None, None]
        + ar[None, None, :]
    )  # [bs, n, n]
    need = int((starts[-1] + block_len[-1]).item()) if bs > 0 else 0
    flat = custom_mask.reshape(-1)
    if flat.numel() < need:
        raise ValueError(
            f"mfd_cpu: spec_info.custom_mask has {flat.numel()} entries, the FULL_MASK "
            f"layout of seq_lens={seq_lens.tolist()} with {n} draft tokens per request "
            f"needs {need}"
        )
    blk = flat[idx.to(flat.device)]
    if blk.dtype != torch.bool:
        blk = blk != 0
    return blk


# ---------------------------------------------------------------------------------------------
# the backend
# ---------------------------------------------------------------------------------------------


def _base_cls():
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    return AttentionBackend


class CpuSdpaAttnBackend(_base_cls()):
    """Plain-torch SDPA attention over SGLang's paged KV cache (see the module docstring)."""

    needs_cpu_seq_lens = True

    def __init__(self, model_runner):
        super().__init__()
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        if isinstance(self.token_to_kv_pool, SWAKVPool):
            raise ValueError("mfd_cpu attention does not support the hybrid SWA KV pool")
        translator = getattr(model_runner, "kv_index_translator", None)
        if translator is not None and getattr(translator, "is_translating", False):
            raise ValueError(
                "mfd_cpu attention does not support translating (unified / fused-draft) KV pools"
            )
        self.kv_index_translator = translator
        self.forward_metadata = None
        self._mode = None

    # ---- graph hooks: not supported -------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        raise NotImplementedError(_GRAPH_ERROR)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if in_capture:
            raise NotImplementedError(_GRAPH_ERROR)
        self._init_eager(forward_batch)

    def init_forward_metadata_in_graph(self, forward_batch):
        return None

    def init_forward_metadata_for_breakable_cuda_graph_capture(self, forward_batch):
        raise NotImplementedError(_GRAPH_ERROR)

    def prepare_forward_metadata_for_breakable_cuda_graph_replay(self, *args, **kwargs):
        raise NotImplementedError(_GRAPH_ERROR)

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
        raise NotImplementedError(_GRAPH_ERROR)

    def get_cuda_graph_seq_len_fill_value(self):
        # Used by SGLang's batch padding (graphs, DP attention); 1 is the usual fill.
        return 1

    def get_cpu_graph_seq_len_fill_value(self):
        return 1

    def support_triton(self):
        return False

    # ---- metadata --------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch):
        self._init_eager(forward_batch)

    def _init_eager(self, fb):
        mode = fb.forward_mode
        self._mode = mode
        if mode.is_idle():
            self.forward_metadata = None
        elif mode.is_decode():
            self.forward_metadata = self._decode_meta(fb)
        elif mode.is_target_verify():
            self.forward_metadata = self._verify_meta(fb)
        elif mode.is_dllm_extend():
            raise NotImplementedError("mfd_cpu attention does not support DLLM_EXTEND")
        else:  # EXTEND, MIXED, DRAFT_EXTEND_V2, SPLIT_PREFILL
            self.forward_metadata = self._extend_meta(fb)

    def _gather_rows(self, req_pool_indices: torch.Tensor, lens: torch.Tensor):
        """[bs, max(lens)] pool slots of each request's first ``lens`` tokens, and the valid mask
        (None when every request has the same length). A CPU backend: host syncs are free."""
        width = int(lens.max()) if lens.numel() else 0
        req_to_token = self.req_to_token_pool.req_to_token
        rows = req_to_token[req_pool_indices.to(torch.int64)]  # [bs, max_context]
        if width > rows.shape[1]:
            raise ValueError(
                f"mfd_cpu: sequence length {width} exceeds the req_to_token width {rows.shape[1]}"
            )
        idx = rows[:, :width].to(torch.int64)
        if width == 0:
            return idx, None
        ar = torch.arange(width, device=idx.device)
        valid = ar[None, :] < lens.to(idx.device)[:, None]
        if bool(valid.all()):
            return idx, None
        # Padding reads the request's own first slot (always a real slot when width > 0).
        idx = torch.where(valid, idx, idx[:, :1].expand_as(idx))
        return idx, valid

    def _decode_meta(self, fb) -> _BatchedMeta:
        bs = int(fb.req_pool_indices.shape[0])
        seq_lens = fb.seq_lens[:bs].to(torch.int64)
        idx, valid = self._gather_rows(fb.req_pool_indices[:bs], seq_lens)
        return _BatchedMeta(bs, 1, 0, idx, valid, None, seq_lens)

    def _verify_meta(self, fb) -> _BatchedMeta:
        bs = int(fb.req_pool_indices.shape[0])
        spec_info = fb.spec_info
        n_tokens = None
        if fb.input_ids is not None:
            n_tokens = int(fb.input_ids.shape[0])
        elif fb.positions is not None:
            n_tokens = int(fb.positions.shape[0])
        n = None
        if spec_info is not None:
            if getattr(spec_info, "ragged_verify_layout", None) is not None:
                raise NotImplementedError("mfd_cpu attention does not support ragged verify")
            per_req = getattr(spec_info, "num_tokens_per_req", -1)
            if per_req is not None and per_req > 0:
                n = int(per_req)
            elif getattr(spec_info, "draft_token_num", None):
                n = int(spec_info.draft_token_num)
        if n is None:
            if n_tokens is None or bs == 0 or n_tokens % bs:
                raise ValueError(
                    "mfd_cpu: cannot tell the number of draft tokens per request in TARGET_VERIFY"
                )
            n = n_tokens // bs
        if n_tokens is not None and n_tokens != n * bs:
            raise ValueError(
                f"mfd_cpu: TARGET_VERIFY with {n_tokens} tokens for {bs} requests x {n} per request"
            )
        # The device seq_lens are the committed prefix lengths; seq_lens_cpu may be an upper
        # bound there (DFlash sets it to prefix + block), so it is not used.
        seq_lens = fb.seq_lens[:bs].to(torch.int64)
        idx, valid = self._gather_rows(fb.req_pool_indices[:bs], seq_lens)
        custom_mask = getattr(spec_info, "custom_mask", None) if spec_info is not None else None
        ext_block = None
        if custom_mask is not None:
            ext_block = extract_full_mask_blocks(custom_mask, seq_lens, n).to(self.device)
        return _BatchedMeta(bs, n, n, idx, valid, ext_block, seq_lens)

    def _extend_meta(self, fb) -> _ExtendMeta:
        bs = int(fb.req_pool_indices.shape[0])
        q_lens = _as_host_list(fb.extend_seq_lens, fb.extend_seq_lens_cpu)[:bs]
        prefix_lens = _as_host_list(fb.extend_prefix_lens, fb.extend_prefix_lens_cpu)[:bs]
        q_starts, s = [], 0
        for n in q_lens:
            q_starts.append(s)
            s += n
        req_to_token = self.req_to_token_pool.req_to_token
        rpi = fb.req_pool_indices.to(torch.int64)
        prefix_idx = [
            req_to_token[rpi[b], : prefix_lens[b]].to(torch.int64) for b in range(bs)
        ]
        return _ExtendMeta(q_starts, q_lens, prefix_lens, prefix_idx)

    # ---- forward ---------------------------------------------------------------------------

    @staticmethod
    def _check_layer(layer, kwargs):
        if layer.is_cross_attention:
            raise NotImplementedError("mfd_cpu attention does not support cross attention")
        if layer.logit_cap and layer.logit_cap > 0:
            raise NotImplementedError("mfd_cpu attention does not support logit soft-capping")
        if kwargs.get("sinks") is not None:
            raise NotImplementedError("mfd_cpu attention does not support attention sinks")
        for key in ("score_mod", "aux_tensors"):
            if kwargs.get(key) is not None:
                raise NotImplementedError(f"mfd_cpu attention does not support {key}")
        if layer.k_scale is not None or layer.v_scale is not None:
            raise NotImplementedError("mfd_cpu attention does not support fp8 KV scales")
        if getattr(layer, "xai_temperature_len", -1) not in (None, -1, 0):
            raise NotImplementedError("mfd_cpu attention does not support xai temperature")

    @staticmethod
    def _is_causal(layer) -> bool:
        from sglang.srt.layers.radix_attention import AttentionType

        # As Triton: ENCODER_ONLY is non-causal; DECODER_BIDIRECTIONAL stays causal here
        # (Triton makes it bidirectional only for DLLM / an explicit opt-in).
        return layer.attn_type != AttentionType.ENCODER_ONLY

    @staticmethod
    def _window(layer) -> int:
        w = layer.sliding_window_size
        return int(w) if w is not None and w > -1 else -1

    def _save_kv(self, layer, fb, k, v):
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_batch(fb), k, v)

    def _new_out(self, q, layer):
        return q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self._check_layer(layer, kwargs)
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
        o = self._new_out(q, layer)
        if save_kv_cache and k is not None and v is not None:
            k = k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim)
            v = v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim)
            self._save_kv(layer, forward_batch, k, v)
        meta: _BatchedMeta = self.forward_metadata
        self._batched(q, None, None, o, layer, meta)
        return o

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self._check_layer(layer, kwargs)
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
        o = self._new_out(q, layer)
        if k is None and v is None:
            kb = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
            vb = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
            k = kb[forward_batch.out_cache_loc]
            v = vb[forward_batch.out_cache_loc]
        elif k is None or v is None:
            raise ValueError("Both k and v should be None or not None")
        k = k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim)
        v = v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim)
        if save_kv_cache:
            self._save_kv(layer, forward_batch, k, v)
        if isinstance(self.forward_metadata, _BatchedMeta):  # TARGET_VERIFY
            if self._window(layer) > -1:
                raise NotImplementedError(
                    "mfd_cpu attention does not support sliding-window layers in TARGET_VERIFY"
                )
            self._batched(q, k, v, o, layer, self.forward_metadata)
        else:
            self._extend(q, k, v, o, layer, self.forward_metadata)
        return o

    # ---- kernels ---------------------------------------------------------------------------

    def _sdpa(self, q, k, v, mask, causal, layer):
        """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] in any dtype -> [B, Hq, Lq, Dv] in q.dtype."""
        if k.dtype != q.dtype:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            scale=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
        )

    def _extend(self, q, k, v, o, layer, meta: _ExtendMeta):
        hq, d, dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        q3 = q.view(-1, hq, d)
        o3 = o.view(-1, hq, dv)
        kb = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        vb = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        causal = self._is_causal(layer)
        window = self._window(layer)
        for b, (qs, n, p) in enumerate(zip(meta.q_starts, meta.q_lens, meta.prefix_lens)):
            if n == 0:
                continue
            qb = q3[qs : qs + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            kn, vn = k[qs : qs + n], v[qs : qs + n]
            if p > 0:
                pidx = meta.prefix_idx[b]
                kp, vp = kb[pidx], vb[pidx]
                if kp.dtype != kn.dtype:
                    kp, vp = kp.to(kn.dtype), vp.to(vn.dtype)
                kn = torch.cat([kp, kn], 0)
                vn = torch.cat([vp, vn], 0)
            kk = kn.transpose(0, 1).unsqueeze(0)
            vv = vn.transpose(0, 1).unsqueeze(0)
            use_is_causal = False
            mask = None
            if causal and p == 0 and window < 0:
                use_is_causal = n > 1
            elif causal or window > -1:
                key = (causal, q.dtype, b, window)
                mask = meta.masks.get(key)
                if mask is None:
                    qpos = torch.arange(p, p + n, device=q.device)[:, None]
                    kpos = torch.arange(p + n, device=q.device)[None, :]
                    allow = torch.ones(n, p + n, dtype=torch.bool, device=q.device)
                    if causal:
                        allow &= kpos <= qpos
                    if window > -1:
                        allow &= kpos >= qpos - window
                        if not causal:
                            allow &= kpos <= qpos + window
                    mask = _additive(allow, q.dtype)
                    meta.masks[key] = mask
            out = self._sdpa(qb, kk, vv, mask, use_is_causal, layer)  # [1, Hq, n, Dv]
            o3[qs : qs + n] = out[0].transpose(0, 1)

    def _batched(self, q, k, v, o, layer, meta: _BatchedMeta):
        """DECODE (k is None: all keys from the pool) and TARGET_VERIFY (k/v: the draft keys)."""
        hq, hkv, d, dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
        bs, nq, ne = meta.bs, meta.n_q, meta.n_ext
        if bs == 0:
            return
        kb = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        vb = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        kp = kb[meta.kv_idx]  # [bs, P, Hkv, D]
        vp = vb[meta.kv_idx]
        if k is not None:
            kn = k.view(bs, ne, hkv, d)
            vn = v.view(bs, ne, hkv, dv)
            if kp.dtype != kn.dtype:
                kp, vp = kp.to(kn.dtype), vp.to(vn.dtype)
            kp = torch.cat([kp, kn], 1)
            vp = torch.cat([vp, vn], 1)
        causal = self._is_causal(layer)
        window = self._window(layer) if k is None else -1
        key = (causal, q.dtype, window)
        if key not in meta.masks:
            meta.masks[key] = self._batched_mask(meta, causal, window, q.dtype, q.device)
        mask = meta.masks[key]
        qq = q.view(bs, nq, hq, d).transpose(1, 2)  # [bs, Hq, nq, D]
        out = self._sdpa(qq, kp.transpose(1, 2), vp.transpose(1, 2), mask, False, layer)
        o.view(bs, nq, hq, dv).copy_(out.transpose(1, 2))

    @staticmethod
    def _batched_mask(meta: _BatchedMeta, causal, window, dtype, device):
        bs, nq, ne = meta.bs, meta.n_q, meta.n_ext
        width = meta.kv_idx.shape[1]
        parts = []
        need = False
        if meta.kv_valid is not None:
            prefix = meta.kv_valid[:, None, :].expand(bs, nq, width)
            need = True
        else:
            prefix = torch.ones(bs, nq, width, dtype=torch.bool, device=device)
        if window > -1 and ne == 0:  # decode: the query is at position seq_len - 1
            kpos = torch.arange(width, device=device)[None, None, :]
            qpos = (meta.seq_lens.to(device) - 1)[:, None, None]
            prefix = prefix & (kpos >= qpos - window)
            need = True
        parts.append(prefix)
        if ne > 0:
            if meta.ext_block is not None:
                ext = meta.ext_block
                need = True
            elif causal:
                ext = torch.ones(ne, ne, dtype=torch.bool, device=device).tril()
                ext = ext[None].expand(bs, nq, ne)
                need = True
            else:
                ext = torch.ones(bs, nq, ne, dtype=torch.bool, device=device)
            parts.append(ext)
        if not need:
            return None
        allow = torch.cat(parts, -1)  # [bs, nq, width + ne]
        return _additive(allow, dtype).unsqueeze(1)  # [bs, 1, nq, Lk]


def _additive(allow: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m = torch.zeros(allow.shape, dtype=dtype, device=allow.device)
    return m.masked_fill_(~allow, float("-inf"))
