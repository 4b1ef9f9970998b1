"""Pure-PyTorch stand-in for ``sgl_kernel`` (mfd_sglang, for SGLang 0.5.23), on CPU and on CUDA.

CPU: SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports ``*_cpu`` helpers from a CPU build of
sgl-kernel that is not published. Each function here reproduces, in plain torch, the semantics of
the Triton (or CUDA) twin that SGLang uses on GPUs; ``tests/test_cpu_standins.py`` holds every one
of them to its twin run under ``TRITON_INTERPRET=1``. They are device-agnostic torch, so they also
run on CUDA tensors (SGLang never calls them there; ``test_cpu_helpers_run_on_cuda_tensors`` checks
it where CUDA is present), except ``copy_all_layer_kv_cache_cpu``, which reads raw host addresses.

CUDA (the GPU check on a machine where the 373 MB CUDA wheel cannot be carried): SGLang binds
about 40 ``sgl_kernel`` names when its modules load for a dense model. ``model_ops`` implements the
ones a dense model's forward, sampler and CUDA-graph capture call (norms, gated activations,
top-k / top-p renormalisation, ``weak_ref_tensor``; ``utils.is_arch_support_pdl``); the rest
(quantized GEMM, MoE, GGUF, HiCache transfers) are placeholders that raise NotImplementedError
naming the op when called (``_unavailable``). Deliberately absent, because SGLang guards their
import and has its own fallback: ``sgl_kernel.scalar_type`` (``layers/quantization/utils.py``
mocks it) and ``sgl_kernel.allreduce`` (custom all-reduce, tensor parallel only).

Hybrid Gated DeltaNet models (Qwen3.5 / Qwen3.6) on CPU: ``sgl_kernel.mamba`` (causal convolution,
chunked gated delta rule) and the ``torch.ops.sgl_kernel.*_cpu`` ops their model and backend bind
(``hybrid_ops``, registered as torch library ops because SGLang reads them from ``torch.ops``). SGLang
probes that namespace for Intel AMX through ``convert_weight_packed`` only, which stays unregistered,
so no model is routed onto AMX kernels.

The ``*_cpu`` functions mutate their output arguments in place and return None, like the kernels.
Functions that SGLang only imports (never calls on the paths this project uses) raise
NotImplementedError naming themselves.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

__version__ = "0.0.0+mfd_sglang.cpu_standin"
MFD_SGLANG_CPU_STANDIN = True

_FULL_MASK, _QLEN_ONLY, _QLEN_ONLY_BITPACKING = 0, 1, 2


_TRACE_ENV = "MFD_SGLANG_STANDIN_TRACE"
_traced_names: set[str] = set()


def _trace(fn):
    """Append fn's name to the file named by $MFD_SGLANG_STANDIN_TRACE on its first call in a
    process (used to find out which stand-ins a real server calls)."""
    import functools
    import os

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        path = os.environ.get(_TRACE_ENV)
        if path and fn.__name__ not in _traced_names:
            _traced_names.add(fn.__name__)
            with open(path, "a") as f:
                f.write(f"{fn.__module__}.{fn.__name__}\n")
        return fn(*args, **kwargs)

    return wrapper


def _lists(*tensors: torch.Tensor) -> list[list]:
    return [t.reshape(-1).tolist() for t in tensors]


# --------------------------------------------------------------------------------------------
# KV slot bookkeeping (mem_cache/allocation.py, kernels/ops/speculative/cache_locs.py)
# --------------------------------------------------------------------------------------------


def _segment_index(req_pool_indices, start_offset, end_offset, pool_len):
    """Flat req_to_token indices and the matching packed positions, per request b:
    columns start_b .. end_b-1 of row req_pool_indices[b], packed at sum_{j<b}(end_j - start_j).
    Like the kernels, a negative length copies nothing but still counts in the offsets."""
    start = start_offset.reshape(-1).to(torch.int64)
    end = end_offset.reshape(-1).to(torch.int64)
    rows = req_pool_indices.reshape(-1).to(torch.int64)
    lens = end - start
    packed_start = torch.cumsum(lens, 0) - lens
    counts = lens.clamp(min=0)
    total = int(counts.sum())
    if total == 0:
        empty = torch.empty(0, dtype=torch.int64, device=start.device)
        return empty, empty
    seg = torch.repeat_interleave(torch.arange(rows.numel(), device=start.device), counts)
    within = torch.arange(total, device=start.device) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    src = rows[seg] * pool_len + start[seg] + within
    dst = packed_start[seg] + within
    return src, dst


@_trace
def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,  # mutable
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[rpi[b], start[b]:end[b]] = out_cache_loc[packed segment b]
    (twin: ``assign_req_to_token_pool`` in srt/mem_cache/allocation.py)."""
    flat_pos, packed = _segment_index(req_pool_indices, start_offset, end_offset, int(pool_len))
    if flat_pos.numel() == 0:
        return
    flat = req_to_token.view(-1)
    flat[flat_pos] = out_cache_loc.reshape(-1)[packed].to(req_to_token.dtype)


