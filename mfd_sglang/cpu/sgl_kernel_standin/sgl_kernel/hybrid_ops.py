"""``torch.ops.sgl_kernel.*_cpu`` ops SGLang 0.5.23 binds on CPU for hybrid Gated DeltaNet models
(Qwen3.5 / Qwen3.6: ``models/qwen3_5.py``; ``layers/attention/linear/gdn_backend.py``,
``kernels/gdn_triton.py``), registered in plain torch.

SGLang reads these through ``torch.ops.sgl_kernel`` (not ``import sgl_kernel``), so they are real
torch library ops. Registering them does not route anything onto the Intel AMX kernels: SGLang
probes AMX through ``convert_weight_packed`` alone (``utils/common.py``), which stays unregistered.

Twins on GPUs: ``fused_qkvzba_split_reshape_cat_contiguous`` (``kernels/ops/attention/
triton_gdn_fused_proj.py``), ``fused_gdn_gating`` and ``fused_sigmoid_gating_delta_rule_update``
(``kernels/ops/attention/linear/``), SGLang's ``GemmaRMSNorm`` for the fused q/k norms. Arithmetic
in float32, results in the input dtype.

``fused_sigmoid_gating_delta_rule_update_cpu`` also takes the target-verify arguments of its Triton
twin (``disable_state_update``, ``intermediate_states_buffer`` [slots, steps, HV, V, K],
``intermediate_state_indices``, ``cache_steps``, ``retrieve_parent_token`` [bs, steps]): with parents,
step j > 0 starts from the state cached after its parent's step, as the Triton kernel does for EAGLE
trees.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .mamba import gated_delta_rule
from .model_ops import _rms_normalized


def fused_sigmoid_mul_cpu(x: torch.Tensor, gate: torch.Tensor) -> None:
    """x *= sigmoid(gate) in place; x [T, heads * dim], gate any view of the same T x heads x dim."""
    x.copy_((x.float() * torch.sigmoid(gate.reshape(x.shape).float())).to(x.dtype))


def fused_qk_gemma_rmsnorm_cpu(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                               eps: float, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head Gemma RMSNorm (weight + 1) of q and k, each as rows of head_dim."""
    q_rows, k_rows = q.reshape(-1, head_dim), k.reshape(-1, head_dim)
    return (_rms_normalized(q_rows.float(), q_weight, eps, 1.0).to(q.dtype),
            _rms_normalized(k_rows.float(), k_weight, eps, 1.0).to(k.dtype))


def fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                                         k_weight: torch.Tensor, eps: float, head_dim: int,
                                         num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_gate [T, num_heads * 2 * head_dim] holds per head [q | gate]: the normed q and k (as rows of
    head_dim) and the gate [T, num_heads * head_dim] as it is."""
    per_head = q_gate.reshape(q_gate.shape[0], num_heads, 2 * head_dim)
    q, gate = per_head[..., :head_dim], per_head[..., head_dim:]
    q_normed, k_normed = fused_qk_gemma_rmsnorm_cpu(q, k, q_weight, k_weight, eps, head_dim)
    return q_normed, k_normed, gate.reshape(q_gate.shape[0], -1).clone(memory_format=torch.contiguous_format)


def fused_qkvzba_split_reshape_cat_contiguous_cpu(mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor,
                                                  num_heads_qk: int, num_heads_v: int, head_qk: int,
                                                  head_v: int):
    """[q | k | v | z] and [b | a] (Qwen3.5's contiguous projection layout) -> (qkv [T, q + k + v],
    z [T, HV, V], b [T, HV], a [T, HV]), each contiguous."""
    qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    rows = mixed_qkvz.shape[0]
    z = mixed_qkvz[:, qkv_dim:qkv_dim + num_heads_v * head_v].reshape(rows, num_heads_v, head_v)
    # Copies (never views of the inputs: a torch library op's outputs may not alias them).
    return tuple(t.clone(memory_format=torch.contiguous_format) for t in (
        mixed_qkvz[:, :qkv_dim], z, mixed_ba[:, :num_heads_v], mixed_ba[:, num_heads_v:2 * num_heads_v]))


def _gates(A_log, a, dt_bias, b, softplus_beta: float = 1.0, softplus_threshold: float = 20.0):
    """(g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)), float32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=softplus_beta,
                                           threshold=softplus_threshold)
    return g, torch.sigmoid(b.float())


