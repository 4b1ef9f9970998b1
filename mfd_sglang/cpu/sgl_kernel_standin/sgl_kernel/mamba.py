"""``sgl_kernel.mamba`` of the stand-in: the causal convolution and the chunked gated delta rule that
SGLang 0.5.23's Gated DeltaNet backend (``layers/attention/linear/gdn_backend.py``,
``kernels/gdn_triton.py``) imports on CPU, in plain torch (float32 arithmetic).

Twins (what SGLang runs on GPUs): ``causal_conv1d_fn`` / ``causal_conv1d_update``
(``layers/attention/mamba/causal_conv1d_triton.py``) and FLA's ``chunk_gated_delta_rule``. The gated
delta rule is computed token by token (the chunked form is a faster schedule of the same recurrence).

Layouts, as SGLang's pools hold them:
  * conv state per slot [dim, W - 1]: the last W - 1 inputs, oldest first; conv weight [dim, W];
  * recurrent state per slot [H, V, K] float32 (``state[h, v, k]``: the Triton kernels' layout);
  * q, k [1, T, H, K] and v [1, T, HV, V] packed over requests by ``cu_seqlens`` [bs + 1]; HV may be
    a multiple of H (grouped heads).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import _trace as traced


def _activate(x: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    if activation in (None, "", "identity"):
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise NotImplementedError(f"sgl_kernel.mamba stand-in: conv activation {activation!r}")


def _conv_window(window: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 activation: Optional[str]) -> torch.Tensor:
    """One output per token: window [..., dim, W] (oldest first) against weight [dim, W]."""
    out = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return _activate(out, activation)


def _conv_sequence(history: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   activation: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's tokens x [dim, n] after its last W - 1 inputs history [dim, W - 1] (oldest first):
    (outputs [dim, n] in x's dtype, the new history: the last W - 1 inputs)."""
    seq = torch.cat([history.to(x.dtype), x], dim=1)  # [dim, W - 1 + n]
    windows = seq.unfold(1, weight.shape[1], 1)  # [dim, n, W]
    out = _conv_window(windows, weight[:, None, :], bias[:, None] if bias is not None else None, activation)
    return out.to(x.dtype), seq[:, -history.shape[1]:]


@traced
def causal_conv1d_fn_cpu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                         activation: Optional[str] = None, conv_states: Optional[torch.Tensor] = None,
                         has_initial_state: Optional[torch.Tensor] = None,
                         cache_indices: Optional[torch.Tensor] = None,
                         query_start_loc: Optional[torch.Tensor] = None, seq_lens_cpu=None,
                         **unsupported) -> torch.Tensor:
    """Prefill: x [dim, T] packed by query_start_loc; each request's window starts from its conv state
    (has_initial_state) or zeros, and its conv state becomes its last W - 1 inputs. Returns [dim, T]."""
    if unsupported.get("block_table") is not None:
        raise NotImplementedError("sgl_kernel.mamba stand-in: causal_conv1d_fn_cpu with a block table")
    dim, width = weight.shape
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    for r in range(len(starts) - 1):
        lo, hi = starts[r], starts[r + 1]
        slot = int(cache_indices[r])
        cached = has_initial_state is not None and bool(has_initial_state[r])
        history = conv_states[slot] if cached else x.new_zeros(dim, width - 1)
        out[:, lo:hi], history = _conv_sequence(history, x[:, lo:hi], weight, bias, activation)
        conv_states[slot] = history.to(conv_states.dtype)
    return out


