"""The MFD drafter in plain PyTorch: a DFlash block drafter that drafts K modes in one forward pass.

Architecture (DFlash): Qwen3-style layers (q_norm/k_norm, RoPE, SwiGLU MLP). Hidden states of a few
target layers are concatenated, projected by `fc` and normalised by `hidden_norm`; every layer
turns that context into keys and values of its own (k_proj + k_norm + RoPE at the true positions,
v_proj) and attends to it ahead of the block. The block is `[last verified token, MASK x D]`,
embedded with the TARGET's embeddings; attention inside a block is bidirectional. The final norm
feeds the TARGET's lm_head.

MFD: copy k of the block gets mode embedding k added to every position. All K copies share the
context keys/values and run in the same forward pass; a copy never sees another copy's block.

Mode gate (`mode_prior`, optional): a K-way softmax over the final-normed state of the block's anchor
slot (the root), averaged over the K copies, gives each request's mode weights pi. `block_logprobs`
and `block_candidates` return what the tree reads with log pi folded into depth 1
(`mfd_sglang.tree.weigh_modes`), so every engine weighs the modes alike; without a gate (or on the
single-mode path) they are the drafter's log-probabilities as they are.

Fewer modes per request (`gate_modes`, issue 43 item 4): with a gate, a request can draft only its K' < K
modes of highest weight. The weights must be known before the draft, so the gate then reads the anchors of a
root-only block (the K copies of `[root]`, 1/block_size of a draft's tokens) instead of the full block's;
the K' copies drafted are exactly those copies of the K-mode draft (a copy never sees another).

Context K/V (`context_kv`): every layer projects the same context, so the keys of all layers come from one
product and the values from another, normed and rotated in one op each; a layer's MLP reads its gate and up
projections in one product. `join_projections` makes the parameters each product reads views of one tensor
(the serving stage does: no copy per call).

FP8 (`from_checkpoint(..., fp8_linears=True)`, a server's `--speculative-draft-model-quantization fp8`):
every layer's attention projections and MLP (`FP8_LINEARS`) run as `mfd_sglang.fp8.FP8Linear`, as SGLang's
online FP8 quantizes a DFlash draft model's layers; the context projection `fc`, the norms, the mode
embeddings and the target's embeddings and head stay in the serving dtype.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .backend import check_backend
from .checkpoint import DrafterCheckpoint, DrafterConfig
from .fp8 import FP8Linear
from .tree import DraftCandidates, weigh_modes

# Vocabulary rows scored at once when only the top candidates are needed: bounds the draft's
# memory to [bs, K, D, VOCAB_CHUNK] logits (plus their sort) whatever the vocabulary size.
VOCAB_CHUNK = 4096
# The linears of every drafter layer that FP8 drafting quantizes (SGLang's DFlash draft model passes its
# quantization config to these and keeps `fc` a plain linear).
FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_linear_shapes(cfg: DrafterConfig) -> list[tuple[int, int]]:
    """(out, in) features of every linear FP8 drafting quantizes, all layers."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)] * cfg.num_hidden_layers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: PyTorch's fused op (one kernel on CUDA, float32 statistics)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def residual_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its RMSNorm); delta None: (x, its RMSNorm). The sum and its norm in one launch on the
    "triton" backend (`kernels/draft_residual_mlp.py`)."""
    if delta is None:
        return x, rms_norm(x, weight, eps)
    if backend == "triton":
        from mfd_sglang.kernels.draft_residual_mlp import add_rms_norm

        return add_rms_norm(x, delta, weight, eps)
    x = x + delta
    return x, rms_norm(x, weight, eps)


def rope_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    """[head_dim / 2] float32: the inverse frequencies of HF's 'default' rope."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos and signed-sin tables [..., head_dim] for integer positions [...] (HF 'default' rope, half-rotation):
    cos of the angles twice, their sin with the first copy negated (what `apply_rope` multiplies)."""
    angles = positions.float()[..., None] * rope_inv_freq(head_dim, theta, positions.device)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


class Rope(NamedTuple):
    """A round's rope, made once and read by every layer: the tables [bs, T, 1, head_dim] (broadcast over
    heads) of the torch path, or (`positions_only`) the positions [bs, T] and inverse frequencies the Triton
    norm + rope makes them from in its own registers."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    positions: torch.Tensor
    inv_freq: torch.Tensor | None = None

    @classmethod
    def at(cls, positions: torch.Tensor, cfg: DrafterConfig, dtype: torch.dtype) -> "Rope":
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)
        return cls(cos[:, :, None], sin[:, :, None], positions)

    @classmethod
    def positions_only(cls, positions: torch.Tensor, inv_freq: torch.Tensor) -> "Rope":
        return cls(None, None, positions, inv_freq)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with HF's rotate_half(x) = [-x2, x1]: with sin's first half negated
    (`rope_cos_sin`) that is roll(x) * sin, bit for bit (negation is exact), one data movement instead of a
    negation and a concatenation."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def vocab_candidates(hidden: torch.Tensor, weight: torch.Tensor, count: int, chunk_size: int = VOCAB_CHUNK, *,
                     backend: str = "torch") -> DraftCandidates:
    """The `count` best rows of `hidden @ weight.T` per leading index, as log-probabilities over all
    rows (float32), best first and equal logits in row order, one chunk of rows at a time.

    hidden [..., H], weight [V, H] (V < 2^31). The log-normaliser is accumulated online (running max
    and rescaled sum); the ranking is by logit, which orders like the log-probability. Against
    `log_softmax` of the whole row the values differ only by the rounding of the normaliser.
    Each logit and its row form one distinct int64 key (as in the Triton tree kernel), so a plain
    top-k (no full sort, no tie ambiguity) keeps the running best.

    backend: "torch" (this function), or "triton" (`mfd_sglang.kernels.draft_vocab`: one fused
    lm_head + top-B kernel, no logits beyond a tile; chunk_size is unused; float32/float16/bfloat16
    hidden and weight of one dtype; CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported
    for CPU ones, else ValueError). Its ids equal these and its log-probabilities agree up to the
    normaliser's float32 rounding, wherever both GEMMs give equal logits (see that module).
    """
    if check_backend(backend) == "triton":
        # Imported here: the torch backend must not need triton.
        from mfd_sglang.kernels.draft_vocab import vocab_candidates_triton

        return vocab_candidates_triton(hidden, weight, count)
    vocab = weight.shape[0]
    count = min(count, vocab)
    lead = hidden.shape[:-1]
    # One [rows, H] matrix: a strided [..., H] view would make matmul copy each weight chunk per batch row.
    rows = hidden.reshape(-1, hidden.shape[-1])
    best = torch.empty(*lead, 0, dtype=torch.int64, device=hidden.device)
    row_max = torch.full(lead, float("-inf"), device=hidden.device)
    row_sum = torch.zeros(lead, device=hidden.device)
    for start in range(0, vocab, chunk_size):
        logits = (rows @ weight[start : start + chunk_size].T).float().view(*lead, -1)
        new_max = torch.maximum(row_max, logits.amax(-1))
        row_sum = row_sum * torch.exp(row_max - new_max) + torch.exp(logits - new_max[..., None]).sum(-1)
        row_max = new_max
        ids = torch.arange(start, start + logits.shape[-1], device=hidden.device)
        merged = torch.cat([best, rank_keys(logits, ids)], -1)
        best = merged.topk(min(count, merged.shape[-1]), dim=-1).values
    logits, ids = from_rank_keys(best)
    return DraftCandidates(logits - (row_max + row_sum.log())[..., None], ids, vocab)


