"""The stand-in's Gated DeltaNet ops (what SGLang's hybrid backend calls on CPU) against the tree reference
`mfd_sglang.tree_gated_delta` (itself held to Hugging Face's sequential code on every root-to-node path,
tests/test_tree_gated_delta.py): the verify ops on random trees given as EAGLE links (first child / next
sibling, as MFD's verify layout gives them), the prefill and decode ops on sequences (a chain)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from mfd_sglang.cpu import STANDIN_DIR
from mfd_sglang.tree_gated_delta import tree_causal_conv1d, tree_gated_delta_rule

sys.path.insert(0, str(STANDIN_DIR))
from sgl_kernel.mamba import (causal_conv1d_fn_cpu, causal_conv1d_update_cpu, chunk_gated_delta_rule_cpu,  # noqa: E402
                              tree_parents)


def random_tree(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parents [n] with -1 at the root, first child [n], next sibling [n]) of a random tree whose
    nodes are numbered parents first, children in order (the verify layout's numbering)."""
    parents = torch.tensor([-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)])
    first_child, next_sibling = torch.full((n,), -1), torch.full((n,), -1)
    for j in range(1, n):
        siblings = [i for i in range(1, j) if parents[i] == parents[j]]
        if siblings:
            next_sibling[siblings[-1]] = j
        else:
            first_child[parents[j]] = j
    return parents, first_child, next_sibling


def random_trees(bs: int, n: int, gen: torch.Generator):
    trees = [random_tree(n, gen) for _ in range(bs)]
    return tuple(torch.stack([t[i] for t in trees]) for i in range(3))


def test_tree_parents_follow_the_links():
    gen = torch.Generator().manual_seed(0)
    parents, child, sibling = random_trees(6, 12, gen)
    assert torch.equal(tree_parents(child, sibling), parents.clamp(min=0))


@pytest.mark.parametrize("seed", [0, 1])
def test_verify_conv_matches_the_tree_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    bs, n, dim, width = 3, 9, 5, 4
    parents, child, sibling = random_trees(bs, n, gen)
    x = torch.randn(bs, dim, n, generator=gen)
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    pool = torch.randn(7, dim, width - 1, generator=gen)
    slots = torch.tensor([5, 0, 3])
    windows = torch.zeros(bs + 1, n, dim, width - 1)
    before = pool.clone()
    filled = torch.full((bs, n), -7, dtype=torch.int32)
    out = causal_conv1d_update_cpu(x, pool, weight, bias, "silu", conv_state_indices=slots,
                                   intermediate_conv_window=windows, intermediate_state_indices=torch.arange(bs),
                                   retrieve_next_token=child, retrieve_next_sibling=sibling,
                                   retrieve_parent_token=filled)
    want, states = tree_causal_conv1d(x.transpose(1, 2), parents, pool[slots], weight, bias, "silu")
    torch.testing.assert_close(out.transpose(1, 2), want)
    torch.testing.assert_close(windows[:bs], states)
    assert torch.equal(filled, parents.clamp(min=0).to(torch.int32))
    assert torch.equal(pool, before), "a verify must leave the conv state to the commit"


@pytest.mark.parametrize("grouped", [False, True])
def test_verify_recurrence_matches_the_tree_reference(grouped):
    gen = torch.Generator().manual_seed(3)
    bs, n, dk, dv = 3, 9, 8, 6
    heads_v, heads_qk = 4, 2 if grouped else 4
    parents, child, sibling = random_trees(bs, n, gen)
    q, k = (torch.randn(1, bs * n, heads_qk, dk, generator=gen) for _ in range(2))
    v = torch.randn(1, bs * n, heads_v, dv, generator=gen)
    a, b = (torch.randn(bs * n, heads_v, generator=gen) for _ in range(2))
    A_log, dt_bias = torch.randn(heads_v, generator=gen), torch.randn(heads_v, generator=gen)
    pool = torch.randn(6, heads_v, dv, dk, generator=gen)  # [slots, HV, V, K], SGLang's layout
    slots = torch.tensor([4, 1, 2])
    scratch = torch.zeros(bs + 1, n, heads_v, dv, dk)
    before = pool.clone()
    out = torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=pool,
        initial_state_indices=slots, cu_seqlens=torch.arange(0, bs * n + 1, n), use_qk_l2norm_in_kernel=True,
        disable_state_update=True, intermediate_states_buffer=scratch,
        intermediate_state_indices=torch.arange(bs), cache_steps=n, retrieve_parent_token=parents.clamp(min=0))
    # The layer's gates, as Qwen3.5 computes them; grouped q / k heads serve heads_v // heads_qk v heads.
    g = (-A_log.exp() * F.softplus(a + dt_bias)).view(bs, n, heads_v)
    beta = torch.sigmoid(b).view(bs, n, heads_v)
    expand = heads_v // heads_qk
    want, states = tree_gated_delta_rule(q.view(bs, n, heads_qk, dk).repeat_interleave(expand, dim=2),
                                         k.view(bs, n, heads_qk, dk).repeat_interleave(expand, dim=2),
                                         v.view(bs, n, heads_v, dv), g, beta, parents,
                                         pool[slots].transpose(-1, -2), use_qk_l2norm=True)
    torch.testing.assert_close(out.view(bs, n, heads_v, dv), want)
    torch.testing.assert_close(scratch[:bs], states.transpose(-1, -2))
    assert torch.equal(pool, before), "disable_state_update leaves the pool as it was"


