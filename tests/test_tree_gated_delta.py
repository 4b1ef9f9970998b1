"""The tree-structured Gated DeltaNet reference (`mfd_sglang.tree_gated_delta`) against Hugging Face's
own sequential implementations run on every root-to-node path: each node's output and state must be
what plain decoding of its path gives (the independent reference is transformers' Qwen3-Next code)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (causal_conv1d_update,
                                                                 torch_recurrent_gated_delta_rule)

from mfd_sglang.tree_gated_delta import tree_causal_conv1d, tree_gated_delta_rule

REPO = Path(__file__).resolve().parents[1]


def random_parents(bs: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Random trees: token 0 follows the committed state, token j > 0 hangs under a random earlier
    token (or, now and then, under the committed state too: several roots are allowed)."""
    parents = torch.full((bs, n), -1, dtype=torch.int64)
    for j in range(1, n):
        parents[:, j] = torch.randint(-1, j, (bs,), generator=gen)
    return parents


def random_gdn_inputs(seed: int, bs: int, n: int, heads: int, dk: int, dv: int):
    """(q, k, v, g, beta, initial state, the generator) for a window of n tokens: log decays <= 0 and
    beta in [0, 1), as the layer makes them."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(bs, n, heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(bs, n, heads, dv, generator=gen)
    g, beta = -torch.rand(bs, n, heads, generator=gen), torch.rand(bs, n, heads, generator=gen)
    return q, k, v, g, beta, torch.randn(bs, heads, dk, dv, generator=gen), gen


def path_of(parents: torch.Tensor, b: int, j: int) -> list[int]:
    path = []
    while j >= 0:
        path.append(j)
        j = int(parents[b, j])
    return path[::-1]


@pytest.mark.parametrize("l2norm", [False, True])
def test_each_node_equals_the_sequential_rule_on_its_path(l2norm):
    bs, n = 3, 17
    q, k, v, g, beta, initial, gen = random_gdn_inputs(0, bs, n, heads=4, dk=8, dv=6)
    parents = random_parents(bs, n, gen)
    out, states = tree_gated_delta_rule(q, k, v, g, beta, parents, initial, use_qk_l2norm=l2norm)
    assert any(int(parents[b, j]) != j - 1 for b in range(bs) for j in range(1, n))  # a tree, not a chain
    for b in range(bs):
        for j in range(n):
            path = path_of(parents, b, j)
            ref_out, ref_state = torch_recurrent_gated_delta_rule(
                q[b:b + 1, path], k[b:b + 1, path], v[b:b + 1, path], g[b:b + 1, path], beta[b:b + 1, path],
                initial_state=initial[b:b + 1].clone(), output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
            torch.testing.assert_close(out[b, j], ref_out[0, -1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(states[b, j], ref_state[0], rtol=1e-5, atol=1e-5)


def test_a_chain_is_the_sequence():
    """parents j - 1: the whole window is one sequence (what SGLang's chain verify computes)."""
    bs, n = 2, 9
    q, k, v, g, beta, initial, _ = random_gdn_inputs(1, bs, n, heads=2, dk=4, dv=4)
    chain = torch.arange(n).expand(bs, n) - 1
    out, states = tree_gated_delta_rule(q, k, v, g, beta, chain, initial)
    ref_out, ref_state = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial.clone(),
                                                          output_final_state=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[:, -1], ref_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_conv_of_each_node_equals_the_sequential_update_on_its_path(bias):
    gen = torch.Generator().manual_seed(2)
    bs, n, channels, width = 3, 13, 5, 4
    x = torch.randn(bs, n, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    b_ = torch.randn(channels, generator=gen) if bias else None
    conv_state = torch.randn(bs, channels, width - 1, generator=gen)
    parents = random_parents(bs, n, gen)
    out, states = tree_causal_conv1d(x, parents, conv_state, weight, b_, activation="silu")
    for b in range(bs):
        for j in range(n):
            path = path_of(parents, b, j)
            state = conv_state[b:b + 1].clone()
            ref = causal_conv1d_update(x[b:b + 1, path].transpose(1, 2), state, weight, b_, activation="silu")
            torch.testing.assert_close(out[b, j], ref[0, :, -1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(states[b, j], state[0], rtol=0, atol=0)  # the path's last inputs, exactly


def test_conv_refuses_an_unknown_activation():
    x = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="activation"):
        tree_causal_conv1d(x, torch.tensor([[-1, 0]]), torch.zeros(1, 3, 3), torch.zeros(3, 4), activation="gelu")


SGLANG_TREE_KERNEL = r"""
import sys, torch
import triton.language as tl
from sglang.kernels.ops.attention.fla import fused_recurrent
from sglang.kernels.ops.attention.fla.fused_recurrent import fused_recurrent_gated_delta_rule_update_fwd
# The module binds `exp = tl.exp` at import; the interpreter patches `tl` itself at launch, not aliases
# of its functions, so the alias is routed through `tl` here.
fused_recurrent.exp = lambda x: tl.exp(x)
from mfd_sglang.tree_gated_delta import tree_gated_delta_rule
sys.path.insert(0, "tests")
from test_tree_gated_delta import random_gdn_inputs

bs, n, heads, dk, dv = 2, 9, 2, 8, 8
q, k, v, g, beta, initial, gen = random_gdn_inputs(3, bs, n, heads, dk, dv)
# A verify window: token 0 (the root) follows the committed state, every other token hangs under an
# earlier one of the window.
parents = torch.full((bs, n), -1, dtype=torch.int64)
for j in range(1, n):
    parents[:, j] = torch.randint(0, j, (bs,), generator=gen)
assert (parents[:, 2:] != torch.arange(1, n - 1)).any()  # a tree, not a chain
out, states = tree_gated_delta_rule(q, k, v, g, beta, parents, initial)

pool = initial.transpose(-1, -2).contiguous()  # SGLang keeps each head's state as [dv, dk]
cache = torch.zeros(bs, n, heads, dv, dk)
got = fused_recurrent_gated_delta_rule_update_fwd(
    q, k, v, g, beta, dk ** -0.5, pool, torch.arange(bs), disable_state_update=True,
    intermediate_states_buffer=cache, intermediate_state_indices=torch.arange(bs), cache_steps=n,
    retrieve_parent_token=parents.clamp(min=0).to(torch.int32))
torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(cache.transpose(-1, -2), states, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(pool, initial.transpose(-1, -2))  # the committed state is left alone
print("SAME")
"""


def test_sglangs_tree_verify_kernel_follows_the_parents():
    """SGLang's GDN verify kernel (`fused_recurrent_gated_delta_rule_update_fwd` with
    retrieve_parent_token, what its hybrid backend runs for EAGLE trees), under the Triton
    interpreter: given a verify window's parent pointers it computes the same outputs and per-token
    states as the tree reference, and leaves the committed state untouched. This is the kernel an
    exact MFD tree verify on a hybrid target would feed with the mixture tree's parents."""
    proc = subprocess.run([sys.executable, "-c", SGLANG_TREE_KERNEL], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=REPO)
    assert proc.returncode == 0 and "SAME" in proc.stdout, proc.stderr[-3000:]