_LOW31 = 0x7FFFFFFF


def rank_keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered like (value, -id): the float's order-preserving int32 bits in the high half
    (negative floats flip their magnitude bits; -0.0 counts as +0.0), 2^31 - 1 - id in the low half."""
    bits = torch.where(values == 0, torch.zeros_like(values), values).view(torch.int32)
    ordered = bits ^ ((bits >> 31) & _LOW31)
    return (ordered.to(torch.int64) << 32) + (_LOW31 - ids)


def from_rank_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `rank_keys`: (float32 values, int64 ids)."""
    ordered = (keys >> 32).to(torch.int32)
    return (ordered ^ ((ordered >> 31) & _LOW31)).view(torch.float32), _LOW31 - (keys & 0xFFFFFFFF)


def context_features(hidden_states: tuple[torch.Tensor, ...], layer_ids) -> torch.Tensor:
    """Concatenate the outputs of the drafter's target layers (HF hidden_states[0] is the embedding)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@dataclass
class DraftContext:
    """The drafter's per-layer context keys/values, padded on the right: k, v [bs, kv_heads, L, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor  # [bs, L] true token positions
    valid: torch.Tensor  # [bs, L] bool, False for padding

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    def append(self, other: "DraftContext") -> "DraftContext":
        return DraftContext(
            keys=[torch.cat([a, b], dim=2) for a, b in zip(self.keys, other.keys)],
            values=[torch.cat([a, b], dim=2) for a, b in zip(self.values, other.values)],
            positions=torch.cat([self.positions, other.positions], dim=1),
            valid=torch.cat([self.valid, other.valid], dim=1),
        )


