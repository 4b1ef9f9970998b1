"""The mode gate: its checkpoint format and validation, `inspect`'s rule, the weighted draft every engine
reads (reference engine, evaluation replay and serving worker alike), and its training (the gate learns
the winning mode and leaves the body as a run without a gate trains it)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mfd_sglang.checkpoint import CheckpointError, load_drafter
from mfd_sglang.cli import describe_drafter
from mfd_sglang.cli import main
from mfd_sglang.drafter import DraftContext, MFDDrafter, ModeSubset, Rope, rms_norm
from mfd_sglang.hf import SamplingParams, SpeculativeGenerator, load_target, plain_greedy
from mfd_sglang.lab.evaluate import continue_prompt, prompt_outcomes, walk
from mfd_sglang.lab.train import TrainConfig, train
from mfd_sglang.tree import build_mixture_tree, weigh_modes
from references import HIDDEN, inputs, make_drafter
from test_checkpoint import (HIDDEN as CKPT_HIDDEN, assert_round_trip, dflash_weights, error_pattern, mfd_weights,
                             write, zlab_config)

K = 4


def with_gate(weights: dict, num_modes: int = K, seed: int = 3) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {**weights, "mode_prior.weight": torch.randn(num_modes, CKPT_HIDDEN, generator=gen),
            "mode_prior.bias": torch.randn(num_modes, generator=gen)}


# --- the checkpoint ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mfd_config", [{}, {"mode_prior": "gate"}])
def test_a_gate_loads_round_trips_and_inspect_names_the_rule(tmp_path, capsys, mfd_config):
    raw = zlab_config(mfd_config=mfd_config)
    weights = with_gate(mfd_weights(raw, num_modes=K))
    ckpt = load_drafter(write(tmp_path / "gated", raw, weights))
    assert ckpt.config.mode_prior == "gate"
    assert_round_trip(ckpt, {n: t for n, t in weights.items() if not n.startswith("mode_gate.")})
    assert main(["inspect", str(tmp_path / "gated"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tree_rule"].startswith("weighted: s(u) = max_k [log pi_k")


def test_without_a_gate_the_rule_is_uniform_and_the_release_gate_stays_ignored(tmp_path):
    raw = zlab_config()
    release = load_drafter(write(tmp_path / "release", raw, mfd_weights(raw, num_modes=K)))  # mode_gate.weight
    assert release.config.mode_prior == "uniform" and release.ignored == ("mode_gate.weight",)
    assert describe_drafter(release)["tree_rule"].startswith("uniform: s(u) = max_k sum_i")
    assert MFDDrafter.from_checkpoint(release).mode_prior is None
    dflash = load_drafter(write(tmp_path / "dflash", raw, dflash_weights(raw)))
    assert dflash.config.mode_prior == "uniform" and describe_drafter(dflash)["tree_rule"].startswith("DDTree")


def _tensor(name, value):
    def edit(raw, weights):
        weights[name] = value
    return edit


def _drop(name):
    def edit(raw, weights):
        del weights[name]
    return edit


def _rule(value, drop_gate=False):
    def edit(raw, weights):
        raw["mfd_config"] = {"mode_prior": value}
        if drop_gate:
            del weights["mode_prior.weight"], weights["mode_prior.bias"]
    return edit


def _one_mode(raw, weights):
    del weights["mode_embed"]
    weights["mode_prior.weight"], weights["mode_prior.bias"] = torch.zeros(1, CKPT_HIDDEN), torch.zeros(1)


BAD_GATES = {
    "weight of another hidden size": (_tensor("mode_prior.weight", torch.zeros(K, CKPT_HIDDEN + 1)),
                                      "mode_prior.weight shape", r"'torch\.float32 \(4, 33\)'", r"\[4, 32\]"),
    "weight for another K": (_tensor("mode_prior.weight", torch.zeros(K + 1, CKPT_HIDDEN)),
                             "mode_prior.weight shape", r"'torch\.float32 \(5, 32\)'", r"\[4, 32\]"),
    "integer bias": (_tensor("mode_prior.bias", torch.zeros(K, dtype=torch.int64)),
                     "mode_prior.bias shape", r"'torch\.int64 \(4,\)'", r"a floating \[4\] tensor"),
    "bias missing": (_drop("mode_prior.bias"), "mode_prior.bias", "None", r"a \[4\] tensor"),
    "weight missing": (_drop("mode_prior.weight"), "mode_prior.weight", "None", r"a \[4, 32\] tensor"),
    "gate asked for, none there": (_rule("gate", drop_gate=True), "mode_prior.weight", "None", r"a \[4, 32\] tensor"),
    "uniform asked for, gate there": (_rule("uniform"), "mode_prior.weight", r"'a \(4, 32\) tensor'",
                                      'none with mfd_config.mode_prior = "uniform"'),
    "unknown rule": (_rule("softmax"), "mfd_config.mode_prior", "'softmax'", '"uniform" or "gate"'),
    "gate on one mode": (_one_mode, "mode_prior.weight", "'a mode gate'", "none for a drafter with K = 1"),
}


@pytest.mark.parametrize("case", list(BAD_GATES), ids=list(BAD_GATES))
def test_a_malformed_gate_is_refused_at_load_naming_the_field(tmp_path, case):
    edit, field, found, expected = BAD_GATES[case]
    raw = zlab_config()
    weights = with_gate(mfd_weights(raw, num_modes=K))
    edit(raw, weights)
    with pytest.raises(CheckpointError, match=error_pattern(field, found, expected)):
        load_drafter(write(tmp_path / "d", raw, weights))


# --- the weighted draft -----------------------------------------------------------------------------

def gated_drafter(seed: int = 0) -> MFDDrafter:
    """`make_drafter` (3 modes) with a random gate."""
    return make_drafter(num_modes=3, seed=seed, mode_prior="gate")


def draft_inputs():
    features, ctx_pos, _, _ = inputs(3, 7)
    gen = torch.Generator().manual_seed(5)
    embed, head = torch.randn(50, HIDDEN, generator=gen), torch.randn(50, HIDDEN, generator=gen)
    return features, ctx_pos, torch.tensor([1, 8, 30]), torch.full((3,), 7), embed, head


def test_a_bias_only_gate_weighs_depth_one_by_its_softmax():
    drafter = gated_drafter()
    with torch.no_grad():
        drafter.mode_prior.weight.zero_()
        drafter.mode_prior.bias.copy_(torch.tensor([0.5, -1.0, 2.0]))
    plain = drafter.without_mode_gate()
    features, ctx_pos, roots, starts, embed, head = draft_inputs()
    context = drafter.context_kv(features, ctx_pos)
    got = drafter.block_logprobs(roots, starts, context, embed, head)
    want = plain.block_logprobs(roots, starts, context, embed, head)
    prior = torch.tensor([0.5, -1.0, 2.0]).log_softmax(-1)
    assert torch.equal(got[:, :, 1:], want[:, :, 1:])
    assert torch.equal(got[:, :, 0], want[:, :, 0] + prior[None, :, None])
    # The single-mode path has one mode: nothing to weigh.
    assert torch.equal(drafter.block_logprobs(roots, starts, context, embed, head, single_mode=True),
                       plain.block_logprobs(roots, starts, context, embed, head, single_mode=True))


def test_the_gate_reads_each_block_and_candidates_weigh_as_the_full_draft():
    drafter = gated_drafter(seed=1)
    features, ctx_pos, roots, starts, embed, head = draft_inputs()
    context = drafter.context_kv(features, ctx_pos)
    _, log_prior = drafter.block_hidden(roots, starts, context, embed)
    assert log_prior.shape == (3, 3) and torch.allclose(log_prior.exp().sum(-1), torch.ones(3))
    assert (log_prior[0] - log_prior[1]).abs().max() > 1e-3, "each request gets its own weights"
    full = drafter.block_logprobs(roots, starts, context, embed, head)
    unweighted = drafter.without_mode_gate().block_logprobs(roots, starts, context, embed, head)
    assert torch.equal(full, weigh_modes(unweighted, log_prior))
    for budget in (1, 6, 25, 200):
        candidates = drafter.block_candidates(roots, starts, context, embed, head, budget, chunk_size=7)
        want, got = build_mixture_tree(full, budget), build_mixture_tree(candidates, budget)
        for name in ("tokens", "parents", "depths", "modes", "valid"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (budget, name)
        torch.testing.assert_close(got.scores, want.scores, rtol=0, atol=1e-5)
    assert not torch.equal(build_mixture_tree(full, 25).scores, build_mixture_tree(unweighted, 25).scores)


def add_gate(drafter: MFDDrafter, seed: int = 7, scale: float = 1.0) -> MFDDrafter:
    """The drafter with a random gate (a strong one: weights that vary the prior between requests)."""
    gen = torch.Generator().manual_seed(seed)
    gate = torch.nn.Linear(drafter.cfg.hidden_size, drafter.cfg.num_modes)
    with torch.no_grad():
        gate.weight.copy_(scale * torch.randn(gate.weight.shape, generator=gen))
        gate.bias.copy_(torch.randn(gate.bias.shape, generator=gen))
    drafter.mode_prior = gate
    return drafter


@pytest.mark.parametrize("count", [None, 1, 2])
def test_the_serving_draft_stage_drafts_the_reference_engines_weighted_tree(tiny_pair, count):
    """The serving draft stage (paged context, vocabulary-chunked candidates) of a gated drafter gives the
    tree the reference engine builds over the same context from `block_logprobs` of every mode (count None:
    the gate changes it) or, for an arm of `count` modes (`Arm.modes`: the automatic budget's K' < K paths,
    MFD_SGLANG_NUM_MODES on a gated drafter), of each request's modes chosen by `gate_modes`, which differ
    between requests here."""
    from test_serving import DRAFT_STAGE_BUDGET, _draft_stage

    from mfd_sglang.serving.budget.rule import Arm

    stage, table = _draft_stage(tiny_pair, "cpu")
    budget = DRAFT_STAGE_BUDGET
    add_gate(stage.drafter)
    gen = torch.Generator().manual_seed(3)
    roots = torch.randint(0, stage.drafter.cfg.vocab_size, (6,), generator=gen)
    lens = torch.randint(5, table.shape[1] - 20, (6,), generator=gen)
    requests_ = torch.arange(6)
    tree, _ = stage.paged_tree(roots, lens, requests_, key=Arm(False, budget, count))
    context = stage.context_pool.gather(table[requests_].long(), lens)
    chosen = None if count is None else stage.drafter.gate_modes(roots, lens, context, stage.embed_weight, count)
    if chosen is not None:
        assert len({tuple(ids) for ids in chosen.ids.tolist()}) > 1, chosen.ids  # the choice is per request
    drafted = stage.drafter.block_logprobs(roots, lens, context, stage.embed_weight, stage.head_weight, modes=chosen)
    want = build_mixture_tree(drafted, budget)
    for name in ("tokens", "parents", "depths", "modes", "valid"):
        assert torch.equal(getattr(tree, name), getattr(want, name)), name
    torch.testing.assert_close(tree.scores, want.scores, rtol=0, atol=1e-4)
    if count is None:
        unweighted = stage.drafter.without_mode_gate().block_logprobs(roots, lens, context, stage.embed_weight,
                                                                      stage.head_weight)
        assert not torch.equal(build_mixture_tree(unweighted, budget).tokens, tree.tokens)


@pytest.fixture(scope="module")
def gated_tiny(tiny_pair):
    """(target, the tiny pair's MFD drafter with a random gate, its single-mode drafter)."""
    target = load_target(tiny_pair / "target")
    mfd = add_gate(MFDDrafter.from_checkpoint(load_drafter(tiny_pair / "drafter")), scale=0.3)
    single = MFDDrafter.from_checkpoint(load_drafter(tiny_pair / "drafter-dflash"))
    return target, mfd, single


def _prompt_ids(tiny_pair, n):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair / "target")
    texts = json.loads((tiny_pair / "prompts.json").read_text())[:n]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_the_reference_engine_with_a_gate_is_plain_decoding_and_the_replay_its_rounds(tiny_pair, gated_tiny):
    target, mfd, single = gated_tiny
    compared = 0
    for prompt in _prompt_ids(tiny_pair, 3):
        engine = SpeculativeGenerator(target, mfd, budget=6)
        out = engine.generate(prompt, 24, params=SamplingParams())
        assert out.token_ids == plain_greedy(target, prompt, 24)
        assert max(r.emitted for r in out.rounds) > 1, "speculation was seen"
        cont = continue_prompt(target, prompt, 24, set(), None, lookahead=7)
        outcomes = prompt_outcomes(target, single, mfd, cont, [6])
        replayed = walk(outcomes["mfd", "6"], cont)
        assert [(r.emitted, r.accepted_modes) for r in replayed] == \
            [(r.emitted, r.accepted_modes) for r in out.rounds]
        assert ("mfd_uniform", "6") in outcomes  # the same draft's unweighted tree, reported beside it
        compared += len(replayed)
    assert compared > 6


