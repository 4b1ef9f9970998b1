"""A verify window captured as CUDA graphs and replayed: the `graphs` section of the self-check.

The window is what a round builds after the draft, on the backend the server's round runs: the mixture tree of
budget B from the drafter's candidates, its verify layout (`tree_to_verify_layout`) and the accepted path under
the target's tokens (`accept_path`). It is captured with the server's own machinery (`cuda_graph.BatchGraphs`:
one CUDA graph per batch-size bucket, smaller batches padded up to the next bucket) for each drafting path of
the pair (K modes: MFD; one: MFD_D's single-mode path) and replayed at batch sizes that hit a bucket and ones
padded into a larger one, in an order that would show stale rows of a larger batch; each replay must equal the
same window run eagerly on the unpadded batch, every field bit for bit, and must accept real paths (the target
follows each tree's first children). Needs CUDA: on a CPU the section is a structural skip.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

from mfd_sglang.acceptance import accept_path
from mfd_sglang.cuda_graph import BatchGraphs, default_buckets
from mfd_sglang.tree import DraftCandidates, build_mixture_tree, top_candidates
from mfd_sglang.tree_layout import tree_to_verify_layout

from .run import StructuralSkip, measured_row

# Batch sizes replayed, in order: exact buckets and padded ones, a large batch before smaller ones.
REPLAYED = (1, 8, 3, 5, 2, 7, 4, 6)


def verify_window(candidate_logprobs, candidate_tokens, roots, seq_lens, target, *, key):
    """(tree, layout, accept result) of one round's window; key: (backend, budget, vocab)."""
    backend, budget, vocab = key
    tree = build_mixture_tree(DraftCandidates(candidate_logprobs, candidate_tokens, vocab), budget, backend=backend)
    layout = tree_to_verify_layout(tree, roots, seq_lens, backend=backend)
    return tree, layout, accept_path(tree, target, backend=backend)


def window_inputs(bs: int, modes: int, depth: int, vocab: int, budget: int, seed: int, backend: str, device: str):
    """Random candidates of bs requests and the target tokens that follow each tree's first children."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logprobs = torch.log_softmax(3.0 * torch.randn(bs, modes, depth, vocab, device=device, generator=gen), dim=-1)
    candidates = top_candidates(logprobs, budget)
    roots = torch.randint(0, vocab, (bs,), device=device, generator=gen)
    seq_lens = torch.randint(1, 4000, (bs,), device=device, generator=gen)
    tree = build_mixture_tree(candidates, budget, backend=backend)
    layout = tree_to_verify_layout(tree, roots, seq_lens, backend=backend)
    target = layout.draft_token.gather(1, layout.retrive_next_token.clamp(min=0))
    return [candidates.logprobs, candidates.tokens, roots, seq_lens, target]


def same_outputs(a, b) -> bool:
    return all(torch.equal(getattr(x, f.name), getattr(y, f.name))
               for x, y in zip(a, b) for f in dataclasses.fields(x))


def graph_rows(device: str, backend: str, paths: dict[str, int], depth: int, vocab: int, budget: int,
               max_bs: int = 8) -> Iterator[dict]:
    """One row per (drafting path, replayed batch size); paths: name -> modes drafted."""
    if not device.startswith("cuda"):
        raise StructuralSkip("needs CUDA: CUDA graphs need a GPU (the kernels section runs the same window's "
                             "kernels against torch here)")
    count = min(budget, vocab)
    for name, modes in paths.items():
        key = (backend, budget, vocab)

        def pads(bs: int, modes=modes):
            return [torch.zeros(bs, modes, depth, count, device=device),
                    torch.zeros(bs, modes, depth, count, dtype=torch.int64, device=device),
                    *(torch.zeros(bs, dtype=torch.int64, device=device) for _ in range(2)),
                    torch.zeros(bs, budget + 1, dtype=torch.int64, device=device)]

        graphs = BatchGraphs(verify_window, pads, default_buckets(max_bs), use_graph=True)
        captured = measured_row({"path": name, "K": modes, "B": budget, "backend": backend, "capture": "buckets "
                                 + " ".join(map(str, graphs.buckets))},
                                lambda row: (graphs.capture_all(keys=[key]), row.update(ok=True)))
        yield captured
        if not captured["ok"]:
            continue
        for bs in REPLAYED:
            def compare(row, bs=bs, modes=modes):
                inputs = window_inputs(bs, modes, depth, vocab, budget, seed=bs, backend=backend, device=device)
                replayed = graphs(*inputs, key=key)
                eager = verify_window(*inputs, key=key)
                row["accept_len_max"] = int(eager[2].accept_lens.max())
                row["ok"] = same_outputs(eager, replayed) and row["accept_len_max"] > 1

            yield measured_row({"path": name, "K": modes, "B": budget, "bs": bs,
                                "bucket": graphs.bucket(bs)}, compare)