def tree_parents(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """Parent pointers [bs, N] of EAGLE's tree links (first child / next sibling per window index,
    -1 for none), as SGLang's verify conv kernel derives them: a token's first child has it as
    parent, its next sibling shares its parent. The root (index 0) gets 0."""
    parents = torch.zeros_like(next_token)
    for r in range(next_token.shape[0]):
        for i in range(next_token.shape[1]):
            child, sibling = int(next_token[r, i]), int(next_sibling[r, i])
            if child >= 0:
                parents[r, child] = i
            if sibling >= 0:
                parents[r, sibling] = parents[r, i]
    return parents


def _verify_conv(x, conv_state, weight, bias, activation, conv_state_indices, intermediate_conv_window,
                 intermediate_state_indices, retrieve_next_token, retrieve_next_sibling, retrieve_parent_token):
    """Target verify of a window of N tokens per request, x [bs, dim, N]: each token convolves its own
    path (a chain, or with tree links its ancestors), reading the request's conv state before the
    window's first token. The window of every step (the last W - 1 inputs of its path, oldest first)
    goes to intermediate_conv_window[intermediate_state_indices[r], step]; the conv state itself is
    left for the commit, which copies the accepted step's window into it. Tree links also fill
    retrieve_parent_token."""
    bs, dim, n = x.shape
    width = weight.shape[1]
    parents = (tree_parents(retrieve_next_token, retrieve_next_sibling) if retrieve_next_token is not None
               else torch.arange(-1, n - 1).expand(bs, n).clamp(min=0))
    if retrieve_parent_token is not None:
        retrieve_parent_token.copy_(parents)
    out = torch.empty_like(x)
    for r in range(bs):
        slot = int(conv_state_indices[r])
        if slot < 0:
            out[r] = 0
            continue
        history = conv_state[slot].to(x.dtype)  # the W - 1 inputs before the root, oldest first
        for step in range(n):
            path, node = [], step
            while len(path) < width:  # the node, its parent, ... back into the committed history
                path.append(x[r, :, node])
                if node == 0:
                    break
                node = int(parents[r, node])
            path += [history[:, -k] for k in range(1, width - len(path) + 1)]
            window = torch.stack(path[::-1], dim=1)  # [dim, W], oldest first
            out[r, :, step] = _conv_window(window, weight, bias, activation).to(x.dtype)
            cache = int(intermediate_state_indices[r])
            if cache >= 0:
                intermediate_conv_window[cache, step] = window[:, 1:].to(intermediate_conv_window.dtype)
    return out


@traced
def causal_conv1d_update_cpu(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                             bias: Optional[torch.Tensor] = None, activation: Optional[str] = None,
                             cache_seqlens=None, conv_state_indices: Optional[torch.Tensor] = None,
                             intermediate_conv_window: Optional[torch.Tensor] = None,
                             intermediate_state_indices: Optional[torch.Tensor] = None,
                             retrieve_next_token: Optional[torch.Tensor] = None,
                             retrieve_next_sibling: Optional[torch.Tensor] = None,
                             retrieve_parent_token: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode: x [bs, dim] (one token per request) or [bs, dim, n] (n tokens in a row); each token's
    window is the request's conv state then the token; the state shifts by the tokens. With
    intermediate_conv_window: a target verify (`_verify_conv`)."""
    if cache_seqlens is not None:
        raise NotImplementedError("sgl_kernel.mamba stand-in: causal_conv1d_update_cpu with a circular buffer")
    squeeze = x.dim() == 2
    xs = x[..., None] if squeeze else x
    indices = (conv_state_indices if conv_state_indices is not None
               else torch.arange(xs.shape[0], device=xs.device))
    if intermediate_conv_window is not None:
        out = _verify_conv(xs, conv_state, weight, bias, activation, indices, intermediate_conv_window,
                           intermediate_state_indices, retrieve_next_token, retrieve_next_sibling,
                           retrieve_parent_token)
        return out[..., 0] if squeeze else out
    out = torch.empty_like(xs)
    for r in range(xs.shape[0]):
        slot = int(indices[r])
        if slot < 0:  # padding rows
            out[r] = 0
            continue
        out[r], history = _conv_sequence(conv_state[slot], xs[r], weight, bias, activation)
        conv_state[slot] = history.to(conv_state.dtype)
    return out[..., 0] if squeeze else out


def _l2_normalized(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, float32 (FLA's and the Triton kernels' l2norm)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _gated_delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for all heads, float32: state [HV, V, K]; q, k [HV, K]
    (normalised and q scaled by the caller); v [HV, V]; g (log decay), beta [HV].
    state *= exp(g); v' = beta * (v - state k); state += v' k^T; out = state q."""
    state = state * g.exp()[:, None, None]
    delta = (v - (state * k[:, None, :]).sum(-1)) * beta[:, None]
    state = state + delta[:, :, None] * k[:, None, :]
    return state, (state * q[:, None, :]).sum(-1)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     pool: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor, *, l2norm: bool,
                     scale: Optional[float] = None, update_state: bool = True,
                     scratch: Optional[torch.Tensor] = None, scratch_rows: Optional[torch.Tensor] = None,
                     parents: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gated delta rule over requests packed by cu_seqlens: q, k [T, H, K], v [T, HV, V], g, beta
    [T, HV]. Request r starts from pool[slots[r]] (zeros for a slot < 0) and, with update_state, leaves
    its final state there. With scratch [rows, steps, HV, V, K]: the state after each step goes to
    scratch[scratch_rows[r], step], and with parents [bs, steps] step j > 0 starts from the state after
    its parent's step instead of the previous one (a tree). Returns the outputs [T, HV, V] in float32."""
    heads = v.shape[-2]
    qf, kf = (_l2_normalized(t) if l2norm else t.float() for t in (q, k))
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    qf, kf = _expand_heads(qf * scale, heads), _expand_heads(kf, heads)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32)
    starts = cu_seqlens.tolist()
    for r in range(len(starts) - 1):
        slot = int(slots[r])
        state = pool[slot].float() if slot >= 0 else torch.zeros(pool.shape[1:], dtype=torch.float32)
        row = -1 if scratch is None else int(scratch_rows[r])
        for step, t in enumerate(range(starts[r], starts[r + 1])):
            if parents is not None and step > 0 and row >= 0:
                state = scratch[row, int(parents[r, step])].float()
            state, out[t] = _gated_delta_step(state, qf[t], kf[t], vf[t], gf[t], bf[t])
            if row >= 0:
                scratch[row, step] = state.to(scratch.dtype)
        if update_state and slot >= 0:
            pool[slot] = state.to(pool.dtype)
    return out


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., H, D] -> [..., heads, D] with each of the H heads serving heads // H value heads."""
    return x.repeat_interleave(heads // x.shape[-2], dim=-2)


@traced
def chunk_gated_delta_rule_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
                               head_first: bool = False, use_qk_l2norm_in_kernel: bool = False,
                               initial_state_indices: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                               output_final_state: bool = True, **unsupported):
    """Prefill: q, k [1, T, H, K], v [1, T, HV, V], g, beta [1, T, HV]; each request starts from
    initial_state[initial_state_indices[r]] and its final state is written back there. Returns
    (output [1, T, HV, V] in v's dtype, None, None) like SGLang's CPU kernel wrapper."""
    if head_first:
        raise NotImplementedError("sgl_kernel.mamba stand-in: head_first layout")
    for name in ("state_checkpoint_cu_starts", "track_state"):
        if unsupported.get(name) is not None:
            raise NotImplementedError(f"sgl_kernel.mamba stand-in: chunk_gated_delta_rule_cpu with {name}")
    slots = initial_state_indices if initial_state_indices is not None else torch.arange(len(cu_seqlens) - 1)
    out = gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], initial_state, slots, cu_seqlens,
                           l2norm=use_qk_l2norm_in_kernel, scale=scale)
    return out.to(v.dtype)[None], None, None