# --- fewer modes per request (issue 43 item 4) -------------------------------------------------------

def test_a_mode_subset_drafts_exactly_those_copies_of_the_k_mode_draft():
    drafter = gated_drafter(seed=2)
    features, ctx_pos, roots, starts, embed, head = draft_inputs()
    context = drafter.context_kv(features, ctx_pos)
    full, _ = drafter.block_hidden(roots, starts, context, embed)
    ids = torch.tensor([[2, 0], [1, 2], [0, 1]])  # per request, in any order
    log_prior = torch.randn(3, 2)
    subset, weights = drafter.block_hidden(roots, starts, context, embed, modes=ModeSubset(ids, log_prior))
    assert weights is log_prior
    torch.testing.assert_close(subset, full[torch.arange(3)[:, None], ids], rtol=0, atol=1e-5)
    logprobs = drafter.block_logprobs(roots, starts, context, embed, head, modes=ModeSubset(ids, log_prior))
    unweighted = drafter.without_mode_gate().block_logprobs(roots, starts, context, embed, head)
    torch.testing.assert_close(logprobs, weigh_modes(unweighted[torch.arange(3)[:, None], ids], log_prior),
                               rtol=1e-5, atol=1e-5)


def root_only_gate(drafter: MFDDrafter, root: torch.Tensor, start: torch.Tensor, context, embed) -> torch.Tensor:
    """log pi [K] of one request, by hand: each mode's copy of `[root]` run alone, anchors averaged."""
    anchors = []
    for k in range(drafter.cfg.num_modes):
        x = (embed[root] + drafter.mode_embed[k])[None, None]  # [1, 1, H]
        positions = start.view(1, 1)
        rope = Rope.at(positions, drafter.cfg, x.dtype)
        delta = None
        for layer, attend in zip(drafter.layers, root_only_attention(drafter, context, positions)):
            x, delta = layer(x, delta, rope, attend)
        anchors.append(rms_norm(x + delta, drafter.norm, drafter.cfg.rms_norm_eps)[0, 0])
    return torch.log_softmax(drafter.mode_prior(torch.stack(anchors).mean(0)), dim=-1)