@_trace
def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,  # mutable
    pool_len: int,
) -> None:
    """out_cache_loc[packed segment b] = req_to_token[rpi[b], start[b]:end[b]]
    (twin: ``assign_extend_cache_locs`` in kernels/ops/speculative/cache_locs.py)."""
    flat_pos, packed = _segment_index(req_pool_indices, start_offset, end_offset, int(pool_len))
    if flat_pos.numel() == 0:
        return
    out_cache_loc.view(-1)[packed] = req_to_token.reshape(-1)[flat_pos].to(out_cache_loc.dtype)


@_trace
def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,  # mutable
    pool_len: int,
    topk: int,
    speculative_num_steps: int,
) -> None:
    """out_cache_loc[b*n : (b+1)*n] = req_to_token[rpi[b], seq_lens[b] : seq_lens[b]+n] with
    n = topk * speculative_num_steps (twin: ``assign_draft_cache_locs_contiguous``)."""
    n = int(topk) * int(speculative_num_steps)
    bs = seq_lens.numel()
    if n <= 0 or bs == 0:
        return
    rows = req_pool_indices.reshape(-1).to(torch.int64)
    starts = seq_lens.reshape(-1).to(torch.int64)
    src = (rows * int(pool_len) + starts)[:, None] + torch.arange(n, device=starts.device)
    out_cache_loc.view(-1)[: bs * n] = req_to_token.reshape(-1)[src.reshape(-1)].to(out_cache_loc.dtype)


