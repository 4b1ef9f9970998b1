"""The round-cost benchmark's static target and round are exact: tree verify equals sequential
decoding, and speculative rounds (eager, over the same static buffers the CUDA graphs use) emit the
target's own greedy tokens. The commit stage is the SGLang worker's own (`commit_round`, used by
`MFDWorkerV2.commit_verified` and `SpecRound.commit`), held here to an explicit per-request loop."""

from __future__ import annotations

import torch

from mfd_sglang.acceptance import TreeVerifyResult
from mfd_sglang.round_cost import (CONFIGS, STAGES, SpecRound, StaticTarget, TargetConfig, capture_round,
                                   graphs_match_eager, random_drafter, round_cost_rows)
from mfd_sglang.serving.commit import commit_round
from mfd_sglang.serving.draft_context_pool import DraftContextPool
from mfd_sglang.tree import build_mixture_tree
from mfd_sglang.tree_layout import tree_ancestor_mask

CFG = TargetConfig.tiny()


def make_target(bs: int, max_len: int, seed: int = 0) -> StaticTarget:
    target = StaticTarget(CFG, "cpu", torch.float32, seed=seed)
    target.allocate(bs, max_len)
    return target


def prompts(bs: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CFG.vocab, (bs, length), generator=torch.Generator().manual_seed(seed))