def root_only_attention(drafter, context, positions):
    """Each layer's attention of a one-slot block over the request's valid context and the slot itself."""
    from functools import partial

    from mfd_sglang.drafter import dense_attention

    mask = torch.cat([context.valid, torch.ones(1, 1, dtype=torch.bool)], dim=1)[:, None, None]  # [1, 1, 1, Lc+1]
    return [partial(dense_attention, context.keys[i], context.values[i], mask)
            for i in range(drafter.cfg.num_hidden_layers)]


def test_gate_modes_takes_the_root_only_blocks_best_modes_with_ties_to_the_lower_index():
    drafter = gated_drafter(seed=4)
    features, ctx_pos, roots, starts, embed, head = draft_inputs()
    context = drafter.context_kv(features, ctx_pos)
    for count in (1, 2, 3):
        chosen = drafter.gate_modes(roots, starts, context, embed, count)
        for r in range(3):
            one = DraftContext([k[r:r + 1] for k in context.keys], [v[r:r + 1] for v in context.values],
                               context.positions[r:r + 1], context.valid[r:r + 1])
            want = root_only_gate(drafter, roots[r], starts[r], one, embed)
            assert chosen.ids[r].tolist() == want.argsort(descending=True)[:count].tolist(), (count, r)
            torch.testing.assert_close(chosen.log_prior[r], want[chosen.ids[r]], rtol=0, atol=1e-5)
    with torch.no_grad():
        drafter.mode_prior.weight.zero_()
        drafter.mode_prior.bias.zero_()
    assert drafter.gate_modes(roots, starts, context, embed, 2).ids.tolist() == [[0, 1]] * 3
    with pytest.raises(ValueError, match="count must be in 1..3"):
        drafter.gate_modes(roots, starts, context, embed, 4)
    with pytest.raises(ValueError, match="needs a drafter with a mode gate"):
        drafter.without_mode_gate().gate_modes(roots, starts, context, embed, 1)