@_trace
def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every buffer i (raw address data_ptrs[i], row size strides[i] bytes), copy row
    src_loc[k] to row tgt_loc[k] for all k; all rows are read before any is written
    (twin: ``copy_all_layer_kv_cache_tiled`` in kernels/ops/kvcache/cache_move.py)."""
    if data_ptrs.device.type != "cpu":
        # the buffers live where their address table does: reading device addresses through
        # ctypes would crash the process
        raise ValueError("copy_all_layer_kv_cache_cpu reads host memory only; data_ptrs is on "
                         f"{data_ptrs.device}")
    src = src_loc.reshape(-1).to(torch.int64)
    tgt = tgt_loc.reshape(-1).to(torch.int64)
    if src.numel() == 0:
        return
    n_rows = int(max(int(src.max()), int(tgt.max()))) + 1
    for ptr, stride in zip(data_ptrs.reshape(-1).tolist(), strides.reshape(-1).tolist()):
        stride = int(stride)
        if stride <= 0:
            continue
        raw = (ctypes.c_uint8 * (n_rows * stride)).from_address(int(ptr))
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(n_rows, stride)
        rows[tgt] = rows[src].clone()


# --------------------------------------------------------------------------------------------
# Speculative decoding helpers (kernels/ops/speculative/eagle.py, multi_layer_eagle.py)
# --------------------------------------------------------------------------------------------


@_trace
def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,  # mutable
    accept_stride: int,
) -> None:
    """bonus_tokens[b] = accept_tokens.flat[accept_stride*b + accept_lens[b] - 1]
    (twin: ``fill_bonus_tokens``)."""
    bs = accept_lens.numel()
    if bs == 0:
        return
    idx = torch.arange(bs, device=accept_lens.device) * int(accept_stride) + accept_lens.reshape(-1).to(torch.int64) - 1
    bonus_tokens.view(-1)[:bs] = accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype)


@_trace
def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,  # mutable
) -> None:
    """Compact out_cache_loc[accept_index[p]] over the entries p with accept_index[p] > -1 into
    accept_out_cache_loc, in order (twin: ``fill_accept_out_cache_loc``)."""
    ai = accept_index.reshape(-1).to(torch.int64)
    if ai.numel() == 0:
        return
    counted = (ai != -1).to(torch.int64)
    dst = torch.cumsum(counted, 0) - counted
    keep = ai > -1
    accept_out_cache_loc.view(-1)[dst[keep]] = out_cache_loc.reshape(-1)[ai[keep]].to(accept_out_cache_loc.dtype)


@_trace
def rotate_input_ids_cpu(
    input_ids: torch.Tensor,  # mutable
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    topk_index: torch.Tensor,
    select_index: Optional[torch.Tensor] = None,
) -> None:
    """Per request: shift its extend segment left by one and write topk_index[b] at
    select_index[b] (or at the segment's last slot) (twin: ``rotate_input_ids_kernel``)."""
    flat = input_ids.view(-1)
    starts, lens, new = _lists(extend_start_loc, extend_seq_lens, topk_index)
    sel = select_index.reshape(-1).tolist() if select_index is not None else None
    for b, (start, n) in enumerate(zip(starts, lens)):
        if n > 1:
            flat[start : start + n - 1] = flat[start + 1 : start + n].clone()
        if n > 0:
            flat[sel[b] if sel is not None else start + n - 1] = new[b]


@_trace
def verify_tree_greedy_cpu(
    predicts: torch.Tensor,  # mutable [bs*N] int32
    accept_index: torch.Tensor,  # mutable [bs, S] int32
    accept_token_num: torch.Tensor,  # mutable [bs] int32
    candidates: torch.Tensor,  # [bs, N]
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,  # [bs, N]
) -> None:
    """Greedy walk of the draft tree: at each depth take the first child (in sibling order)
    whose draft token equals the target's argmax at the last accepted node
    (twin: ``verify_tree_greedy_kernel_triton`` in kernels/ops/speculative/spec_tree.py)."""
    bs, n = candidates.shape[0], candidates.shape[1]
    s = accept_index.shape[1]
    cand, ridx, rnext, rsib, tgt = _lists(
        candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict
    )
    pred_flat = predicts.view(-1)
    acc_flat = accept_index.view(-1)
    for b in range(bs):
        base = b * n
        last = ridx[base]
        acc_flat[b * s] = last
        num = 0
        cur = 0
        for _ in range(1, s):
            cur = rnext[base + cur]
            target = tgt[last]
            matched = False
            while cur != -1:
                if cand[base + cur] == target:
                    pred_flat[last] = target
                    num += 1
                    acc_flat[b * s + num] = ridx[base + cur]
                    last = ridx[base + cur]
                    matched = True
                    break
                cur = rsib[base + cur]
            if not matched:
                break
        accept_token_num.view(-1)[b] = num
        pred_flat[last] = tgt[last]


@_trace
def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,  # [bs, topk*(depth-1)+1] int64
    selected_index: torch.Tensor,  # [bs, N-1] int64
    verified_seq_len: torch.Tensor,  # [bs]
    tree_mask: torch.Tensor,  # mutable, flat
    positions: torch.Tensor,  # mutable [bs*N]
    retrive_index: torch.Tensor,  # mutable [bs, N]
    retrive_next_token: torch.Tensor,  # mutable [bs, N], -1 on entry
    retrive_next_sibling: torch.Tensor,  # mutable [bs, N], -1 on entry
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int = _FULL_MASK,
) -> None:
    """EAGLE tree from the draft's top-k selection: retrieval links, positions and the tree mask
    (FULL_MASK: per request N rows of seq_len+N columns; QLEN_ONLY: N x N; QLEN_ONLY_BITPACKING:
    one little-endian bit row of 1/2/4 bytes per node)
    (twin: ``sgl_build_tree_kernel_efficient_triton``; bit-packing as the CUDA kernel)."""
    mode = int(tree_mask_mode)
    n = int(draft_token_num)
    topk = int(topk)
    depth = int(depth)
    bs = verified_seq_len.numel()
    if bs == 0:
        return
    seq_lens = verified_seq_len.reshape(-1).tolist()
    parents = parent_list.reshape(bs, -1).tolist() if parent_list.numel() else [[] for _ in range(bs)]
    selected = selected_index.reshape(bs, -1).tolist() if n > 1 else [[] for _ in range(bs)]
    pos = positions.view(-1)
    ridx = retrive_index.view(-1)
    rnext = retrive_next_token.view(-1)
    rsib = retrive_next_sibling.view(-1)
    if mode == _QLEN_ONLY_BITPACKING:
        mask_bytes = tree_mask.view(-1).view(torch.uint8)
        bytes_per_row = 4 if n > 16 else (2 if n > 8 else 1)
    else:
        mask = tree_mask.view(-1)

    pos_l = pos.tolist()
    ridx_l = ridx.tolist()
    rnext_l = rnext.tolist()
    rsib_l = rsib.tolist()
    prefix = 0
    for b in range(bs):
        seq_len = seq_lens[b]
        sel = selected[b]
        par = parents[b]

        def parent_slot(node: int):
            """Row of node's parent among the selected (0 = the root), or None if absent."""
            tb = sel[node - 1] // topk
            if tb == 0:
                return 0
            tok = par[tb]
            for pp in range(n - 1):
                if sel[pp] == tok:
                    return pp + 1
            return None

        # retrieval links, built from the last node back so siblings end up in index order
        pos_l[b * n] = seq_len
        for i in range(n - 1, 0, -1):
            ridx_l[b * n + i] = b * n + i
            p = parent_slot(i)
            if p is None:
                continue
            prev = rnext_l[b * n + p]
            rnext_l[b * n + p] = i
            if prev != -1:
                rsib_l[b * n + i] = prev
        ridx_l[b * n] = b * n

        # mask rows and positions
        for t in range(n):
            ancestors = []  # tree column offsets of the node's ancestors (column 0 = the root)
            d = 0
            if t > 0:
                cur = t - 1
                for _ in range(depth):
                    d += 1
                    ancestors.append(cur)
                    p = parent_slot(cur + 1)
                    if p is None or p == 0:
                        break
                    cur = p - 1
                pos_l[b * n + t] = seq_len + d
            if mode == _QLEN_ONLY_BITPACKING:
                row = (b * n + t) * bytes_per_row
                bits = 0
                for c in ancestors:
                    bits |= 1 << (c + 1)
                # as the CUDA kernel: byte 0 is assigned 1 first, then every bit is ORed in
                mask_bytes[row] = 1
                for k in range(bytes_per_row):
                    byte = (bits >> (8 * k)) & 0xFF
                    if byte:
                        mask_bytes[row + k] = int(mask_bytes[row + k]) | byte
            else:
                if mode == _FULL_MASK:
                    first = n * n * b + prefix * n + (seq_len + n) * t + seq_len
                else:
                    first = n * n * b + n * t
                row_vals = [0] * n
                row_vals[0] = 1
                for c in ancestors:
                    row_vals[c + 1] = 1
                mask[first : first + n] = torch.tensor(row_vals, dtype=mask.dtype)
        prefix += seq_len
    pos.copy_(torch.tensor(pos_l, dtype=pos.dtype))
    ridx.copy_(torch.tensor(ridx_l, dtype=ridx.dtype))
    rnext.copy_(torch.tensor(rnext_l, dtype=rnext.dtype))
    rsib.copy_(torch.tensor(rsib_l, dtype=rsib.dtype))