def greedy(target: StaticTarget, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Plain greedy decoding with StaticTarget.decode: [bs, steps] tokens after the prompt."""
    logits, _ = target.prefill(prompt)
    tokens, lens = [logits.argmax(-1)], torch.full((prompt.shape[0],), prompt.shape[1])
    for _ in range(steps - 1):
        tokens.append(target.decode(tokens[-1], lens).argmax(-1))
        lens = lens + 1
    return torch.stack(tokens, dim=1)


def test_verify_logits_equal_sequential_decoding_along_each_path():
    bs, prompt_len, budget, depth = 2, 11, 12, 4
    target = make_target(bs, prompt_len + budget + 1)
    logits, _ = target.prefill(prompts(bs, prompt_len))
    snapshot = target.k_cache.clone(), target.v_cache.clone()
    # Rows of different lengths: row 1 keeps 10 of its prompt tokens as its committed prefix.
    cache_lens = torch.tensor([prompt_len, prompt_len - 1])
    logprobs = (4 * torch.randn(bs, 2, depth, CFG.vocab, generator=torch.Generator().manual_seed(2))).log_softmax(-1)
    tree = build_mixture_tree(logprobs, budget)
    assert tree.valid.all() and tree.depths.max() > 1
    tokens = torch.cat([logits.argmax(-1)[:, None], tree.tokens], dim=1)
    depths = torch.cat([torch.zeros_like(tree.depths[:, :1]), tree.depths], dim=1)
    ancestors = tree_ancestor_mask(tree)
    verify_logits, _ = target.verify(tokens, cache_lens[:, None] + depths, ancestors, cache_lens)
    for node in range(budget + 1):
        target.k_cache.copy_(snapshot[0])
        target.v_cache.copy_(snapshot[1])
        # The node's path (root first) in depth order, padded to the longer row's path.
        paths = [tokens[b][ancestors[b, node]][depths[b][ancestors[b, node]].argsort()] for b in range(bs)]
        steps = max(len(p) for p in paths)
        path_tokens = torch.stack([torch.cat([p, p.new_zeros(steps - len(p))]) for p in paths])
        decoded = [target.decode(path_tokens[:, t], cache_lens + t) for t in range(steps)]
        for b in range(bs):
            torch.testing.assert_close(verify_logits[b, node], decoded[len(paths[b]) - 1][b], rtol=1e-4, atol=1e-4)


def test_commit_round_commits_the_root_and_the_accepted_path_of_each_request():
    """commit_round against a loop over requests and committed tokens: the target-KV store is handed
    each request's root + accepted path in depth order (-1 after it), and the drafter context K/V of
    the j-th committed token (its node's features at position seq_len + j) lands in window slot j.
    The window (N = 11) is wider than a drafter path can be (block 8: root + 7 nodes)."""
    budget, block = 10, CFG.block_size
    drafter = random_drafter(CFG, [1, 3], 2, seed=4, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    # (accepted nodes in depth order, committed length before the round) per request
    paths, seq_lens = [[3, 7], [], [1, 2, 4, 5, 8, 9, 10]], torch.tensor([6, 0, 13])
    bs, num_nodes, num_slots = len(paths), budget + 1, 64
    local = torch.full((bs, budget + 1), -1)
    for b, p in enumerate(paths):
        local[b, : len(p)] = torch.tensor(p, dtype=torch.long)
    result = TreeVerifyResult(accept_lens=torch.tensor([len(p) + 1 for p in paths]), accepted_tokens=local.clone(),
                              accepted_local_indices=local, bonus_tokens=torch.zeros(bs, dtype=torch.long))
    hidden = torch.randn(bs, num_nodes, drafter.fc.in_features, generator=gen)
    window_slots = torch.randperm(num_slots, generator=gen)[: bs * num_nodes].view(bs, num_nodes)
    pool = DraftContextPool(drafter, num_slots, device="cpu", dtype=torch.float32)
    moved = []
    commit_round(result, hidden, seq_lens, window_slots, pool, drafter, moved.append)

    assert len(moved) == 1
    expected_path = torch.full((bs, block), -1)
    for b, p in enumerate(paths):
        expected_path[b, : len(p) + 1] = torch.tensor([0, *p])
    assert torch.equal(moved[0], expected_path)
    for b, p in enumerate(paths):
        for j, node in enumerate([0, *p]):
            want = drafter.context_kv(hidden[b, node][None, None], seq_lens[b].view(1, 1) + j)
            slot = int(window_slots[b, j])
            for layer in range(len(pool.keys)):
                torch.testing.assert_close(pool.keys[layer][slot], want.keys[layer][0, :, 0])
                torch.testing.assert_close(pool.values[layer][slot], want.values[layer][0, :, 0])
    # Nothing outside the windows' first `block` slots is touched (past a path is scratch).
    untouched = sorted(set(range(num_slots)) - set(window_slots[:, :block].flatten().tolist()))
    assert all(int(pool.keys[layer][untouched].count_nonzero()) == 0 for layer in range(len(pool.keys)))


def oracle_candidates(best: dict[int, float], count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A candidate row: the tokens of `best` first (by score), then the lowest other ids at -30."""
    ranked = sorted(best, key=lambda t: -best[t])
    rest = [t for t in range(CFG.vocab) if t not in best][: count - len(ranked)]
    return torch.tensor(ranked + rest), torch.tensor([best[t] for t in ranked] + [-30.0] * len(rest))


def test_speculative_rounds_emit_the_targets_greedy_tokens():
    """Eager rounds through capture_round. Mode 0's draft is replaced by the target's true
    continuation up to a cut depth, so paths of every length get accepted and committed."""
    bs, prompt_len, budget, rounds = 2, 9, 16, 8
    block = CFG.block_size
    target = make_target(bs, prompt_len + rounds * block + budget + 1)
    prompt = prompts(bs, prompt_len)
    expected = greedy(target, prompt, rounds * block + 1)

    drafter = random_drafter(CFG, target.feature_layers, 4, seed=5, device="cpu", dtype=torch.float32)
    spec = SpecRound(target, drafter, budget=budget, single_mode=False, backend="torch")
    roots, cache_lens = spec.prefill(prompt)
    graphs = capture_round(spec, roots, cache_lens, use_graph=False)
    emitted = [[int(r)] for r in roots]
    for step in range(rounds):
        graphs.replays["draft"]()
        cut = step % block  # accept `cut` true tokens via mode 0, then a wrong one
        candidates = graphs.candidates  # the drafted DraftCandidates, rewritten in place
        for b in range(bs):
            future = expected[b, len(emitted[b]): len(emitted[b]) + block - 1]
            wrong = (future + 1) % CFG.vocab
            oracle = torch.where(torch.arange(block - 1) < cut, future, wrong)
            for d in range(block - 1):
                best = {int(oracle[d]): 0.0}
                if d == 0:  # a better wrong first token heads a second chain that ranks first, so the
                    # accepted path sits deep in the verify window and commit really moves its K/V.
                    best = {(int(future[0]) + 2) % CFG.vocab: -0.5, int(oracle[0]): -1.0}
                tokens, scores = oracle_candidates(best, candidates.tokens.shape[-1])
                candidates.tokens[b, 0, d], candidates.logprobs[b, 0, d] = tokens, scores
        for stage in STAGES[1:]:
            graphs.replays[stage]()
        result = graphs.result
        for b in range(bs):
            emitted[b] += result.accepted_tokens[b, : result.accept_lens[b]].tolist()
            assert result.accept_lens[b] >= cut + 1
        roots.copy_(graphs.next_roots)
        cache_lens.copy_(graphs.next_lens)
    for b in range(bs):
        assert emitted[b] == expected[b, : len(emitted[b])].tolist()
        assert len(emitted[b]) == int(cache_lens[b]) - prompt_len + 1  # all but the root are committed

    # The drafter context written round by round equals one computed from a prefill of the same tokens.
    committed = int(cache_lens.min())
    tokens = torch.cat([prompt, torch.tensor([e[: committed - prompt_len] for e in emitted])], dim=1)
    _, features = target.prefill(tokens)
    fresh = spec.drafter.context_kv(features, target.slots[:committed].expand(bs, -1))
    slots = spec.req_to_token[:, :committed].long()
    for layer in range(len(spec.drafter.layers)):
        for pool, expected_kv in ((spec.context.keys, fresh.keys), (spec.context.values, fresh.values)):
            torch.testing.assert_close(pool[layer][slots].transpose(1, 2), expected_kv[layer], rtol=1e-4, atol=1e-4)


def test_round_cost_rows_report_every_config_and_batch_size():
    rows = list(round_cost_rows("cpu", quick=True, batch_sizes=(1, 2)))
    assert {(r["config"], r["bs"]) for r in rows} == {(c, bs) for c in CONFIGS for bs in (1, 2)}
    for r in rows:
        assert r["ar_step_ms"] > 0 and r["round_ms"] > 0 and r["round_cost"] > 0, r
        assert all(r[f"{s}_ms"] > 0 for s in STAGES), r
        assert r["K"] == (8 if r["config"] == "mfd" else 1) and r["B"] == 64
        assert r["ok"] is True


def test_graph_check_sees_every_stage_including_the_commits_writes():
    """`graphs_match_eager` (the GPU check's replay-vs-eager verdict) fails when a replayed stage differs
    from its eager run: a replayed commit that writes the drafter context or the target cache elsewhere,
    or a replayed round that emits other next roots, is caught (on a GPU the replays are CUDA graphs)."""
    bs = 2
    target = make_target(bs, 16 + 65 + 1)
    drafter = random_drafter(CFG, target.feature_layers, 2, seed=2, device="cpu", dtype=torch.float32)
    spec = SpecRound(target, drafter, budget=64, single_mode=False, backend="torch")
    roots, cache_lens = spec.prefill(prompts(bs, 16))

    def round_graphs():
        return capture_round(spec, roots, cache_lens, use_graph=False)

    assert graphs_match_eager(spec, round_graphs(), roots, cache_lens)
    for corrupt in (lambda: spec.context.keys[0].add_(1.0), lambda: target.v_cache.mul_(2.0)):
        graphs = round_graphs()
        commit = graphs.replays["commit"]
        graphs.replays["commit"] = lambda commit=commit, corrupt=corrupt: (commit(), corrupt())
        assert not graphs_match_eager(spec, graphs, roots, cache_lens)
    graphs = round_graphs()
    commit = graphs.replays["commit"]
    graphs.replays["commit"] = lambda: (commit(), graphs.next_roots.add_(1))
    assert not graphs_match_eager(spec, graphs, roots, cache_lens)