def test_the_reference_engine_drafting_the_gates_best_modes_is_plain_decoding(tiny_pair, gated_tiny):
    target, mfd, _ = gated_tiny
    seen = {}
    for num_modes in (1, 2):
        engine = SpeculativeGenerator(target, mfd, budget=6, num_modes=num_modes)
        for prompt in _prompt_ids(tiny_pair, 2):
            out = engine.generate(prompt, 24, params=SamplingParams())
            assert out.token_ids == plain_greedy(target, prompt, 24)
            seen[num_modes] = max(seen.get(num_modes, 1), max(r.emitted for r in out.rounds))
    assert min(seen.values()) > 1, f"speculation was seen: longest round per K' {seen}"
    prompt = _prompt_ids(tiny_pair, 1)[0]
    every = SpeculativeGenerator(target, mfd, budget=6, num_modes=mfd.cfg.num_modes).generate(prompt, 24)
    plain = SpeculativeGenerator(target, mfd, budget=6).generate(prompt, 24)
    assert [(r.emitted, r.accepted_modes) for r in every.rounds] == [(r.emitted, r.accepted_modes) for r in plain.rounds]
    for bad in ({"num_modes": 0}, {"num_modes": mfd.cfg.num_modes + 1}, {"num_modes": 1, "single_mode": True}):
        with pytest.raises(ValueError, match="chooses 1..K"):
            SpeculativeGenerator(target, mfd, budget=6, **bad)
    with pytest.raises(ValueError, match="chooses 1..K"):
        SpeculativeGenerator(target, mfd.without_mode_gate(), budget=6, num_modes=1)