# --------------------------------------------------------------------------------------------
# Imported by SGLang but never called on this project's paths
# --------------------------------------------------------------------------------------------


def build_draft_decode_metadata_cpu(*args, **kwargs):
    raise NotImplementedError(
        "sgl_kernel.build_draft_decode_metadata_cpu (Intel AMX attention backend) is not provided "
        "by the mfd_sglang CPU stand-in; use --attention-backend torch_native or triton"
    )


from . import speculative  # noqa: E402,F401  (sgl_kernel.speculative.reconstruct_indices_from_tree_mask)

# What SGLang binds from the top-level package on CUDA (see the module docstring); the submodules
# kvcacheio, quantization and utils load when SGLang imports from them.
from ._unavailable import int8_scaled_mm, moe_sum, moe_sum_reduce  # noqa: E402,F401
from .model_ops import (  # noqa: E402,F401
    fused_add_rmsnorm,
    gelu_and_mul,
    gelu_tanh_and_mul,
    gemma_fused_add_rmsnorm,
    gemma_rmsnorm,
    rmsnorm,
    silu_and_mul,
    top_k_renorm_prob,
    top_p_renorm_prob,
    weak_ref_tensor,
)

# Hybrid Gated DeltaNet models (Qwen3.5 / Qwen3.6) on CPU: `sgl_kernel.mamba` loads when SGLang imports
# from it; the model's fused ops are torch library ops, registered here.
from . import hybrid_ops  # noqa: E402

hybrid_ops.register()