def chain(n: int) -> torch.Tensor:
    return (torch.arange(n) - 1)[None]


def test_prefill_and_decode_conv_continue_the_sequence():
    """Two requests prefilled in one packed batch (one from its cached conv state, one from zeros), then
    one decode token each: every output and the conv states are those of the whole sequences."""
    gen = torch.Generator().manual_seed(5)
    dim, width, lens = 6, 4, [5, 3]
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    pool = torch.randn(4, dim, width - 1, generator=gen)
    slots, cached = torch.tensor([2, 0]), torch.tensor([True, False])
    x = torch.randn(dim, sum(lens), generator=gen)
    nxt = torch.randn(2, dim, generator=gen)
    initial = [pool[2].clone(), torch.zeros(dim, width - 1)]
    out = causal_conv1d_fn_cpu(x, weight, bias, "silu", conv_states=pool, has_initial_state=cached,
                               cache_indices=slots, query_start_loc=torch.tensor([0, 5, 8]))
    step = causal_conv1d_update_cpu(nxt, pool, weight, bias, "silu", conv_state_indices=slots)
    for r, (lo, hi) in enumerate([(0, 5), (5, 8)]):
        seq = torch.cat([x[:, lo:hi], nxt[r, :, None]], dim=1).T[None]  # [1, n + 1, dim]
        want, states = tree_causal_conv1d(seq, chain(seq.shape[1]), initial[r][None], weight, bias, "silu")
        torch.testing.assert_close(out[:, lo:hi], want[0, :-1].T)
        torch.testing.assert_close(step[r], want[0, -1])
        torch.testing.assert_close(pool[slots[r]], states[0, -1])


def test_prefill_and_decode_recurrence_continue_the_sequence():
    """The chunked rule over two packed requests, then one fused-gate decode step each: outputs and the
    pooled states ([HV, V, K]) are the sequential rule's over the whole sequences."""
    gen = torch.Generator().manual_seed(6)
    heads_qk, heads_v, dk, dv, lens = 2, 4, 8, 6, [6, 4]
    total = sum(lens)
    q, k = (torch.randn(1, total + 2, heads_qk, dk, generator=gen) for _ in range(2))
    v = torch.randn(1, total + 2, heads_v, dv, generator=gen)
    a, b = (torch.randn(total + 2, heads_v, generator=gen) for _ in range(2))
    A_log, dt_bias = torch.randn(heads_v, generator=gen), torch.randn(heads_v, generator=gen)
    g = (-A_log.exp() * F.softplus(a + dt_bias))
    beta = torch.sigmoid(b)
    pool = torch.randn(5, heads_v, dv, dk, generator=gen)
    slots = torch.tensor([3, 1])
    initial = pool[slots].clone()
    out, _, _ = chunk_gated_delta_rule_cpu(q[:, :total], k[:, :total], v[:, :total], g[None, :total],
                                           beta[None, :total], initial_state=pool,
                                           cu_seqlens=torch.tensor([0, 6, total]), use_qk_l2norm_in_kernel=True,
                                           initial_state_indices=slots)
    step = torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=A_log, dt_bias=dt_bias, q=q[:, total:], k=k[:, total:], v=v[:, total:], a=a[total:], b=b[total:],
        initial_state_source=pool, initial_state_indices=slots, cu_seqlens=torch.arange(3),
        use_qk_l2norm_in_kernel=True)
    expand = heads_v // heads_qk
    for r, (lo, hi) in enumerate([(0, 6), (6, total)]):
        rows = list(range(lo, hi)) + [total + r]
        want, states = tree_gated_delta_rule(q[0, rows][None].repeat_interleave(expand, dim=2),
                                             k[0, rows][None].repeat_interleave(expand, dim=2), v[0, rows][None],
                                             g[rows][None], beta[rows][None], chain(len(rows)),
                                             initial[r].transpose(-1, -2)[None], use_qk_l2norm=True)
        torch.testing.assert_close(out[0, lo:hi], want[0, :-1])
        torch.testing.assert_close(step[0, r], want[0, -1])
        torch.testing.assert_close(pool[slots[r]], states[0, -1].transpose(-1, -2))