# --- training -----------------------------------------------------------------------------------------
# Seconds-sized: the multimodal universe's tokenizer and samples, an untrained target of width 16 and
# make-multimodal's seed drafter (one sliding layer, block 8), so no trained pair is built for them.

STEPS, GATE_STEPS = 6, 20
BLOCK = 8  # make-multimodal's seed drafter's


@pytest.fixture(scope="module")
def gate_run(tmp_path_factory):
    """A directory with target/, data.jsonl (16 universe samples) and seed/ (a single-mode drafter)."""
    import random

    from transformers import Qwen3ForCausalLM

    from mfd_sglang.lab import multimodal as mm

    root = tmp_path_factory.mktemp("gate-run")
    tokenizer = mm.build_tokenizer()
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(mm.target_config(tokenizer, hidden=16)).eval()
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    mm.write_training_data(root / "data.jsonl", mm.corpus(mm.universe_for(tokenizer), random.Random(0), 16))
    mm.write_seed_drafter(root / "seed", target, tokenizer, torch.Generator().manual_seed(0))
    return root


def gate_config(gate_run, out, **settings) -> TrainConfig:
    base = dict(target=str(gate_run / "target"), out=str(out), data=str(gate_run / "data.jsonl"), num_modes=K,
                init_from=str(gate_run / "seed"), steps=STEPS, batch_size=2, anchors=8, lr=3e-3, save_every=100)
    return TrainConfig(**{**base, **settings})


