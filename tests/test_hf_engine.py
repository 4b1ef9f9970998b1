"""The reference engine is lossless: exactly the target's own decoding, whatever the drafter does."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

from conftest import target_greedy
from mfd_sglang.checkpoint import load_drafter
from mfd_sglang.drafter import MFDDrafter, context_features
from mfd_sglang.hf import SamplingParams, SpeculativeGenerator, load_target
from references import assert_follows

MAX_NEW = 40


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_target(tiny_pair / "target")


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    return AutoTokenizer.from_pretrained(tiny_pair / "target")


def drafter_from(path) -> MFDDrafter:
    return MFDDrafter.from_checkpoint(load_drafter(path))


def random_drafter(path, seed: int) -> MFDDrafter:
    drafter = drafter_from(path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return drafter


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_greedy_is_exact_and_covers_every_acceptance_case(tiny_pair, tiny_dflash_drafter, tiny_prompts, target, tokenizer):
    prompts = tiny_prompts + ["hello there , what comes next ?"]
    drafters = {4: drafter_from(tiny_pair / "drafter"), 1: drafter_from(tiny_dflash_drafter)}
    block = drafters[4].cfg.block_size
    rounds = []
    for text in prompts:
        ids = encode(tokenizer, text)
        expected = target_greedy(target, ids, MAX_NEW)
        for k, drafter in drafters.items():
            for budget in (1, 4, 16, 64):
                out = SpeculativeGenerator(target, drafter, budget=budget).generate(ids, MAX_NEW)
                assert out.token_ids == expected, (text, k, budget)
                rounds += out.rounds
    # The cases above must really have exercised every way a tree can be accepted.
    accepted = [r.accepted for r in rounds]
    assert 0 in accepted, "no round with zero acceptance"
    assert max(accepted) >= 2, "no accepted path longer than one token"
    assert block - 1 in accepted, "no round accepting the whole block (plus the bonus)"
    assert any(rank > 0 for r in rounds for rank in r.accepted_sibling_ranks), "no acceptance through a non-first sibling"
    assert any(mode != 0 for r in rounds for mode in r.accepted_modes), "no acceptance through a mode other than the first"
    assert sum(r.emitted for r in rounds) / len(rounds) >= 2.0


def test_random_drafter_is_still_exact(tiny_pair, tiny_prompts, target, tokenizer):
    drafter = random_drafter(tiny_pair / "drafter", seed=1)
    ids = encode(tokenizer, tiny_prompts[0])
    out = SpeculativeGenerator(target, drafter, budget=16).generate(ids, 24)
    assert out.token_ids == target_greedy(target, ids, 24)


@pytest.mark.parametrize("tree,single_mode", [("chain", False), ("mixture", True)])
def test_chain_and_single_mode_paths_are_exact(tiny_pair, tiny_prompts, target, tokenizer, tree, single_mode):
    drafter = drafter_from(tiny_pair / "drafter")
    for text in tiny_prompts[:3]:
        ids = encode(tokenizer, text)
        out = SpeculativeGenerator(target, drafter, budget=16, tree=tree, single_mode=single_mode).generate(ids, MAX_NEW)
        assert out.token_ids == target_greedy(target, ids, MAX_NEW)
        assert all(mode == 0 for r in out.rounds for mode in r.accepted_modes)


def test_eos_inside_an_accepted_path_and_max_tokens_inside_a_round(tiny_pair, tiny_prompts, target, tokenizer):
    drafter = drafter_from(tiny_pair / "drafter")
    engine = SpeculativeGenerator(target, drafter, budget=16)
    ids = encode(tokenizer, tiny_prompts[0])
    full = target_greedy(target, ids, MAX_NEW)
    # Find an (eos, max_new_tokens) pair that cuts a round in the middle of its accepted path.
    cut_by_eos = cut_by_length = False
    for eos_token in dict.fromkeys(full[4:]):
        expected = target_greedy(target, ids, MAX_NEW, eos={eos_token})
        out = engine.generate(ids, MAX_NEW, eos_token_ids={eos_token})
        assert out.token_ids == expected and out.finish_reason == "eos"
        last = out.rounds[-1]
        cut_by_eos |= last.emitted < last.accepted + 1
    for max_new in range(2, 20):
        out = engine.generate(ids, max_new)
        assert out.token_ids == full[:max_new] and out.finish_reason == "length"
        last = out.rounds[-1]
        cut_by_length |= last.emitted < last.accepted + 1
    assert cut_by_eos, "no EOS fell inside an accepted path"
    assert cut_by_length, "max_new_tokens never fell inside a round"


def test_commit_leaves_caches_equal_to_a_fresh_forward(tiny_pair, tiny_prompts, target, tokenizer):
    """After some rounds the target KV and the drafter context equal those of one forward over the sequence."""
    drafter = drafter_from(tiny_pair / "drafter")
    engine = SpeculativeGenerator(target, drafter, budget=16)
    ids = encode(tokenizer, tiny_prompts[3])
    params = SamplingParams()
    state = engine.prefill([ids], params)
    sequence = ids + state.roots.tolist()
    for _ in range(4):
        tree = engine.build_tree(engine.draft(state))
        result, out = engine.verify(state, tree)
        emitted = [t for t in result.accepted_tokens[0].tolist() if t >= 0]
        engine.commit(state, result, out, torch.tensor([len(emitted)]))
        state.roots = torch.tensor([emitted[-1]])
        sequence += emitted
    committed = torch.tensor([sequence[:-1]])
    assert state.lengths.tolist() == [committed.shape[1]]
    with torch.inference_mode():
        fresh = target(committed, use_cache=True, output_hidden_states=True)
        features = context_features(fresh.hidden_states, drafter.cfg.target_layer_ids)
        context = drafter.context_kv(features, torch.arange(committed.shape[1])[None])
    for mine, ref in zip(state.cache.layers, fresh.past_key_values.layers):
        torch.testing.assert_close(mine.keys, ref.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.values, ref.values, atol=1e-4, rtol=1e-4)
    for mine, ref in zip(state.context.keys + state.context.values, context.keys + context.values):
        torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(state.context.positions, context.positions) and bool(state.context.valid.all())


def test_a_batch_of_different_lengths_equals_each_request_alone(tiny_pair, tiny_prompts, target, tokenizer):
    drafter = drafter_from(tiny_pair / "drafter")
    prompts = [encode(tokenizer, t) for t in tiny_prompts] + [encode(tokenizer, "hello , what next ?")]
    eos = {tokenizer.convert_tokens_to_ids("sunday")}
    for budget in (4, 16):
        engine = SpeculativeGenerator(target, drafter, budget=budget)
        outs = engine.generate_batch(prompts, MAX_NEW, eos_token_ids=eos)
        for ids, out in zip(prompts, outs):
            assert out.token_ids == target_greedy(target, ids, MAX_NEW, eos=eos)
    assert {o.finish_reason for o in outs} == {"eos", "length"}
    assert max(len(o.rounds) for o in outs) > min(len(o.rounds) for o in outs)


def test_a_sampled_batch_stays_in_the_top_k_support(tiny_pair, tiny_prompts, target, tokenizer):
    drafter = drafter_from(tiny_pair / "drafter")
    prompts = [encode(tokenizer, t) for t in tiny_prompts[:3]]
    outs = SpeculativeGenerator(target, drafter, budget=8).generate_batch(
        prompts, 12, params=SamplingParams(temperature=1.0, top_k=2, seed=5))
    for ids, out in zip(prompts, outs):
        sequence = ids + out.token_ids
        with torch.inference_mode():
            logits = target(torch.tensor([sequence])).logits[0]
        for pos in range(len(ids), len(sequence)):
            assert sequence[pos] in logits[pos - 1].topk(2).indices.tolist()


def test_sampling_matches_the_target_distribution(tiny_pair, target, tokenizer):
    """T > 0: the joint law of the first three sampled tokens equals the target's (chi-square, alpha 0.001)."""
    drafter = drafter_from(tiny_pair / "drafter")
    engine = SpeculativeGenerator(target, drafter, budget=16)
    ids = encode(tokenizer, "one two three")
    temperature, top_k, runs = 1.5, 3, 500

    def filtered(prefix: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = target(torch.tensor([ids + prefix])).logits[0, -1] / temperature
        kth = logits.topk(top_k).values[-1]
        return torch.softmax(logits.masked_fill(logits < kth, -math.inf), -1)

    expected: dict[tuple, float] = {}
    p1 = filtered([])
    for a in p1.nonzero()[:, 0].tolist():
        p2 = filtered([a])
        for b in p2.nonzero()[:, 0].tolist():
            p3 = filtered([a, b])
            for c in p3.nonzero()[:, 0].tolist():
                expected[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    counts: dict[tuple, int] = {}
    accepted = 0
    for seed in range(runs):
        out = engine.generate(ids, 3, params=SamplingParams(temperature, top_k, 1.0, seed))
        key = tuple(out.token_ids)
        assert key in expected, f"{key} is outside the target's top-{top_k} support"
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(r.accepted for r in out.rounds)
    assert accepted > runs // 4, "the tree was hardly ever accepted: the test would not prove anything"
    assert_follows(counts, expected, "the first three tokens")


def test_a_llama_target_is_served_exactly(tmp_path):
    """Any Transformers causal LM: a small random Llama (SmolLM2's architecture) with a random K = 2 drafter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mfd_sglang.checkpoint import parse_drafter_config

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    target = load_target(tmp_path / "llama")
    cfg = parse_drafter_config({
        "hidden_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 12, "intermediate_size": 96, "vocab_size": 96, "block_size": 6,
        "dflash_config": {"mask_token_id": 95, "target_layer_ids": [0, 2]}, "mfd_config": {"num_modes": 2},
    })
    drafter = MFDDrafter(cfg, context_features=2 * 48)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.2)
    prompts = [[5, 17, 33, 2, 8], [40, 41]]
    outs = SpeculativeGenerator(target, drafter.eval(), budget=8).generate_batch(prompts, 20)
    for ids, out in zip(prompts, outs):
        assert out.token_ids == target_greedy(target, ids, 20)
