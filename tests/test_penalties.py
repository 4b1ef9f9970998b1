"""Penalties, min_new_tokens and logit_bias at every tree node (`mfd_sglang.serving.penalties`), held to
SGLang's own penalizers: for each node, a fresh SGLang orchestrator that is fed the request's committed
output plus the node's path token by token (its own `cumulate_output_tokens`) and applied to the row
(additive, then scaling, as SGLang's overlap path does), then the request's logit_bias."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mfd_sglang.serving.penalties import adjust_tree_logits, cumulate, output_penalties, path_token_counts
from mfd_sglang.tree import DraftTree
from mfd_sglang.tree_layout import local_parents, tree_ancestor_mask

VOCAB = 40
EOS = 3
# Per request: frequency, presence, repetition, min_new_tokens, stop token ids, logit_bias (or None)
REQUESTS = [
    dict(frequency_penalty=0.7, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0, stop=set(), bias=None),
    dict(frequency_penalty=0.0, presence_penalty=-0.4, repetition_penalty=1.6, min_new_tokens=6, stop={7}, bias=None),
    dict(frequency_penalty=0.3, presence_penalty=0.5, repetition_penalty=1.0, min_new_tokens=2, stop=set(),
         bias={5: 2.5, 9: -1.0}),
    dict(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0, stop=set(), bias=None),
]


class _Batch:
    """A ScheduleBatch stand-in with what SGLang's penalizers read (weak-referenceable, as they need)."""

    def __init__(self, reqs):
        self.reqs, self.device = reqs, "cpu"


def sglang_batch(requests: list[dict]) -> _Batch:
    tokenizer = SimpleNamespace(additional_stop_token_ids=None, eos_token_id=EOS)
    reqs = [SimpleNamespace(
        sampling_params=SimpleNamespace(frequency_penalty=r["frequency_penalty"], presence_penalty=r["presence_penalty"],
                                        repetition_penalty=r["repetition_penalty"], min_new_tokens=r["min_new_tokens"],
                                        stop_token_ids=r["stop"]),
        eos_token_ids=None, tokenizer=tokenizer) for r in requests]
    return _Batch(reqs)


def sglang_orchestrator(batch):
    from sglang.srt.sampling import penaltylib

    return penaltylib.BatchedPenalizerOrchestrator(vocab_size=VOCAB, batch=batch, penalizers={
        penaltylib.BatchedFrequencyPenalizer, penaltylib.BatchedMinNewTokensPenalizer,
        penaltylib.BatchedPresencePenalizer, penaltylib.BatchedRepetitionPenalizer})


def logit_bias(requests: list[dict]) -> torch.Tensor | None:
    if all(r["bias"] is None for r in requests):
        return None
    bias = torch.zeros(len(requests), VOCAB)
    for b, r in enumerate(requests):
        for token, value in (r["bias"] or {}).items():
            bias[b, token] = value
    return bias


def plain_row(request: dict, output: list[int], logits: torch.Tensor) -> torch.Tensor:
    """SGLang's adjustment of one row after `output` (its penalizers, fed token by token)."""
    batch = sglang_batch([request])
    orchestrator = sglang_orchestrator(batch)
    for token in output:
        orchestrator.cumulate_output_tokens(torch.tensor([token]))
    row = logits.clone()[None]
    if orchestrator.is_required:
        orchestrator.apply(row, repeat=1)
    bias = logit_bias([request])
    if bias is not None:
        row += bias
    return row[0]


def random_tree(bs: int, budget: int, generator: torch.Generator) -> DraftTree:
    """Random trees whose tokens repeat often (a small alphabet), so paths hit penalised tokens."""
    parents = torch.full((bs, budget), -1, dtype=torch.long)
    depths = torch.ones(bs, budget, dtype=torch.long)
    for b in range(bs):
        for i in range(1, budget):
            p = int(torch.randint(-1, i, (1,), generator=generator))
            parents[b, i] = p
            depths[b, i] = 1 if p < 0 else depths[b, p] + 1
    tokens = torch.randint(0, 12, (bs, budget), generator=generator)
    zeros = torch.zeros(bs, budget)
    return DraftTree(tokens, parents, depths, zeros, zeros.long(), torch.ones(bs, budget, dtype=torch.bool))