def train_log(out) -> list[dict]:
    return [json.loads(line) for line in (out / "train_state" / "log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def gate_runs(gate_run, tmp_path_factory):
    """{name: checkpoint dir}: plain (no gate), gated (the gate alongside the body), phased (then GATE_STEPS
    gate-only steps, through the CLI) and after (gate-only steps alone from `gated`, --steps 0)."""
    root = tmp_path_factory.mktemp("gate-runs")
    for name, settings in (("plain", {}), ("gated", {"mode_gate": True})):
        train(gate_config(gate_run, root / name, **settings), progress=False, log=lambda *a: None)
    common = ["train", "--target", str(gate_run / "target"), "--data", str(gate_run / "data.jsonl"), "--num-modes",
              str(K), "--batch-size", "2", "--anchors", "8", "--lr", "3e-3", "--mode-gate", "--gate-steps",
              str(GATE_STEPS), "--gate-lr", "0.05", "--quiet"]
    assert main(common + ["--out", str(root / "phased"), "--init-from", str(gate_run / "seed"),
                          "--steps", str(STEPS)]) == 0
    assert main(common + ["--out", str(root / "after"), "--init-from", str(root / "gated"), "--steps", "0"]) == 0
    return {name: root / name for name in ("plain", "gated", "phased", "after")}


def body(path) -> dict:
    return {n: t for n, t in load_drafter(path).weights.items() if not n.startswith("mode_prior.")}


def test_the_gate_learns_the_winning_mode_and_leaves_the_body_as_it_was(gate_run, gate_runs):
    """Trained alongside the body, the gate leaves the body as a gate-less run's and starts at uniform
    weights; trained on the finished modes (--gate-steps), its cross-entropy on fresh blocks' winners
    (recomputed here, `gate_fit`) is below the uniform law's log K by more than 0.4 (measured: 0.81 against
    1.39), which a gate trained on any other labels does not reach."""
    plain, gated = load_drafter(gate_runs["plain"]), load_drafter(gate_runs["gated"])
    assert gated.config.mode_prior == "gate" and plain.config.mode_prior == "uniform"
    assert set(gated.weights) == set(plain.weights) | {"mode_prior.weight", "mode_prior.bias"}
    for name, tensor in plain.weights.items():
        assert torch.equal(gated.weights[name], tensor), name
    log = train_log(gate_runs["gated"])
    # A zero gate starts at uniform weights (loss log K), then trains.
    assert log[0]["gate_loss"] == pytest.approx(math.log(K), abs=1e-5) and "gate_accuracy" in log[-1]
    assert gated.weights["mode_prior.weight"].abs().max() > 0 and MFDDrafter.from_checkpoint(gated).mode_prior is not None
    fitted, _ = gate_fit(gate_run, gate_runs["phased"])
    assert fitted < math.log(K) - 0.4, (fitted, math.log(K))


def test_the_gate_learns_each_blocks_winning_mode_and_its_gradient_stays_in_the_gate():
    """The gate's label is the block's winner, the mode whose chain covers the block's labels best
    (recomputed here from each block drafted alone, `block_logprobs`): fitted on a batch, its top mode
    is that winner in every block. Its loss adds nothing to the body's gradient."""
    from mfd_sglang.drafter import DraftContext
    from mfd_sglang.lab.train import block_loss
    from references import BLOCK, N_CTX, VOCAB

    drafter = gated_drafter(seed=2)  # a random gate: a gradient through it would reach the body
    plain = drafter.without_mode_gate()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB - 1, (2, 24), generator=gen)
    features = torch.randn(2, 24, N_CTX * HIDDEN, generator=gen)
    anchors = torch.tensor([[3, 6, 9, 12, 15], [2, 5, 8, 11, 17]])
    embed, head = torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen)

    def loss(model):
        return block_loss(model, embed, head, tokens, features, anchors, loss="dpace")

    out, ref = loss(drafter), loss(plain)
    out.loss.backward()
    ref.loss.backward()
    gate = set(drafter.mode_prior.parameters())
    body = [p for p in drafter.parameters() if p not in gate]
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(body, plain.parameters()))
    with torch.no_grad():  # a zero gate starts at uniform weights
        drafter.mode_prior.weight.zero_()
        drafter.mode_prior.bias.zero_()
    assert loss(drafter).gate_loss == pytest.approx(math.log(3), abs=1e-6)
    optimizer = torch.optim.Adam(drafter.mode_prior.parameters(), lr=0.2)
    for _ in range(40):
        optimizer.zero_grad()
        loss(drafter).loss.backward()
        optimizer.step()
    fitted = loss(drafter)
    assert fitted.gate_accuracy == 1.0 and fitted.gate_loss < 0.2
    positions = torch.arange(24)[None]
    winners = set()
    with torch.no_grad():
        for row, anchor in ((r, int(a)) for r in range(2) for a in anchors[r]):
            full = plain.context_kv(features[row:row + 1], positions)
            context = DraftContext(full.keys, full.values, positions, positions < anchor)
            roots, starts = tokens[row, anchor:anchor + 1], torch.tensor([anchor])
            lp = plain.block_logprobs(roots, starts, context, embed, head)[0]  # [K, D, V]
            labels = tokens[row, anchor + 1:anchor + BLOCK]
            q = lp.gather(-1, labels[None, :, None].expand(3, -1, 1))[..., 0].exp()
            winner = int(q.cumprod(-1).sum(-1).argmax())
            winners.add(winner)
            _, log_prior = drafter.block_hidden(roots, starts, context, embed)
            assert int(log_prior[0].argmax()) == winner, (row, anchor)
    assert len(winners) > 1, "the blocks have different winners: a bias alone would not fit them"