def joined(params: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The tensors concatenated along dim 0 (contiguous, one trailing shape; None for a list of Nones, e.g. no
    biases): a view when they lie back to back in one storage (`join_in_place` put them there), else a copy."""
    first = params[0]
    if first is None:
        return None
    offset = first.storage_offset()
    for p in params:
        if not (p.is_contiguous() and p.storage_offset() == offset
                and p.untyped_storage()._cdata == first.untyped_storage()._cdata):  # one storage (no data read)
            return torch.cat(params)
        offset += p.numel()
    rows = sum(p.shape[0] for p in params)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


@torch.no_grad()
def join_in_place(params: list[tuple[nn.Module, str]]) -> None:
    """Make the parameters `module.name` views of one tensor, back to back in the order given (no copy kept: the
    products that read them `joined` read them in place). For inference: they stop requiring gradients."""
    tensors = [getattr(module, name) for module, name in params]
    if tensors[0] is None:
        return
    whole, start = torch.cat(tensors), 0
    for (module, name), t in zip(params, tensors):
        setattr(module, name, nn.Parameter(whole[start:start + t.shape[0]].view(t.shape), requires_grad=False))
        start += t.shape[0]


def plain_linears(*modules: nn.Module) -> bool:
    """Whether every module is a plain nn.Linear (FP8 linears carry scales of their own: no joined product)."""
    return all(type(m) is nn.Linear for m in modules)


class ModeSubset(NamedTuple):
    """The modes each request drafts (`MFDDrafter.gate_modes`): a subset chosen by the mode gate."""

    ids: torch.Tensor  # [bs, K'] indices into the drafter's modes, best first
    log_prior: torch.Tensor  # [bs, K'] float32: their log-weights under the gate (over all K modes)

    @classmethod
    def best(cls, log_prior: torch.Tensor, count: int) -> "ModeSubset":
        """Each request's `count` modes of highest log-weight in log_prior [bs, K], ties to the lower index
        (a stable descending sort)."""
        ids = torch.sort(log_prior, dim=-1, descending=True, stable=True).indices[:, :count]
        return cls(ids, log_prior.gather(1, ids))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer: int):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.cfg, self.layer = cfg, layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=bias)
        self.q_norm = nn.Parameter(torch.ones(hd))
        self.k_norm = nn.Parameter(torch.ones(hd))
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))

    def projected_keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The k and v projections [bs, T, kv_heads, hd] of inputs x [bs, T, H] (before norm and rope)."""
        bs, t, _ = x.shape
        return tuple(proj(x).view(bs, t, self.num_kv_heads, self.head_dim) for proj in (self.k_proj, self.v_proj))

    def keys_values(self, x: torch.Tensor, rope: Rope, backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [bs, kv_heads, T, hd] for inputs x [bs, T, H] under the rope
        of their positions (`queries_keys_values`'s backends)."""
        k, v = self.projected_keys_values(x)
        if backend == "triton":
            from mfd_sglang.kernels.draft_norm_rope import norm_rope_

            norm_rope_(None, None, k, self.k_norm, rope.positions, rope.inv_freq, self.cfg.rms_norm_eps)
        else:
            k = apply_rope(rms_norm(k, self.k_norm, self.cfg.rms_norm_eps), rope.cos, rope.sin)
        return k.transpose(1, 2), v.transpose(1, 2)

    def queries_keys_values(self, h: torch.Tensor, rope: Rope, backend: str) -> tuple[torch.Tensor, ...]:
        """Queries, keys (each normed, rotated) and values [bs, heads, T, hd] (views of [bs, T, heads, hd]) of
        inputs h [bs, T, H]; backend "triton": q and k normed and rotated in place in one launch
        (`kernels/draft_norm_rope.py`), else torch (`rms_norm`, `apply_rope`)."""
        bs, t, _ = h.shape
        q = self.q_proj(h).view(bs, t, self.num_heads, self.head_dim)
        if backend == "triton":
            from mfd_sglang.kernels.draft_norm_rope import norm_rope_

            k, v = self.projected_keys_values(h)
            norm_rope_(q, self.q_norm, k, self.k_norm, rope.positions, rope.inv_freq, self.cfg.rms_norm_eps)
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = apply_rope(rms_norm(q, self.q_norm, self.cfg.rms_norm_eps), rope.cos, rope.sin)
        return (q.transpose(1, 2), *self.keys_values(h, rope))

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, rope: Rope, attend,
                backend: str = "torch", normed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream x + delta [bs, K*T, H] (mode-major; delta None: x alone) through the layer, as
        (its stream after attention, the MLP's output): the next layer (or the final norm) adds them, in one
        launch with its norm on the "triton" backend (`MFDDrafter.backend`). rope: the tables of its
        positions [bs, K*T]; `attend(q, k, v)` joins the block's queries / keys / values [bs, heads, K*T, hd]
        (views of [bs, K*T, heads, hd]) with the context (`dense_attention` or a paged context's mode
        attention) and returns [bs, heads, K*T, hd]. normed: x's input norm where the caller made it (delta
        None: the block input kernel's)."""
        bs, rows, _ = x.shape
        eps = self.cfg.rms_norm_eps
        x, h = (x, normed) if normed is not None else residual_rms_norm(x, delta, self.input_layernorm, eps, backend)
        attn = attend(*self.queries_keys_values(h, rope, backend))
        # A view when attend's output is laid out [bs, K*T, heads, hd] (mode attention's is); else a copy.
        x, h = residual_rms_norm(x, self.o_proj(attn.transpose(1, 2).reshape(bs, rows, -1)),
                                 self.post_attention_layernorm, eps, backend)
        return x, self.mlp(h, backend)

    def mlp(self, h: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """SwiGLU; gate and up from one product (`joined`) where both are plain linears, then SiLU(gate) x up
        in one launch on the "triton" backend."""
        if not plain_linears(self.gate_proj, self.up_proj):
            return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        gate_up = F.linear(h, joined([self.gate_proj.weight, self.up_proj.weight]))
        if backend == "triton":
            from mfd_sglang.kernels.draft_residual_mlp import silu_mul

            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def dense_attention(ctx_k: torch.Tensor, ctx_v: torch.Tensor, mask: torch.Tensor,
                    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The block attends to padded context keys/values [bs, kv_heads, L, hd] and to itself under a
    bool mask [bs, 1, K*T, L + K*T]."""
    return F.scaled_dot_product_attention(q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2),
                                          attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class MFDDrafter(nn.Module):
    """A DFlash/MFD drafter. Embeddings and lm_head are the target's, passed in at call time."""

    def __init__(self, cfg: DrafterConfig, context_features: int):
        super().__init__()
        self.cfg = cfg
        # The fused steps of the layers, the block input and the context keys (norm + rope, residual add +
        # norm, SiLU x up), FP8's quantizer and the commit's rows: "torch", or the serving stage's choice
        # (`join_projections`, `mfd_sglang.backend`).
        self.backend = "torch"
        self.rope_inv_freq: torch.Tensor | None = None  # float32, on the weights' device (`join_projections`)
        h = cfg.hidden_size
        self.fc = nn.Linear(context_features, h, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.norm = nn.Parameter(torch.ones(h))
        self.layers = nn.ModuleList(DrafterLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.mode_embed = nn.Parameter(torch.zeros(cfg.num_modes, h), requires_grad=cfg.num_modes > 1)
        self.default_mode_embed = nn.Parameter(torch.zeros(h)) if cfg.default_mode is None else None
        self.mode_prior = nn.Linear(h, cfg.num_modes) if cfg.mode_prior == "gate" else None
        self.register_buffer("draft_vocab", None)
        # A plain DFlash checkpoint has no mode_embed; the module then holds one zero row.
        self.carries_mode_embed = cfg.num_modes > 1

    # --- loading -------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, ckpt: DrafterCheckpoint, *, dtype: torch.dtype | None = None,
                        fp8_linears: bool = False) -> "MFDDrafter":
        """The drafter in `dtype` (default: the checkpoint's); fp8_linears: then `quantize_linears_fp8`."""
        w = ckpt.weights
        model = cls(ckpt.config, context_features=w["fc.weight"].shape[1])
        weights = _to_module_names(w, ckpt.config)
        if "draft_vocab" in weights:
            weights["draft_vocab"] = weights["draft_vocab"].long()
            model.draft_vocab = torch.empty_like(weights["draft_vocab"])
        model.carries_mode_embed = "mode_embed" in w
        model.load_state_dict(weights, strict=True)
        if dtype is not None:
            model.to(dtype)
        if fp8_linears:
            model.quantize_linears_fp8()
        return model.eval()

    def quantize_linears_fp8(self) -> "MFDDrafter":
        """Every layer's `FP8_LINEARS` as `FP8Linear`, quantized from their weights in the current dtype
        (in place; returns self). A later dtype cast would cast the e4m3 weights too: cast first."""
        for layer in self.layers:
            for name in FP8_LINEARS:
                setattr(layer, name, FP8Linear.from_linear(getattr(layer, name)))
        return self

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """Weights under the checkpoint's (z-lab) names; inverse of from_checkpoint."""
        names = {module: ckpt for ckpt, module in _name_map(self.cfg).items()}
        out = {names.get(n, n): p.detach() for n, p in self.state_dict().items() if p is not None}
        if not self.carries_mode_embed:
            out.pop("mode_embed")
        return out

    # --- the pieces of a draft step ------------------------------------------------------------
    @property
    def num_draft_positions(self) -> int:
        return self.cfg.block_size - 1

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Concatenated target-layer hidden states [bs, L, n_ctx*H] -> drafter context [bs, L, H]."""
        return rms_norm(self.fc(target_hidden), self.hidden_norm, self.cfg.rms_norm_eps)

    def context_rows(self, target_hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's context keys (normed, rotated) and values [bs, T, layers, kv_heads, hd] of new context
        tokens: target hidden states [bs, T, F] at positions [bs, T].

        Every layer projects the same context, so all layers' keys come from one product and their values
        from another (`joined`), normed in one op (each layer's k-norm weight applied after) and rotated in one
        (both in one launch on the "triton" `backend`): a commit's launches do not grow with the
        layers. FP8 linears (their own scales per layer) take each layer's `keys_values` instead."""
        ctx = self.project_context(target_hidden)
        rope = self.rope_at(positions, ctx.dtype)
        layers = self.layers
        if not plain_linears(*(m for layer in layers for m in (layer.k_proj, layer.v_proj))):
            keys, values = zip(*(layer.keys_values(ctx, rope, self.backend) for layer in layers))
            return tuple(torch.stack([x.transpose(1, 2) for x in rows], dim=2) for rows in (keys, values))
        bs, t, _ = ctx.shape
        shape = (bs, t, len(layers), self.cfg.num_key_value_heads, self.cfg.head_dim)
        k, v = (F.linear(ctx, joined([getattr(layer, name).weight for layer in layers]),
                         joined([getattr(layer, name).bias for layer in layers])).view(shape)
                for name in ("k_proj", "v_proj"))
        k_norm = joined([layer.k_norm for layer in layers]).view(len(layers), 1, -1)
        if self.backend == "triton":
            from mfd_sglang.kernels.draft_norm_rope import norm_rope_

            norm_rope_(None, None, k.view(bs, t, -1, shape[-1]), k_norm, positions, rope.inv_freq,
                       self.cfg.rms_norm_eps)
            return k, v
        return apply_rope(F.rms_norm(k, shape[-1:], None, self.cfg.rms_norm_eps) * k_norm,
                          rope.cos[:, :, None], rope.sin[:, :, None]), v

    def context_kv(self, target_hidden: torch.Tensor, positions: torch.Tensor,
                   valid: torch.Tensor | None = None) -> DraftContext:
        """Per-layer context keys/values [bs, kv_heads, T, hd] for new context tokens (`context_rows`, appended
        to the draft cache)."""
        k, v = self.context_rows(target_hidden, positions)
        if valid is None:
            valid = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        return DraftContext([k[:, :, i].transpose(1, 2) for i in range(k.shape[2])],
                            [v[:, :, i].transpose(1, 2) for i in range(v.shape[2])], positions, valid)

    def join_projections(self, backend: str = "torch") -> "MFDDrafter":
        """Serving: the parameters read by one product each become views of one tensor (`join_in_place`): all
        layers' k_proj, v_proj (weights, biases) and k-norms for `context_kv`, each layer's gate and up
        projections for its MLP. No memory is added; the products read them in place instead of concatenating
        them per call. Plain linears only (not after `quantize_linears_fp8`); a later cast copies them apart
        again (the products then concatenate per call). The fused steps then run on `backend` ("torch" or
        "triton", `mfd_sglang.backend`), FP8 linears' activation quantizer too. Returns self."""
        layers = self.layers
        if plain_linears(*(m for layer in layers for m in (layer.k_proj, layer.v_proj))):
            for name in ("k_proj", "v_proj"):
                for field in ("weight", "bias"):
                    join_in_place([(getattr(layer, name), field) for layer in layers])
            join_in_place([(layer, "k_norm") for layer in layers])
        for layer in layers:
            if plain_linears(layer.gate_proj, layer.up_proj):
                join_in_place([(layer.gate_proj, "weight"), (layer.up_proj, "weight")])
        self.backend = check_backend(backend)
        for layer in layers:
            for name in FP8_LINEARS:
                if isinstance(getattr(layer, name), FP8Linear):
                    getattr(layer, name).backend = backend
        self.rope_inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, self.fc.weight.device)
        return self

    def rope_at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The rope of positions [bs, T] for `backend`: the tables (torch), or the positions alone."""
        if self.backend == "triton":
            return Rope.positions_only(positions, self.rope_inv_freq)
        return Rope.at(positions, self.cfg, dtype)

    def mode_vectors(self, single_mode: bool) -> torch.Tensor:
        """[K', H]: the K mode embeddings, or the one vector of the default (single-mode) path."""
        if not single_mode:
            return self.mode_embed
        if self.default_mode_embed is not None:
            return self.default_mode_embed[None]
        return self.mode_embed[self.cfg.default_mode : self.cfg.default_mode + 1]

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, context: DraftContext,
                *, single_mode: bool = False, mode_ids: torch.Tensor | None = None, with_anchor: bool = False):
        """Draft all modes in one pass.

        block_embeds [bs, T, H]: target embeddings of `[last verified token, MASK x (T-1)]`;
        block_positions [bs, T]; context: a padded DraftContext, or a paged context read in place
        (full attention only: drafters with sliding layers need the DraftContext). mode_ids [bs, K']: draft
        only these modes of each request (`gate_modes`); else the K modes, or the single-mode path's one.
        Returns the final-normed hidden states [bs, K', T-1, H] of the drafted positions (the first block
        slot is dropped), contiguous: a strided view would make every `hidden @ head.T` of its consumers
        copy the head per (request, mode) on CPU. with_anchor: also the dropped slot's states [bs, K', H]
        (the mode gate's input), as a tuple.
        """
        bs, t, h = block_embeds.shape
        modes = self.block_modes(single_mode, mode_ids, block_embeds.dtype)
        k = modes.shape[1]
        x = (block_embeds[:, None] + modes[:, :, None]).reshape(bs, k * t, h)
        return self.run_layers(x, None, block_positions.repeat(1, k), t, context, with_anchor)

    def block_modes(self, single_mode: bool, mode_ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The mode vectors [bs or 1, K', H] a block adds (`forward`'s single_mode / mode_ids)."""
        return (self.mode_embed[mode_ids] if mode_ids is not None else self.mode_vectors(single_mode)[None]).to(dtype)

    def run_layers(self, x: torch.Tensor, normed: torch.Tensor | None, positions: torch.Tensor, t: int, context,
                   with_anchor: bool):
        """`forward` from its block input: the residual stream x [bs, K'*T, H] (mode-major), its first norm
        (None: the first layer makes it) and positions [bs, K'*T]."""
        bs, rows, h = x.shape
        k = rows // t
        if isinstance(context, DraftContext):
            masks = self._attention_mask(context, positions[:, :t], k)
            attends = [partial(dense_attention, context.keys[i], context.values[i], masks[i])
                       for i in range(len(self.layers))]
        else:  # a paged context (mfd_sglang.serving.draft_context_pool.PagedDraftContext)
            attends = [context.attend(i, num_modes=k) for i in range(len(self.layers))]
        rope = self.rope_at(positions, x.dtype)
        delta = None
        for layer, attend in zip(self.layers, attends):
            x, delta = layer(x, delta, rope, attend, self.backend, normed)
            normed = None
        x = residual_rms_norm(x, delta, self.norm, self.cfg.rms_norm_eps, self.backend)[1].view(bs, k, t, h)
        drafted = x[:, :, 1:].contiguous()
        return (drafted, x[:, :, 0]) if with_anchor else drafted

    def without_mode_gate(self) -> "MFDDrafter":
        """A copy with the same weights and no mode gate: the same drafts, the unweighted tree (to compare
        the two rules on one drafter)."""
        plain = copy.deepcopy(self)
        plain.mode_prior, plain.cfg = None, replace(self.cfg, mode_prior="uniform")
        return plain

    def mode_log_prior(self, anchor: torch.Tensor) -> torch.Tensor | None:
        """log pi [bs, K] (float32) of the mode gate on the anchor states [bs, K, H] of the K copies;
        None without a gate or for a single copy (the unweighted tree)."""
        if self.mode_prior is None or anchor.shape[1] == 1:
            return None
        return torch.log_softmax(self.mode_prior(anchor.mean(1)).float(), dim=-1)

    def _attention_mask(self, context: DraftContext, block_positions: torch.Tensor, k: int) -> list[torch.Tensor]:
        """Per-layer bool masks [bs, 1, K*T, Lc + K*T]: valid context + own mode's block (bidirectional).

        Sliding-attention layers are causal with a window, as in DFlash checkpoints that use them.
        """
        bs, t = block_positions.shape
        mode_of_row = torch.arange(k, device=block_positions.device).repeat_interleave(t)
        same_mode = mode_of_row[:, None] == mode_of_row[None, :]
        full = torch.cat([context.valid[:, None, :].expand(bs, k * t, -1), same_mode.expand(bs, -1, -1)], dim=2)
        masks = []
        key_pos = torch.cat([context.positions, block_positions.repeat(1, k)], dim=1)
        query_pos = block_positions.repeat(1, k)
        for i in range(self.cfg.num_hidden_layers):
            mask = full
            if self.cfg.is_sliding(i):
                delta = query_pos[:, :, None] - key_pos[:, None, :]
                mask = mask & (delta >= 0) & (delta < self.cfg.sliding_window)
            masks.append(mask[:, None])
        return masks

    def gate_modes(self, roots: torch.Tensor, starts: torch.Tensor, context, embed_weight: torch.Tensor,
                   count: int) -> ModeSubset:
        """Each request's `count` modes of highest gate weight (ties to the lower index), before its block is
        drafted: the gate reads the anchor states of the K copies of a root-only block `[root]` at
        positions starts (the root and the context, not the block's MASK slots: 1/block_size of a K-mode
        draft's tokens). Needs a mode gate."""
        if self.mode_prior is None:
            raise ValueError("choosing modes per request needs a drafter with a mode gate (mfd_config.mode_prior "
                             "= \"gate\"); this one weighs its modes uniformly")
        num_modes = self.mode_embed.shape[0]
        if not 1 <= count <= num_modes:
            raise ValueError(f"count must be in 1..{num_modes} (the drafter's modes), got {count}")
        _, anchor = self(embed_weight[roots][:, None], starts[:, None].long(), context, with_anchor=True)
        return ModeSubset.best(self.mode_log_prior(anchor), count)

    def block_hidden(self, roots: torch.Tensor, starts: torch.Tensor, context, embed_weight: torch.Tensor, *,
                     single_mode: bool = False,
                     modes: ModeSubset | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final hidden states [bs, K', D, H], the mode log-prior [bs, K'] or None: `mode_log_prior`) of
        the blocks `[root, MASK...]` at positions starts.. over the context (DraftContext or paged), with the
        target's embeddings. modes: draft only each request's modes of the subset, weighed by its log-prior."""
        block, mode_ids = self.cfg.block_size, None if modes is None else modes.ids
        if self.backend == "triton":  # the block input in one launch
            from mfd_sglang.kernels.draft_block_input import block_input

            x, normed, positions = block_input(roots, starts, embed_weight,
                                               self.block_modes(single_mode, mode_ids, embed_weight.dtype),
                                               self.cfg.mask_token_id, self.layers[0].input_layernorm,
                                               self.cfg.rms_norm_eps, block)
            hidden, anchor = self.run_layers(x, normed, positions, block, context, with_anchor=True)
        else:
            tokens = torch.full((roots.shape[0], block), self.cfg.mask_token_id, device=roots.device)
            tokens[:, 0] = roots
            positions = starts[:, None].long() + torch.arange(block, device=roots.device)
            hidden, anchor = self(embed_weight[tokens], positions, context, single_mode=single_mode,
                                  mode_ids=mode_ids, with_anchor=True)
        return hidden, self.mode_log_prior(anchor) if modes is None else modes.log_prior

    def block_logprobs(self, roots: torch.Tensor, starts: torch.Tensor, context, embed_weight: torch.Tensor,
                       lm_head_weight: torch.Tensor, *, single_mode: bool = False,
                       modes: ModeSubset | None = None) -> torch.Tensor:
        """Log-probs [bs, K', D, Vd] of the blocks (the full distributions: the reference engine, evaluation),
        the mode log-prior folded in (`weigh_modes`): what the tree reads."""
        hidden, log_prior = self.block_hidden(roots, starts, context, embed_weight, single_mode=single_mode,
                                              modes=modes)
        return weigh_modes(self.logprobs(hidden, lm_head_weight), log_prior)

    def block_candidates(self, roots: torch.Tensor, starts: torch.Tensor, context, embed_weight: torch.Tensor,
                         head_weight: torch.Tensor, count: int, *, single_mode: bool = False,
                         modes: ModeSubset | None = None, chunk_size: int = VOCAB_CHUNK,
                         backend: str = "torch") -> DraftCandidates:
        """The `count` best draft tokens of every (mode, position) of the blocks and their
        log-probabilities (what a tree of budget `count` reads), over the vocabulary in chunks of
        `chunk_size`: no [bs, K', D, Vd] tensor is made; the mode log-prior folded in (`weigh_modes`), as in
        `block_logprobs`. head_weight: `self.head_weight(lm_head)`; backend: `vocab_candidates`'s ("torch"
        or "triton")."""
        hidden, log_prior = self.block_hidden(roots, starts, context, embed_weight, single_mode=single_mode,
                                              modes=modes)
        return weigh_modes(vocab_candidates(hidden, head_weight, count, chunk_size, backend=backend), log_prior)

    def head_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The rows of the target's lm_head the drafter scores: the draft vocabulary's (a copy), or all."""
        return lm_head_weight if self.draft_vocab is None else lm_head_weight[self.draft_vocab]

    def logprobs(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the draft vocabulary (or the full one) [..., Vd], in fp32."""
        return torch.log_softmax((hidden @ self.head_weight(lm_head_weight).T).float(), dim=-1)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_vocab is None else self.draft_vocab[draft_ids]

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Inverse of to_target_ids: each target id's index in the (sorted) draft vocabulary, -1 if absent."""
        if self.draft_vocab is None:
            return target_ids
        index = torch.searchsorted(self.draft_vocab, target_ids).clamp(max=self.draft_vocab.numel() - 1)
        return torch.where(self.draft_vocab[index] == target_ids, index, -1)


def _name_map(cfg: DrafterConfig) -> dict[str, str]:
    """checkpoint tensor name -> module parameter name, for names that differ."""
    names = {"hidden_norm.weight": "hidden_norm", "norm.weight": "norm"}
    for i in range(cfg.num_hidden_layers):
        for src, dst in [
            ("self_attn.q_norm.weight", "q_norm"), ("self_attn.k_norm.weight", "k_norm"),
            ("input_layernorm.weight", "input_layernorm"),
            ("post_attention_layernorm.weight", "post_attention_layernorm"),
        ]:
            names[f"layers.{i}.{src}"] = f"layers.{i}.{dst}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            for kind in ("weight", "bias"):
                names[f"layers.{i}.self_attn.{proj}.{kind}"] = f"layers.{i}.{proj}.{kind}"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[f"layers.{i}.mlp.{proj}.weight"] = f"layers.{i}.{proj}.weight"
    return names


def _to_module_names(weights: dict[str, torch.Tensor], cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    names = _name_map(cfg)
    out = {names.get(n, n): t for n, t in weights.items()}
    out.setdefault("mode_embed", torch.zeros(1, cfg.hidden_size, dtype=weights["fc.weight"].dtype))
    return out