def path_tokens(tree: DraftTree, b: int, local: int) -> list[int]:
    parents = local_parents(tree)[b].tolist()
    path = []
    while local > 0:
        path.append(int(tree.tokens[b, local - 1]))
        local = parents[local]
    return path[::-1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_node_gets_the_plain_servers_adjustment_after_its_path(seed):
    generator = torch.Generator().manual_seed(seed)
    bs, budget = len(REQUESTS), 9
    histories = [torch.randint(0, 12, (n,), generator=generator).tolist() for n in (0, 3, 5, 1)]
    roots = torch.randint(0, 12, (bs,), generator=generator)
    tree = random_tree(bs, budget, generator)
    logits = torch.randn(bs, budget + 1, VOCAB, generator=generator) * 3

    # Our state: SGLang's tensors after the committed history, then the root counted by `cumulate`.
    batch = sglang_batch(REQUESTS)
    orchestrator = sglang_orchestrator(batch)
    width = max(map(len, histories))
    info = SimpleNamespace(penalizer_orchestrator=orchestrator, logit_bias=logit_bias(REQUESTS))
    state = output_penalties(info)
    padded = torch.tensor([h + [-1] * (width - len(h)) for h in histories])
    cumulate(state, padded, torch.tensor([len(h) for h in histories]))
    cumulate(state, roots[:, None], torch.ones(bs, dtype=torch.long))
    tokens = torch.cat([roots[:, None], tree.tokens], dim=1)
    depths = torch.cat([torch.zeros(bs, 1, dtype=torch.long), tree.depths], dim=1)
    ours = adjust_tree_logits(logits.clone(), state, depths, path_token_counts(tokens, tree_ancestor_mask(tree), VOCAB))

    for b, request in enumerate(REQUESTS):
        for local in range(budget + 1):
            output = histories[b] + [int(roots[b])] + path_tokens(tree, b, local)
            expected = plain_row(request, output, logits[b, local])
            torch.testing.assert_close(ours[b, local], expected, rtol=1e-6, atol=1e-5,
                                       msg=f"request {b}, node {local}, output {output}")


def test_cumulate_counts_like_sglangs_token_by_token_feed():
    generator = torch.Generator().manual_seed(5)
    bs = len(REQUESTS)
    rounds = [(torch.randint(0, 12, (bs, 6), generator=generator), torch.randint(0, 7, (bs,), generator=generator))
              for _ in range(3)]
    ours = sglang_orchestrator(batch_ours := sglang_batch(REQUESTS))
    state = output_penalties(SimpleNamespace(penalizer_orchestrator=ours, logit_bias=None))
    for tokens, lengths in rounds:
        cumulate(state, torch.where(torch.arange(6) < lengths[:, None], tokens, -1), lengths)

    for b, request in enumerate(REQUESTS):
        reference = sglang_orchestrator(batch_ref := sglang_batch([request]))
        for tokens, lengths in rounds:
            for token in tokens[b, : int(lengths[b])].tolist():
                reference.cumulate_output_tokens(torch.tensor([token]))
        for cls, ours_p in ours.penalizers.items():
            ref_p = reference.penalizers[cls]
            assert ours_p.is_prepared() == ref_p.is_prepared() or not ref_p.is_prepared()
            if not ref_p.is_prepared():
                continue
            for name, value in vars(ref_p).items():
                if isinstance(value, torch.Tensor):
                    torch.testing.assert_close(getattr(ours_p, name)[b : b + 1], value, msg=f"{cls.__name__}.{name}")
    assert batch_ours is not None and batch_ref is not None  # the orchestrators hold weak references


def test_a_batch_without_penalties_or_bias_has_no_state():
    orchestrator = sglang_orchestrator(batch := sglang_batch([REQUESTS[3], REQUESTS[3]]))
    assert output_penalties(SimpleNamespace(penalizer_orchestrator=orchestrator, logit_bias=None)) is None
    assert batch is not None