def gate_fit(gate_run, path, batches: int = 4) -> tuple[float, torch.Tensor]:
    """On fresh blocks of the training data: the gate's cross-entropy on each block's winner (recomputed here:
    the mode whose chain covers the block's labels best) and the winners' frequencies [K]."""
    from mfd_sglang.drafter import context_features
    from mfd_sglang.lab.train import load_sequences

    target = load_target(gate_run / "target")
    drafter = MFDDrafter.from_checkpoint(load_drafter(path))
    sequences = torch.tensor([ids for ids, _ in load_sequences(gate_run / "data.jsonl", 512)])
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    gen = torch.Generator().manual_seed(11)
    nll, wins = [], torch.zeros(K)
    with torch.no_grad():
        features = context_features(target(sequences, output_hidden_states=True).hidden_states,
                                    drafter.cfg.target_layer_ids)
        slots = torch.arange(sequences.shape[1])[None].expand(len(sequences), -1)
        for _ in range(batches):
            starts = torch.randint(1, sequences.shape[1] - BLOCK, (len(sequences),), generator=gen)
            context = drafter.context_kv(features, slots, slots < starts[:, None])
            roots = sequences[torch.arange(len(sequences)), starts]
            hidden, log_prior = drafter.block_hidden(roots, starts, context, embed)
            labels = torch.stack([sequences[i, s + 1:s + BLOCK] for i, s in enumerate(starts.tolist())])
            q = drafter.logprobs(hidden, head).gather(-1, labels[:, None, :, None].expand(-1, K, -1, 1))[..., 0].exp()
            winner = q.cumprod(-1).sum(-1).argmax(-1)
            nll.append(float(-log_prior.gather(-1, winner[:, None]).mean()))
            wins += torch.bincount(winner, minlength=K)
    return sum(nll) / len(nll), wins / wins.sum()