def fused_gdn_gating_cpu(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, HV] -> (g [1, T, HV] float32, beta [1, T, HV] in b's dtype)."""
    g, beta = _gates(A_log, a, dt_bias, b)
    return g[None], beta.to(b.dtype)[None]


def fused_sigmoid_gating_delta_rule_update_cpu(
        A_log: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        a: torch.Tensor, b: torch.Tensor, initial_state_source: torch.Tensor, initial_state_indices: torch.Tensor,
        cu_seqlens: torch.Tensor, use_qk_l2norm_in_kernel: bool, softplus_beta: float = 1.0,
        softplus_threshold: float = 20.0, is_kda: bool = False, disable_state_update: bool = False,
        intermediate_states_buffer: Optional[torch.Tensor] = None,
        intermediate_state_indices: Optional[torch.Tensor] = None, cache_steps: Optional[int] = None,
        retrieve_parent_token: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Recurrent gated delta rule with the gates fused in: q, k [1, T, H, K], v [1, T, HV, V], a, b
    [T, HV], packed over requests by cu_seqlens. Request r starts from
    initial_state_source[initial_state_indices[r]] (zeros for index < 0) and, unless
    disable_state_update, leaves its final state there. Returns [1, T, HV, V]."""
    if is_kda:
        raise NotImplementedError("sgl_kernel stand-in: fused_sigmoid_gating_delta_rule_update_cpu for KDA")
    heads = v.shape[-2]
    g, beta = _gates(A_log, a.reshape(-1, heads), dt_bias, b.reshape(-1, heads), softplus_beta, softplus_threshold)
    out = gated_delta_rule(q.reshape(-1, *q.shape[-2:]), k.reshape(-1, *k.shape[-2:]), v.reshape(-1, *v.shape[-2:]),
                           g, beta, initial_state_source, initial_state_indices, cu_seqlens,
                           l2norm=use_qk_l2norm_in_kernel, update_state=not disable_state_update,
                           scratch=intermediate_states_buffer, scratch_rows=intermediate_state_indices,
                           parents=retrieve_parent_token)
    return out.to(v.dtype).reshape(1, *out.shape)


SCHEMAS = {
    fused_sigmoid_mul_cpu: "(Tensor(a!) x, Tensor gate) -> ()",
    fused_qk_gemma_rmsnorm_cpu: ("(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim)"
                                 " -> (Tensor, Tensor)"),
    fused_qk_gemma_rmsnorm_with_gate_cpu: ("(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps, "
                                           "int head_dim, int num_heads) -> (Tensor, Tensor, Tensor)"),
    fused_qkvzba_split_reshape_cat_contiguous_cpu: ("(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, "
                                                    "int num_heads_v, int head_qk, int head_v) "
                                                    "-> (Tensor, Tensor, Tensor, Tensor)"),
    fused_gdn_gating_cpu: "(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)",
    fused_sigmoid_gating_delta_rule_update_cpu: (
        "(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, "
        "Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor cu_seqlens, "
        "bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, float softplus_threshold=20.0, "
        "bool is_kda=False, bool disable_state_update=False, Tensor(b!)? intermediate_states_buffer=None, "
        "Tensor? intermediate_state_indices=None, int? cache_steps=None, "
        "Tensor? retrieve_parent_token=None) -> Tensor"),
}

_library: Optional[torch.library.Library] = None


def register() -> None:
    """Define torch.ops.sgl_kernel.<name> for every op above (once per process; names a real
    sgl-kernel build already defines are left to it)."""
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for fn, schema in SCHEMAS.items():
        if hasattr(torch.ops.sgl_kernel, fn.__name__):
            continue
        _library.define(fn.__name__ + schema)
        _library.impl(fn.__name__, fn, "CompositeExplicitAutograd")