def test_gate_steps_train_only_the_gate_on_the_finished_modes(gate_run, gate_runs):
    """--gate-steps: after the body's steps, the gate alone (the body bit for bit a gate-less run's, or the
    --init-from drafter's with --steps 0) at --gate-lr, and it fits the finished modes' winners better than
    the gate trained alongside the body."""
    plain = body(gate_runs["plain"])
    for name, tensor in body(gate_runs["phased"]).items():
        assert torch.equal(tensor, plain[name]), name
    gated = body(gate_runs["gated"])
    for name, tensor in body(gate_runs["after"]).items():
        assert torch.equal(tensor, gated[name]), name
    log = train_log(gate_runs["phased"])
    assert len(log) == STEPS + GATE_STEPS and log[STEPS]["lr"] == 0.05 and "default_loss" not in log[STEPS]
    assert len(train_log(gate_runs["after"])) == GATE_STEPS
    alongside, frequencies = gate_fit(gate_run, gate_runs["gated"])  # measured: 1.36 (log K = 1.39)
    for name in ("phased", "after"):
        fitted, same = gate_fit(gate_run, gate_runs[name])  # measured: 0.81, 0.78
        assert torch.equal(same, frequencies), "the same body: the same winners"
        assert fitted < alongside - 0.3, (name, fitted, alongside)


def test_gate_steps_resume_bit_identically_and_a_run_saved_before_them_resumes(gate_run, gate_runs, tmp_path):
    out = tmp_path / "phased"
    cfg = gate_config(gate_run, out, mode_gate=True, gate_steps=GATE_STEPS, gate_lr=0.05)
    train(cfg, progress=False, stop_after=STEPS + 3, log=lambda *a: None)
    train(cfg, resume=True, progress=False, log=lambda *a: None)
    want = load_drafter(gate_runs["phased"]).weights
    assert all(torch.equal(t, want[n]) for n, t in load_drafter(out).weights.items())
    with pytest.raises(ValueError, match="gate_steps"):
        train(gate_config(gate_run, out, mode_gate=True, gate_steps=GATE_STEPS + 1, gate_lr=0.05), resume=True,
              progress=False, log=lambda *a: None)
    # A state saved before gate steps existed: its fingerprint names neither setting.
    old = tmp_path / "old"
    cfg = gate_config(gate_run, old, mode_gate=True)
    train(cfg, progress=False, stop_after=3, log=lambda *a: None)
    state = torch.load(old / "train_state" / "state.pt", weights_only=False)
    for name in ("gate_steps", "gate_lr"):
        state["fingerprint"]["settings"].pop(name, None)
    torch.save(state, old / "train_state" / "state.pt")
    train(cfg, resume=True, progress=False, log=lambda *a: None)
    want = load_drafter(gate_runs["gated"]).weights
    assert all(torch.equal(t, want[n]) for n, t in load_drafter(old).weights.items())


@pytest.mark.parametrize("settings, message", [
    ({"num_modes": 1, "mode_gate": True}, "--mode-gate weighs K >= 2 modes"),
    ({"gate_steps": 5}, "--gate-steps 5: needs --mode-gate"),
    ({"mode_gate": True, "gate_steps": -1}, "--gate-steps -1: needs --mode-gate and a count >= 0"),
], ids=["one mode", "no gate", "negative"])
def test_gate_settings_are_refused_before_anything_loads(tmp_path, settings, message):
    cfg = TrainConfig(target=str(tmp_path / "no-target"), out=str(tmp_path / "out"), data=str(tmp_path / "no-data"),
                      **{"num_modes": K, **settings})
    with pytest.raises(ValueError, match=message):
        train(cfg, progress=False, log=lambda *a: None)
