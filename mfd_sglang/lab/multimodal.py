"""`make-multimodal`: a universe where the next tokens follow one of M coherent futures, with a known answer.

The text: word tokens; position 0 is a header (`random` or `cued`), then a cycle of C = 11 tokens
repeats:

    <marker> F_j(1) .. F_j(7) and so now

After every marker one of M = 4 fixed futures of 7 tokens follows (alpha bravo charlie then ..,
one two three then .., red green blue then .., monday tuesday wednesday then ..). They share their
4th token ("then") and disagree at the other 6. Which future follows is decided in one of two ways:

  (a) random: the future is drawn with probabilities .4 / .3 / .2 / .1 (F0 .. F3). In `random`
      sequences every marker is `nocue`, and every future is drawn so. The TARGET itself is
      multimodal at T = 1; at T = 0 it always takes F0.
  (b) cued: in `cued` sequences every marker is a uniformly drawn `cue<j>`, and the marker 22 tokens
      (two cycles) before a future's own marker fixes it: `cue<j>` -> F_j. The target is
      deterministic given the context at any T (the first two futures of a sequence, with no marker
      22 tokens before theirs, are drawn as in (a)). At T = 1 the target draws the cue markers
      themselves; at T = 0 it writes the same cue (its argmax) every time.

What is multimodal for whom. Both drafters are DFlash drafters with ONE sliding-attention layer of
window 8 over the target's hidden states of every layer (block 8: root + 7 drafted tokens, so every
block slot still sees the root). A block whose drafted tokens reach into a future starts at most 6
tokens before that future's marker and sees context at most 7 tokens before its root: at most 13
before the marker, so the cue, 22 before it, is out of the drafter's reach by construction (tested:
changing the context there changes nothing). The target reads the cue at the marker itself, whose
hidden state a drafter only sees once the future's first token is verified; its hidden states at
the filler tokens in the window could still carry some of it, so `drafter_fork_knowledge` measures
what the single-mode drafter knows at cued forks (1 / M = blind, 1 = reads the cue). Hence:
  - T = 1: random and cued forks are multimodal for the target and the drafters alike (cued ones
    through the cue markers the target samples);
  - T = 0: random forks are deterministic for the target (F0) and nearly so for the drafters (F0 is
    every position's argmax); cued forks are deterministic for the target and a 4-way mixture for
    the drafters: there the drafter alone is multimodal.

The known answer is exact and cheap: `next_token_distribution` is the true conditional
distribution of the next token, `continuations` enumerates the next D tokens with their
probabilities, `covered_mass` is a tree's expected accepted draft tokens, `ideal_covered_mass` the
best B-node tree's (the ceiling), `splice_chimeras` / `chimera_bound` the paper's 2^(m-1) - 1 bound.

`make_multimodal` trains a 4-layer Qwen3 target on universe samples (its fit to the known answer is
reported), draws the drafters' data from the target at T = 1, and trains with the project's own
`train` a base single-mode drafter from random weights, then from that base, with the same data and
steps, the single-mode drafter (chain, DDTree) and the K-mode MFD drafter with its mode gate, as the
paper fine-tunes its D-PACE baseline and MFD alike; then the gate alone learns the finished modes'
winners (`train`'s gate_steps, the body frozen). The reference engine then runs chain / DDTree / MFD
(the gate's mode weights in the tree) / the same MFD drafter unweighted at every budget and T = 0, 1
on two kinds of rounds: whole generations, and fork rounds (the prompt ends just before a
marker, so the first round's drafted block is exactly one whole future). Beside the best tree (the
ceiling: it knows the universe, cue included), the blind ceiling is the best tree of the law the
drafters can know (`continuations(blind=True)`: a cued future uniform), on the same output.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from ..checkpoint import load_drafter, parse_drafter_config, save_drafter
from ..drafter import MFDDrafter, context_features
from .evaluate import RoundTally, chimera_count, node_paths
from ..hf import SamplingParams, SpeculativeGenerator, load_target
from .tiny import SPECIAL_TOKENS, word_level_tokenizer
from .train import TrainConfig, cosine_lr, new_drafter_config, optimizer_step, train
from ..tree import build_mixture_tree, weigh_modes

# --- the universe (pure Python, exact) ----------------------------------------------------------

HEADERS = ("random", "cued")
NO_CUE = "nocue"
FILLER = ("and", "so", "now")
FUTURES = (
    ("alpha", "bravo", "charlie", "then", "delta", "echo", "foxtrot"),
    ("one", "two", "three", "then", "four", "five", "six"),
    ("red", "green", "blue", "then", "cyan", "pink", "gray"),
    ("monday", "tuesday", "wednesday", "then", "thursday", "friday", "saturday"),
)
FUTURE_PROBS = (0.4, 0.3, 0.2, 0.1)
CUES = tuple(f"cue{j}" for j in range(len(FUTURES)))
FUTURE_LEN = len(FUTURES[0])
CYCLE = 1 + FUTURE_LEN + len(FILLER)  # a marker, a future, the filler
CUE_DISTANCE = 2 * CYCLE  # the future after marker i is cued by marker i - 2
BLOCK_SIZE = 8  # drafter block: root + 7 drafted tokens, one future's length
DRAFTER_WINDOW = 8  # the drafter's sliding window (>= BLOCK_SIZE: every block slot sees the root)

# A block that drafts a future token starts >= (BLOCK_SIZE - 2) before the future's marker and reaches
# DRAFTER_WINDOW - 1 tokens before its root: the cue must lie further back.
assert CUE_DISTANCE > (BLOCK_SIZE - 2) + (DRAFTER_WINDOW - 1)


def words() -> list[str]:
    """Every word of the universe (the tokenizer adds its special tokens before them)."""
    out = list(HEADERS) + [NO_CUE] + list(CUES) + list(FILLER)
    for future in FUTURES:
        out += [w for w in future if w not in out]
    return out


@dataclass(frozen=True)
class Universe:
    """The universe over token ids (`ids`: word -> id of the tokenizer that encodes it).

    Layout: position 0 the header; then cycles of CYCLE tokens from position 1: a marker (phase 0),
    a future (phases 1..7) and the filler (phases 8..10). Markers are `nocue` in "random" sequences
    and a uniform `cue<j>` in "cued" ones; the marker CUE_DISTANCE before a future's marker decides
    that future (`cue<j>`: F_j; `nocue` or none: drawn with FUTURE_PROBS).
    """
    ids: dict

    def __post_init__(self):
        ids = self.ids
        object.__setattr__(self, "header_ids", tuple(ids[w] for w in HEADERS))
        object.__setattr__(self, "cue_ids", tuple(ids[w] for w in CUES))
        object.__setattr__(self, "future_ids", tuple(tuple(ids[w] for w in f) for f in FUTURES))
        # The first token of a future names it (the futures differ there).
        object.__setattr__(self, "future_of_first", {f[0]: j for j, f in enumerate(self.future_ids)})

    # --- layout ---------------------------------------------------------------------------------
    @staticmethod
    def phase(position: int) -> int:
        """Phase of a position inside its cycle: 0 a marker, 1..7 the future's tokens, 8.. the filler;
        -1 the header."""
        return -1 if position == 0 else (position - 1) % CYCLE

    @staticmethod
    def marker_positions(length: int) -> list[int]:
        return list(range(1, length, CYCLE))

    def fork_kind(self, prefix: list[int], marker: int) -> str:
        """"cued" when the marker CUE_DISTANCE before this one is a cue, else "random"."""
        cue = marker - CUE_DISTANCE
        return "cued" if 1 <= cue < len(prefix) and prefix[cue] in self.cue_ids else "random"

    # --- the true process -----------------------------------------------------------------------
    def next_token_distribution(self, prefix: list[int]) -> list[tuple[int, float]]:
        """The universe's distribution of the token after `prefix` [(id, prob)], exactly; [] when
        the prefix is off the universe (a token no rule allows), so every continuation has mass 0."""
        pos = len(prefix)
        if pos == 0:
            return [(h, 1.0 / len(HEADERS)) for h in self.header_ids]
        ph = self.phase(pos)
        if ph == 0:
            if prefix[0] == self.ids["cued"]:
                return [(c, 1.0 / len(CUES)) for c in self.cue_ids]
            return [(self.ids[NO_CUE], 1.0)] if prefix[0] == self.ids["random"] else []
        if ph == 1:
            if self.fork_kind(prefix, pos - 1) == "cued":
                j = self.cue_ids.index(prefix[pos - 1 - CUE_DISTANCE])
                return [(self.future_ids[j][0], 1.0)]
            return [(f[0], p) for f, p in zip(self.future_ids, FUTURE_PROBS)]
        if ph > FUTURE_LEN:
            return [(self.ids[FILLER[ph - FUTURE_LEN - 1]], 1.0)]
        j = self.future_of_first.get(prefix[pos - ph + 1])
        return [] if j is None else [(self.future_ids[j][ph - 1], 1.0)]

    def first_off_universe(self, sequence: list[int]) -> int | None:
        """The first position whose token the universe gives probability 0 (None: all possible)."""
        for i in range(len(sequence)):
            if all(t != sequence[i] for t, _ in self.next_token_distribution(sequence[:i])):
                return i
        return None

    def sample(self, rng: random.Random, kind: str, length: int) -> list[int]:
        """One sequence of `length` tokens with header `kind` ("random" or "cued")."""
        seq = [self.ids[kind]]
        while len(seq) < length:
            tokens, probs = zip(*self.next_token_distribution(seq))
            seq.append(rng.choices(tokens, probs)[0])
        return seq

    def continuations(self, prefix: list[int], depth: int, *, blind: bool = False) -> dict[tuple, float]:
        """Every continuation of `depth` tokens after `prefix` with its probability (those > 0).

        blind: as a drafter that cannot see the cue knows it: a cued future is any of the M futures
        (uniform). Its support is every continuation the universe can produce from what such a
        drafter sees.
        """
        out: dict[tuple, float] = {}

        def walk(seq: list[int], prob: float) -> None:
            if len(seq) == len(prefix) + depth:
                path = tuple(seq[len(prefix):])
                out[path] = out.get(path, 0.0) + prob
                return
            dist = self.next_token_distribution(seq)
            if blind and self.phase(len(seq)) == 1 and len(dist) == 1:
                dist = [(f[0], 1.0 / len(FUTURES)) for f in self.future_ids]
            for token, p in dist:
                walk(seq + [token], prob * p)

        walk(list(prefix), 1.0)
        return out


def prefix_masses(continuations: dict[tuple, float]) -> dict[tuple, float]:
    """P(the next tokens start with u) for every prefix u (depth >= 1) of the continuations."""
    mass: dict[tuple, float] = defaultdict(float)
    for path, p in continuations.items():
        for d in range(1, len(path) + 1):
            mass[path[:d]] += p
    return dict(mass)


def covered_mass(masses: dict[tuple, float], paths: list[tuple]) -> float:
    """Expected accepted draft tokens of a tree whose node paths are `paths` (prefix-closed): under
    tree verification a node is accepted iff the target's continuation starts with its path."""
    return sum(masses.get(tuple(p), 0.0) for p in paths)


def ideal_covered_mass(masses: dict[tuple, float], budget: int) -> float:
    """The largest covered mass of any tree of `budget` nodes: the sum of the `budget` largest prefix
    masses. Those form a tree: a prefix's mass is at least its extension's, so taking ties toward
    ancestors keeps the set prefix-closed."""
    return sum(sorted(masses.values(), reverse=True)[:budget])


def splice_chimeras(paths: list[tuple], a: tuple, b: tuple) -> int:
    """Tree nodes at depth len(a) that splice futures a and b: every token from a or b at its depth,
    neither a nor b itself (the chimeras of the 2^(m-1) - 1 bound)."""
    depth = len(a)
    return sum(1 for p in paths if len(p) == depth and tuple(p) not in (a, b)
               and all(t in (x, y) for t, x, y in zip(p, a, b)))


def chimera_bound(a: tuple, b: tuple) -> int:
    """2^(m-1) - 1 for two futures that differ in m positions (0 when they are equal)."""
    m = sum(x != y for x, y in zip(a, b))
    return 2 ** (m - 1) - 1 if m else 0


# --- tokenizer and target -----------------------------------------------------------------------

SEQ_LEN = 1 + 10 * CYCLE  # training sequences: the header and 10 cycles
TARGET_LAYERS = 4


def build_tokenizer():
    """A word-level tokenizer over the universe's words (make-tiny's special tokens first)."""
    return word_level_tokenizer(SPECIAL_TOKENS + words())


def universe_for(tokenizer) -> Universe:
    return Universe({w: tokenizer.convert_tokens_to_ids(w) for w in words()})


def target_config(tokenizer, hidden: int = 64):

    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def corpus(universe: Universe, rng: random.Random, count: int, length: int = SEQ_LEN) -> list[list[int]]:
    """`count` universe samples, alternately random and cued."""
    return [universe.sample(rng, HEADERS[i % 2], length) for i in range(count)]


TARGET_LR = 1e-2  # with grad clipping: at make-tiny's 3e-3 the target stays ~0.6% unsure of every certain token
TARGET_BATCH = 32


def train_universe_target(tokenizer, universe: Universe, rng: random.Random, generator, *, steps: int,
                          sequences: int, log=print):
    """A Qwen3 target trained from scratch on `sequences` universe samples (next-token cross-entropy,
    AdamW, warmup + cosine, grad clip 1). Its T = 1 samples must stay on the universe: a token it
    should be sure of but is not makes a T = 1 sample leave the known answer."""
    data = torch.tensor(corpus(universe, rng, sequences))
    target = Qwen3ForCausalLM(target_config(tokenizer))
    optimizer = torch.optim.AdamW(target.parameters(), lr=TARGET_LR, weight_decay=0.0)
    target.train()
    for step in range(steps):
        rows = torch.randint(0, data.shape[0], (TARGET_BATCH,), generator=generator)
        loss = target(data[rows], labels=data[rows]).loss
        optimizer_step(optimizer, loss, cosine_lr(step, steps, TARGET_LR, max(steps // 10, 1)),
                       clip_params=target.parameters())
        if step % 50 == 0 or step == steps - 1:
            log(f"  target step {step:4d}/{steps}  loss {loss.item():.3f}")
    return target.eval()


def sample_target(target, prompts: list[list[int]], length: int, generator, temperature: float = 1.0) -> list[list[int]]:
    """The target's own samples: each prompt (all of one length) continued to `length` tokens at T."""
    ids = torch.tensor(prompts)
    out = ids
    cache = DynamicCache(config=target.config)
    with torch.inference_mode():
        while out.shape[1] < length:
            logits = target(ids, past_key_values=cache, use_cache=True).logits[:, -1].float()
            ids = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)
            out = torch.cat([out, ids], dim=1)
    return out.tolist()


def write_training_data(path, sequences: list[list[int]], prompt_len: int = 1) -> None:
    """The `train` data format: one record per sequence, the first `prompt_len` tokens as the prompt."""
    with open(path, "w") as fh:
        for i, seq in enumerate(sequences):
            fh.write(json.dumps({"id": f"multimodal/{i}", "set": "multimodal", "input_ids": seq[:prompt_len],
                                 "response_ids": seq[prompt_len:]}) + "\n")


def write_seed_drafter(path, target, tokenizer, generator) -> None:
    """A randomly initialised single-mode drafter with one sliding-attention layer (window
    DRAFTER_WINDOW), block BLOCK_SIZE, reading every target layer: `train --init-from` starts here,
    so the drafter has the sliding window that `train` alone would not give it."""
    raw = new_drafter_config(target.config, tokenizer, layers=1, block_size=BLOCK_SIZE)
    raw["layer_types"] = ["sliding_attention"]
    raw["sliding_window"] = DRAFTER_WINDOW
    raw["mfd_config"] = {"num_modes": 1, "default_mode": 0}
    cfg = parse_drafter_config(raw)
    drafter = MFDDrafter(cfg, context_features=len(cfg.target_layer_ids) * target.config.hidden_size)
    with torch.no_grad():  # as `train` initialises a drafter from scratch
        for name, p in drafter.named_parameters():
            if p.dim() == 2 and name != "mode_embed":
                p.normal_(0.0, 0.02, generator=generator)
    save_drafter(path, raw, drafter.checkpoint_weights())


# --- evaluation on the reference engine ---------------------------------------------------------

DRAFT_DEPTH = BLOCK_SIZE - 1


@dataclass
class Cell(RoundTally):
    """One method at one budget on one prompt set, temperature and kind of round."""
    mass: float = 0.0  # exact expected accepted draft tokens of the trees, summed over rounds (T = 1)
    ceiling_mass: float = 0.0  # the same for the best tree of the same budget at the same contexts
    oracle_tokens: int = 0  # the best tree's realised run on the same output
    oracle_rounds: int = 0
    blind_tokens: int = 0  # the same for the best tree of the cue-blind law
    blind_rounds: int = 0
    bound_checks: int = 0  # product trees holding two futures: chimeras counted against 2^(m-1) - 1
    bound_violations: int = 0
    off_universe: int = 0  # rounds whose context the universe cannot produce (a target error before)
    multimodal_rounds: int = 0  # rounds whose drafted block can hold more than one continuation (a fork in it)
    marker_rounds: int = 0  # rounds whose root is a marker: the fork is the block's first token

    def summary(self) -> dict:
        return {
            "tau": self.tau,
            "rounds": self.rounds,
            "chimera_share": self.chimera_share,
            "expected_accepted": self.per_round(self.mass),
            "ceiling_expected_accepted": self.per_round(self.ceiling_mass),
            "ceiling_tau": self.oracle_tokens / self.oracle_rounds if self.oracle_rounds else None,
            "blind_ceiling_tau": self.blind_tokens / self.blind_rounds if self.blind_rounds else None,
            "bound_checks": self.bound_checks,
            "bound_violations": self.bound_violations,
            "off_universe_rounds": self.off_universe,
            "multimodal_round_share": self.per_round(self.multimodal_rounds),
            "marker_root_share": self.per_round(self.marker_rounds),
            "effective_modes": self.effective_modes,
        }


def ideal_tree(masses: dict[tuple, float], budget: int) -> set[tuple]:
    """The best tree's node paths (ties toward ancestors, so it is prefix-closed)."""
    return set(sorted(masses, key=lambda u: (-masses[u], len(u)))[:budget])


def accepted_length(tree: set[tuple], actual: tuple) -> int:
    """Draft tokens tree verification accepts when the target continues with `actual`."""
    n = 0
    while n < len(actual) and actual[: n + 1] in tree:
        n += 1
    return n


def oracle_run(universe: Universe, seq: list[int], start: int, max_new: int, budget: int, temperature: float,
               first_round_only: bool, stop: int | None = None, *, blind: bool = False) -> tuple[int, int]:
    """(tokens, rounds) of the best tree of `budget` nodes on the output `seq` (root at `start`),
    rounds cut as the engine cuts them: at T = 1 the exact top-`budget` prefixes of the universe, at
    T = 0 the target's own continuation (a point mass), at most DRAFT_DEPTH deep; blind: at either T
    the top-`budget` prefixes of the cue-blind law (what a drafter that cannot see the cue can know).
    Rounds whose root sits at or after `stop` (the first token off the universe) are not run."""
    tokens = rounds = 0
    emitted, pos = 1, start  # the prefill emitted the root
    while emitted < max_new and (stop is None or pos < stop):
        actual = tuple(seq[pos + 1: pos + 1 + DRAFT_DEPTH])
        if temperature > 0 or blind:
            law = universe.continuations(seq[: pos + 1], DRAFT_DEPTH, blind=blind)
            tree = ideal_tree(prefix_masses(law), budget)
        else:
            tree = {actual[:d] for d in range(1, min(budget, DRAFT_DEPTH) + 1)}
        emit = min(accepted_length(tree, actual) + 1, max_new - emitted)
        tokens, rounds, emitted, pos = tokens + emit, rounds + 1, emitted + emit, pos + emit
        if first_round_only:
            break
    return tokens, rounds


def _pairs_in_tree(support: list[tuple], tree: set[tuple]):
    """For every two continuations of the support, their longest prefixes both in the tree (depth >= 2)."""
    for i, a in enumerate(support):
        for b in support[i + 1:]:
            d = min(len(a), len(b))
            while d >= 2 and not (a[:d] in tree and b[:d] in tree):
                d -= 1
            if d >= 2 and a[:d] != b[:d]:
                yield a[:d], b[:d]


def run_cell(engine, universe: Universe, prompts: list[list[int]], max_new: int, temperature: float, seed: int,
             budget: int | None, *, first_round_only: bool, product_tree: bool):
    """Generate every prompt (one batch) and measure its rounds: (Cell, the generated ids per row).

    first_round_only: only each row's first round (the fork rounds: root = a marker). A round counts
    while its context is one the universe can produce: after a target error (a token the universe
    does not allow, which a T = 1 sample can draw) the known answer no longer applies, so that row's
    later rounds are counted as `off_universe` only, for every method and the ceiling alike."""
    kept: dict[int, list[dict]] = {}

    def on_round(row, length, logprobs, tree, result):
        local = result.accepted_local_indices[row]
        kept.setdefault(row, []).append({
            "length": length, "paths": node_paths(tree, row).clone(), "valid": tree.valid[row].clone(),
            "modes": tree.modes[row, local[local >= 0] - 1].tolist()})

    params = SamplingParams(temperature=temperature, seed=seed)
    outs = engine.generate_batch(prompts, max_new, params=params, on_round=on_round)
    cell = Cell()
    for row, (prompt, out) in enumerate(zip(prompts, outs)):
        seq = list(prompt) + out.token_ids
        off = universe.first_off_universe(seq)
        records = kept.get(row, [])[:1] if first_round_only else kept.get(row, [])
        for r, stats in zip(records, out.rounds):  # on_round runs once per round of an active row, in order
            length = r["length"]
            if off is not None and off <= length:
                cell.off_universe += 1
                continue
            ctx, actual = seq[: length + 1], seq[length + 1: length + 1 + DRAFT_DEPTH]
            paths = [tuple(t for t in p if t >= 0) for p, v in zip(r["paths"].tolist(), r["valid"].tolist()) if v]
            support = list(universe.continuations(ctx, DRAFT_DEPTH, blind=True))
            chimeras = chimera_count(r["paths"], r["valid"], torch.tensor(support), actual)
            cell.add_round(stats.emitted, len(paths), chimeras, r["modes"])
            cell.multimodal_rounds += len(support) > 1
            cell.marker_rounds += universe.phase(length) == 0
            if temperature > 0:
                masses = prefix_masses(universe.continuations(ctx, DRAFT_DEPTH))
                cell.mass += covered_mass(masses, paths)
                cell.ceiling_mass += ideal_covered_mass(masses, budget or DRAFT_DEPTH)
            if product_tree:
                for a, b in _pairs_in_tree(support, set(paths)):
                    cell.bound_checks += 1
                    cell.bound_violations += splice_chimeras(paths, a, b) < chimera_bound(a, b)
        for blind in (False, True):
            t, n = oracle_run(universe, seq, len(prompt), max_new, budget or DRAFT_DEPTH, temperature,
                              first_round_only, stop=off, blind=blind)
            if blind:
                cell.blind_tokens, cell.blind_rounds = cell.blind_tokens + t, cell.blind_rounds + n
            else:
                cell.oracle_tokens, cell.oracle_rounds = cell.oracle_tokens + t, cell.oracle_rounds + n
    return cell, [o.token_ids for o in outs]


def fork_blocks(target, drafter, universe: Universe, sequences: list[list[int]], *, single_mode: bool):
    """Teacher-forced blocks rooted at every marker with a marker CUE_DISTANCE before it: (kind, index
    of the future that follows, the drafter's log-probs [K', D, V] (unweighted), its mode log-prior [K']
    or None) per marker."""
    sites = [(i, m) for i, seq in enumerate(sequences) for m in universe.marker_positions(len(seq))
             if m > CUE_DISTANCE and m + DRAFT_DEPTH < len(seq)]
    ids = torch.tensor(sequences)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    with torch.inference_mode():
        features = context_features(target(ids, output_hidden_states=True).hidden_states, drafter.cfg.target_layer_ids)
        rows = torch.tensor([i for i, _ in sites])
        starts = torch.tensor([m for _, m in sites])
        slots = torch.arange(ids.shape[1])[None].expand(len(sites), -1)
        context = drafter.context_kv(features[rows], slots, slots < starts[:, None])
        hidden, log_prior = drafter.block_hidden(ids[rows, starts], starts, context, embed, single_mode=single_mode)
        logprobs = drafter.logprobs(hidden, head)
    priors = [None] * len(sites) if log_prior is None else list(log_prior)
    return [(universe.fork_kind(sequences[i], m), universe.future_of_first[sequences[i][m + 1]], lp, prior)
            for (i, m), lp, prior in zip(sites, logprobs, priors)]


def drafter_fork_knowledge(universe: Universe, blocks) -> dict:
    """What a single-mode drafter knows at forks: its mean probability of each future's first token,
    at random forks (the known answer: FUTURE_PROBS) and at cued forks for the cued future (a drafter
    that reads the cue: 1; one that cannot: 1 / M)."""
    random_probs, cued = [], []
    first_ids = [f[0] for f in universe.future_ids]
    for kind, j, lp, _ in blocks:
        probs = lp[0, 0].exp()
        if kind == "random":
            random_probs.append([float(probs[t]) for t in first_ids])
        else:
            cued.append(float(probs[first_ids[j]]))
    return {"random_fork_future_probs": _mean_rows(random_probs), "random_forks": len(random_probs),
            "cued_fork_cued_future_prob": sum(cued) / max(len(cued), 1), "cued_forks": len(cued)}


def mode_assignment(drafter, universe: Universe, blocks, min_agree: int = 5) -> list[dict]:
    """Per mode: the share of fork blocks (root = a marker, so the drafted block is one future) whose
    argmax chain follows future F_j (>= min_agree of its 7 tokens), else "mixed"."""
    counts = [dict() for _ in range(drafter.cfg.num_modes)]
    for _, _, lp, _ in blocks:
        for k, j in enumerate(chain_futures(drafter, universe, lp, min_agree)):
            name = "mixed" if j is None else future_name(j)
            counts[k][name] = counts[k].get(name, 0) + 1
    return [{name: c / max(sum(row.values()), 1) for name, c in sorted(row.items())} for row in counts]


def chain_futures(drafter, universe: Universe, logprobs: torch.Tensor, min_agree: int = 5) -> list[int | None]:
    """Per mode of a fork block's log-probs [K, D, V]: the future its argmax chain follows (>= min_agree
    of its 7 tokens), else None."""
    out = []
    for chain in drafter.to_target_ids(logprobs.argmax(-1)).tolist():
        agree = [sum(a == b for a, b in zip(chain, f)) for f in universe.future_ids]
        j = max(range(len(agree)), key=agree.__getitem__)
        out.append(j if agree[j] >= min_agree else None)
    return out


def gate_at_forks(drafter, universe: Universe, blocks) -> dict:
    """What the MFD drafter's mode gate says at fork blocks, per kind of fork: the mean weight it gives
    the modes whose chain follows each future (at random forks the known answer is FUTURE_PROBS), and
    the share of blocks whose top-weighted mode's chain is the future that came."""
    out = {}
    if drafter.mode_prior is None:
        return out
    for kind in ("random", "cued"):
        rows = [(j, chain_futures(drafter, universe, lp), prior.exp()) for k, j, lp, prior in blocks if k == kind]
        if not rows:
            continue
        on_future = [[float(sum(p for f, p in zip(futures, pi.tolist()) if f == j)) for j in range(len(FUTURES))]
                     for _, futures, pi in rows]
        hits = [futures[int(pi.argmax())] == j for j, futures, pi in rows]
        out[kind] = {"weight_on_future": _mean_rows(on_future), "top_mode_follows_it": sum(hits) / len(hits),
                     "blocks": len(rows)}
    return out


def future_name(j: int) -> str:
    return f"F{j} {FUTURES[j][0]}"


def known_answer_at_fork(universe: Universe, budgets) -> dict:
    """A random fork, in closed form (no training involved): the drafted block is one whole future,
    F_j with probability FUTURE_PROBS[j]. Per budget, the expected accepted draft tokens of
      - the product tree (DDTree) of a perfectly calibrated single-mode drafter: the exact per-position
        marginals of the mixture, and its chimera share;
      - the unweighted mixture tree (MFD without a gate) of a perfect K = M drafter: mode j is F_j
        (probability 1 - 1e-6), every mode's chain equally likely;
      - the weighted mixture tree of the same drafter with a perfect gate, pi_j = P(F_j)
        (`weigh_modes`: MFD's rule with a gate);
      - the best tree (the ceiling)."""
    vocab = max(universe.ids.values()) + 1
    futures = universe.future_ids
    masses = prefix_masses({f: p for f, p in zip(futures, FUTURE_PROBS)})

    def log_table(dists: list[dict]) -> torch.Tensor:
        table = torch.full((DRAFT_DEPTH, vocab), 1e-6 / vocab, dtype=torch.float64)
        for d, dist in enumerate(dists):
            for token, p in dist.items():
                table[d, token] += p * (1 - 1e-6)
        return table.log()

    marginals = [dict() for _ in range(DRAFT_DEPTH)]
    for f, p in zip(futures, FUTURE_PROBS):
        for d, token in enumerate(f):
            marginals[d][token] = marginals[d].get(token, 0.0) + p
    product = log_table(marginals)[None]
    mixture = torch.stack([log_table([{t: 1.0} for t in f]) for f in futures])
    with_priors = weigh_modes(mixture, torch.tensor(FUTURE_PROBS, dtype=torch.float64).log())

    def tree(logprobs, budget):
        """(node paths, node_paths tensor, valid) of the tree of these log-probs [K, D, V]."""
        built = build_mixture_tree(logprobs[None], budget)
        paths_t, valid = node_paths(built, 0), built.valid[0]
        paths = [tuple(t for t in p if t >= 0) for p, v in zip(paths_t.tolist(), valid.tolist()) if v]
        return paths, paths_t, valid

    out = {}
    for budget in budgets:
        p_paths, p_tensor, p_valid = tree(product, budget)
        m_paths, _, _ = tree(mixture, budget)
        w_paths, _, _ = tree(with_priors, budget)
        chimeras = chimera_count(p_tensor, p_valid, torch.tensor(futures), [])
        out[str(budget)] = {"product": covered_mass(masses, p_paths), "mixture": covered_mass(masses, m_paths),
                            "mixture_with_priors": covered_mass(masses, w_paths),
                            "best": ideal_covered_mass(masses, budget),
                            "product_chimera_share": chimeras / max(len(p_paths), 1)}
    return out


def target_fit(target, universe: Universe, sequences: list[list[int]]) -> dict:
    """Teacher-forced on universe samples: what the target learned against the known answer."""
    with torch.inference_mode():
        probs = torch.softmax(target(torch.tensor(sequences)).logits.float(), -1)
    random_forks, cued, cued_hit, deterministic, cue_markers = [], [], [], [], []
    for seq, p in zip(sequences, probs):
        for pos in range(1, len(seq)):
            q, dist = p[pos - 1], universe.next_token_distribution(seq[:pos])
            if universe.phase(pos) == 1 and universe.fork_kind(seq[:pos], pos - 1) == "random":
                random_forks.append([float(q[f[0]]) for f in universe.future_ids])
            elif universe.phase(pos) == 1:
                cued.append(float(q[seq[pos]]))
                cued_hit.append(int(q.argmax()) == seq[pos])
            elif len(dist) == 1:
                deterministic.append(float(q[seq[pos]]))
            else:
                cue_markers.append([float(q[c]) for c in universe.cue_ids])
    return {
        "random_fork_future_probs": _mean_rows(random_forks), "known_future_probs": list(FUTURE_PROBS),
        "cued_future_prob": sum(cued) / max(len(cued), 1),
        "cued_argmax_accuracy": sum(cued_hit) / max(len(cued_hit), 1),
        "deterministic_token_prob": sum(deterministic) / max(len(deterministic), 1),
        "cue_marker_probs": _mean_rows(cue_markers),
    }


def _mean_rows(rows: list[list[float]]) -> list[float]:
    return [sum(col) / len(rows) for col in zip(*rows)] if rows else []


# --- make-multimodal ----------------------------------------------------------------------------

BUDGETS = (4, 8, 16, 32, 64)
TEMPERATURES = (0.0, 1.0)
SETS = HEADERS  # prompt sets: "random" and "cued" sequences
KINDS = ("generation", "fork")  # whole generations; single rounds rooted at a marker


@dataclass
class Settings:
    """One make-multimodal run (the subcommand's options; lr: the fine-tuning's, base_lr: the base's)."""

    seed: int = 0
    target_steps: int = 300
    target_sequences: int = 1024
    data_sequences: int = 512
    base_steps: int = 300  # the base single-mode drafter, from random weights
    steps: int = 300  # each drafter's fine-tuning from the base: single-mode and MFD alike
    gate_steps: int | None = None  # then the MFD gate alone, body frozen (`TrainConfig.gate_steps`); None: steps
    num_modes: int = 4
    base_lr: float = 3e-3
    lr: float = 1e-3
    batch_size: int = 8
    anchors: int = 32
    budgets: tuple = BUDGETS
    temperatures: tuple = TEMPERATURES
    prompts: int = 24  # per set, whole generations
    fork_prompts: int = 64  # per set, rounds rooted at a marker
    max_new_tokens: int = 64
    probe_sequences: int = 64  # teacher-forced diagnostics (target fit, drafter knowledge, modes)


def evaluation_prompts(universe: Universe, rng: random.Random, settings: Settings) -> dict:
    """{kind: {set: prompts}}: generation prompts end anywhere after two cycles; fork prompts end just
    before a marker with a marker CUE_DISTANCE before it (in a cued sequence: its cue), so the first
    round's root is that marker and its drafted block is exactly the future that follows."""
    longest = SEQ_LEN - settings.max_new_tokens
    if longest <= 2 * CYCLE:
        raise ValueError(f"--max-new-tokens {settings.max_new_tokens} leaves no room for a prompt in {SEQ_LEN} tokens")
    out: dict = {"generation": {}, "fork": {}}
    for name in SETS:
        out["generation"][name] = [universe.sample(rng, name, SEQ_LEN)[: rng.randint(2 * CYCLE + 1, longest)]
                                   for _ in range(settings.prompts)]
        markers = [m for m in universe.marker_positions(SEQ_LEN) if CUE_DISTANCE < m < SEQ_LEN - BLOCK_SIZE - 2]
        out["fork"][name] = [universe.sample(rng, name, SEQ_LEN)[: rng.choice(markers)]
                             for _ in range(settings.fork_prompts)]
    return out


def evaluate_universe(target, single, mfd, universe: Universe, prompts: dict, settings: Settings, log=print) -> dict:
    """{T: {set: {kind: {"chain": summary, "ddtree": {B: summary}, "mfd": {B: summary}, ["mfd_uniform":
    {B: summary}], "identical_outputs": bool}}}}: every method on the same prompts with the same sampling
    seeds; "mfd" weighs the modes by the MFD drafter's gate, "mfd_uniform" (when it has one) is the same
    drafter's unweighted tree."""
    trees = {"mfd": mfd} if mfd.mode_prior is None else {"mfd": mfd, "mfd_uniform": mfd.without_mode_gate()}
    results: dict = {}
    for temperature in settings.temperatures:
        for name in SETS:
            for kind in KINDS:
                rows = prompts[kind][name]
                max_new = settings.max_new_tokens if kind == "generation" else BLOCK_SIZE + 1
                runs = [("chain", None, SpeculativeGenerator(target, single, tree="chain", single_mode=True))]
                for budget in settings.budgets:
                    runs.append(("ddtree", budget, SpeculativeGenerator(target, single, budget=budget, single_mode=True)))
                    runs += [(method, budget, SpeculativeGenerator(target, drafter, budget=budget))
                             for method, drafter in trees.items()]
                block: dict = {"ddtree": {}, **{method: {} for method in trees}}
                outputs = []
                for method, budget, engine in runs:
                    cell, out = run_cell(engine, universe, rows, max_new, temperature, settings.seed, budget,
                                         first_round_only=kind == "fork", product_tree=method in ("chain", "ddtree"))
                    summary = cell.summary()
                    if method == "chain":
                        block["chain"] = summary
                    else:
                        block[method][str(budget)] = summary
                    outputs.append(out)
                # Verification is lossless and a sample is a function of (seed, position): every method
                # must emit the very same tokens.
                block["identical_outputs"] = all(o == outputs[0] for o in outputs)
                results.setdefault(str(temperature), {}).setdefault(name, {})[kind] = block
                b16 = str(16 if 16 in settings.budgets else settings.budgets[0])
                taus = [block["chain"]["tau"], block["ddtree"][b16]["tau"], block["mfd"][b16]["tau"],
                        block["mfd"][b16]["ceiling_tau"]]
                log(f"[make-multimodal] T={temperature:g} {name:<6} {kind:<10} tau chain / ddtree / mfd / ceiling "
                    f"(B={b16}): " + " / ".join("-" if t is None else f"{t:.2f}" for t in taus))
    return results


@dataclass
class Run:
    """A make-multimodal OUTDIR read back: its settings, universe, evaluation prompts (the same draws as its
    report's) and models."""

    settings: Settings
    universe: Universe
    prompts: dict  # {kind: {set: prompts}} (`evaluation_prompts`)
    target: object
    single: MFDDrafter
    mfd: MFDDrafter


def format_tau(tau: float | None) -> str:
    """A cell's tau, "-" for a cell without rounds (every row left the universe)."""
    return "-" if tau is None else f"{tau:.2f}"


def cell_table(results: dict, what: str, rows: list) -> str:
    """A Markdown table of `evaluate_engines` results: per (T, set, kind of round), one line per row
    (label, text(block, budget)) over the results' budgets; `what` heads the label column."""
    blocks = [(t, name, kind, block) for t, per_t in results.items() for name, per_set in per_t.items()
              for kind, block in per_set.items()]
    budgets = sorted({int(b) for *_, block in blocks for per_engine in block.values() if isinstance(per_engine, dict)
                      for b in per_engine})
    lines = [f"| T | set | rounds | {what} | " + " | ".join(f"B={b}" for b in budgets) + " |",
             "|---|---|---|---|" + "---|" * len(budgets)]
    for t, name, kind, block in blocks:
        for i, (label, text) in enumerate(rows):
            head = f"| {float(t):g} | {name} | {kind} |" if i == 0 else "| | | |"
            lines.append(f"{head} {label} | " + " | ".join(text(block, b) for b in budgets) + " |")
    return "\n".join(lines)


def load_run(outdir) -> Run:
    outdir = Path(outdir)
    report = json.loads((outdir / "report.json").read_text())
    settings = Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in report["settings"].items()})
    universe = universe_for(build_tokenizer())
    probe_rng = random.Random(settings.seed + 1)  # make_multimodal's draws: the probes, then the prompts
    corpus(universe, probe_rng, settings.probe_sequences)
    prompts = evaluation_prompts(universe, probe_rng, settings)
    drafters = {name: MFDDrafter.from_checkpoint(load_drafter(outdir / "drafters" / name)) for name in ("single", "mfd")}
    return Run(settings, universe, prompts, load_target(outdir / "target"), drafters["single"], drafters["mfd"])


def evaluate_engines(run: Run, engines: dict, log=print) -> dict:
    """{T: {set: {kind: {name: {B: summary}, "identical_outputs": bool}}}} of engines {name: budget ->
    engine} at every cell of the run's evaluation (its temperatures, sets, kinds of round and budgets), each
    run as `evaluate_universe` runs it; identical_outputs: every engine emitted the same tokens (lossless)."""
    settings, results = run.settings, {}
    for temperature in settings.temperatures:
        for name in SETS:
            for kind in KINDS:
                rows = run.prompts[kind][name]
                max_new = settings.max_new_tokens if kind == "generation" else BLOCK_SIZE + 1
                block: dict = {engine: {} for engine in engines}
                outputs = []
                for budget in settings.budgets:
                    for engine, make in engines.items():
                        cell, out = run_cell(make(budget), run.universe, rows, max_new, temperature, settings.seed,
                                             budget, first_round_only=kind == "fork", product_tree=False)
                        block[engine][str(budget)] = cell.summary()
                        outputs.append(out)
                block["identical_outputs"] = all(o == outputs[0] for o in outputs)
                results.setdefault(str(temperature), {}).setdefault(name, {})[kind] = block
                log(f"T={temperature:g} {name:<6} {kind:<10} tau {' / '.join(engines)} by B: " + "  ".join(
                    "/".join(format_tau(block[e][str(b)]["tau"]) for e in engines) for b in settings.budgets))
    return results


def make_multimodal(outdir, settings: Settings | None = None, *, progress: bool = True, log=print) -> dict:
    """Build the universe's target and drafters in OUTDIR, evaluate them, write OUTDIR/report.json,
    OUTDIR/report.md and OUTDIR/report.png (`plot_report`); returns the report. OUTDIR must be new or empty (nothing is overwritten)."""
    settings = settings or Settings()
    outdir = Path(outdir)
    if outdir.exists() and any(outdir.iterdir()):
        raise FileExistsError(f"{outdir} is not empty: give a new OUTDIR")
    outdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    seconds: dict = {}

    def stage(name: str, t0: float) -> None:
        seconds[name] = round(time.perf_counter() - t0, 1)

    rng = random.Random(settings.seed)
    torch.manual_seed(settings.seed)
    generator = torch.Generator().manual_seed(settings.seed)
    tokenizer = build_tokenizer()
    universe = universe_for(tokenizer)

    t0 = time.perf_counter()
    log(f"[make-multimodal] target: {TARGET_LAYERS}-layer Qwen3, {settings.target_steps} steps on "
        f"{settings.target_sequences} universe samples")
    model = train_universe_target(tokenizer, universe, rng, generator, steps=settings.target_steps,
                                  sequences=settings.target_sequences, log=log)
    model.save_pretrained(outdir / "target", safe_serialization=True)
    tokenizer.save_pretrained(outdir / "target")
    target = load_target(outdir / "target")
    stage("target", t0)

    t0 = time.perf_counter()
    log(f"[make-multimodal] drafter data: {settings.data_sequences} target samples at T = 1")
    headers = [[universe.ids[SETS[i % 2]]] for i in range(settings.data_sequences)]
    data = sample_target(target, headers, SEQ_LEN, generator)
    write_training_data(outdir / "data.jsonl", data)
    off = sum(universe.first_off_universe(seq) is not None for seq in data)
    write_seed_drafter(outdir / "drafters" / "seed", target, tokenizer, generator)
    stage("data", t0)

    def run_train(name: str, init: str, num_modes: int, steps: int, lr: float, gate_steps: int = 0) -> Path:
        t = time.perf_counter()
        log(f"[make-multimodal] drafter {name}: K = {num_modes}, {steps} steps from {init}")
        out = outdir / "drafters" / name
        train(TrainConfig(target=str(outdir / "target"), out=str(out), data=str(outdir / "data.jsonl"),
                          num_modes=num_modes, init_from=str(outdir / "drafters" / init), steps=steps,
                          batch_size=settings.batch_size, anchors=settings.anchors, lr=lr, seed=settings.seed,
                          save_every=steps, mode_gate=num_modes > 1, gate_steps=gate_steps), progress=progress, log=log)
        stage(f"drafter_{name}", t)
        return out

    run_train("base", "seed", 1, settings.base_steps, settings.base_lr)
    single_dir = run_train("single", "base", 1, settings.steps, settings.lr)
    mfd_dir = run_train("mfd", "base", settings.num_modes, settings.steps, settings.lr,
                        settings.steps if settings.gate_steps is None else settings.gate_steps)
    single = MFDDrafter.from_checkpoint(load_drafter(single_dir))
    mfd = MFDDrafter.from_checkpoint(load_drafter(mfd_dir))

    t0 = time.perf_counter()
    log("[make-multimodal] diagnostics (teacher forced on fresh universe samples)")
    probe_rng = random.Random(settings.seed + 1)
    probes = corpus(universe, probe_rng, settings.probe_sequences)
    mfd_blocks = fork_blocks(target, mfd, universe, probes, single_mode=False)
    diagnostics = {
        "target_fit": target_fit(target, universe, probes),
        "target_samples_off_universe": off / max(len(data), 1),
        "single_drafter_at_forks": drafter_fork_knowledge(universe, fork_blocks(target, single, universe, probes,
                                                                                single_mode=True)),
        "mfd_mode_assignment": mode_assignment(mfd, universe, mfd_blocks),
        "mfd_gate_at_forks": gate_at_forks(mfd, universe, mfd_blocks),
        "known_answer_at_random_fork": known_answer_at_fork(universe, settings.budgets),
    }
    stage("diagnostics", t0)

    t0 = time.perf_counter()
    log(f"[make-multimodal] evaluation: budgets {list(settings.budgets)}, T {list(settings.temperatures)}")
    prompts = evaluation_prompts(universe, probe_rng, settings)
    results = evaluate_universe(target, single, mfd, universe, prompts, settings, log=log)
    stage("evaluation", t0)


    seconds["total"] = round(time.perf_counter() - start, 1)
    report = {
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()},
        "universe": {"futures": [list(f) for f in FUTURES], "future_probs": list(FUTURE_PROBS), "cycle": CYCLE,
                     "cue_distance": CUE_DISTANCE, "block_size": BLOCK_SIZE, "drafter_window": DRAFTER_WINDOW,
                     "seq_len": SEQ_LEN},
        "results": results,
        "diagnostics": diagnostics,
        "bound": bound_summary(results),
        "expectation": expectation(results, settings),
        "goals": goals(results),
        "seconds": seconds,
    }

    (outdir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (outdir / "report.md").write_text(format_report(report) + "\n")
    plot_report(report, outdir / "report.png")
    log(f"[make-multimodal] wrote {outdir} in {seconds['total']:.0f} s")
    return report


TREE_METHODS = ("ddtree", "mfd", "mfd_uniform")


def _cells(results: dict):
    """(T, set, kind, method, budget, summary) for every tree cell."""
    for t, per_t in results.items():
        for name, per_set in per_t.items():
            for kind, block in per_set.items():
                for method in (m for m in TREE_METHODS if m in block):
                    for budget, summary in block[method].items():
                        yield t, name, kind, method, budget, summary


def bound_summary(results: dict) -> dict:
    """The paper's bound over every DDTree built in the evaluation: a product tree that holds two
    futures differing in m positions holds >= 2^(m-1) - 1 of their splices."""
    checks = sum(s["bound_checks"] for *_, m, _, s in _cells(results) if m == "ddtree")
    violations = sum(s["bound_violations"] for *_, m, _, s in _cells(results) if m == "ddtree")
    return {"checks": checks, "violations": violations}


EXPECTED_RATIO, EXPECTED_CHIMERAS, EXPECTED_BUDGET = 1.3, 0.25, 16


def expectation(results: dict, settings: Settings) -> dict:
    """Issue 16's expectation at T = 1, B = 16: MFD tau >= 1.3 x DDTree's, DDTree chimera share >= 25%."""
    out = {}
    per_t = results.get("1.0")
    if per_t is None or EXPECTED_BUDGET not in settings.budgets:
        return out
    b = str(EXPECTED_BUDGET)
    for name, per_set in per_t.items():
        for kind, block in per_set.items():
            ratio = _ratio(block["mfd"][b]["tau"], block["ddtree"][b]["tau"])
            share = block["ddtree"][b]["chimera_share"]
            out[f"{name}/{kind}"] = {"mfd_over_ddtree": ratio, "ddtree_chimera_share": share,
                                     "ceiling_over_ddtree": _ratio(block["mfd"][b]["ceiling_tau"], block["ddtree"][b]["tau"]),
                                     "met": ratio is not None and share is not None
                                     and ratio >= EXPECTED_RATIO and share >= EXPECTED_CHIMERAS}
    return out


GOAL_CEILING_SHARE, GOAL_CEILING_FROM = 0.95, 16


def goals(results: dict) -> dict:
    """Issue 43's goals, cell by cell: MFD / DDTree tau in every cell (>= 1), and MFD / the best tree
    (and / the cue-blind best tree) on whole generations from B = GOAL_CEILING_FROM (>= .95); the cells
    that miss each, and the same for the unweighted tree when there is one."""
    out: dict = {}
    for method in ("mfd", "mfd_uniform"):
        over_ddtree, over_ceiling = {}, {}
        for t, name, kind, m, budget, summary in _cells(results):
            if m != method:
                continue
            key = f"T={float(t):g}/{name}/{kind}/B={budget}"
            over_ddtree[key] = _ratio(summary["tau"], results[t][name][kind]["ddtree"][budget]["tau"])
            if kind == "generation" and int(budget) >= GOAL_CEILING_FROM:
                over_ceiling[key] = {"ceiling": _ratio(summary["tau"], summary["ceiling_tau"]),
                                     "blind_ceiling": _ratio(summary["tau"], summary["blind_ceiling_tau"])}
        if over_ddtree:
            out[method] = {
                "over_ddtree": over_ddtree,
                "below_ddtree": sorted(k for k, r in over_ddtree.items() if r is not None and r < 1.0),
                "over_ceiling": over_ceiling,
                "below_ceiling_goal": sorted(k for k, r in over_ceiling.items()
                                             if r["ceiling"] is not None and r["ceiling"] < GOAL_CEILING_SHARE)}
    return out


def format_report(report: dict) -> str:
    """The report as Markdown: one table per temperature, set and kind of round, then the diagnostics."""
    budgets = report["settings"]["budgets"]
    lines = []
    for t, per_t in report["results"].items():
        for name, per_set in per_t.items():
            for kind, block in per_set.items():
                what = ("whole generations" if kind == "generation"
                        else "fork rounds (root = a marker: the block is one whole future)")
                lines += ["", f"### T = {float(t):g}, {name} sequences, {what}", "",
                          "| | " + " | ".join(f"B={b}" for b in budgets) + " |",
                          "|---|" + "---|" * len(budgets)]

                def row(label: str, method: str, key: str, fmt: str = "{:.2f}") -> None:
                    cells = [block[method][str(b)][key] for b in budgets]
                    lines.append(f"| {label} | " + " | ".join("-" if c is None else fmt.format(c) for c in cells) + " |")

                def ratio_row(label: str, top: tuple, bottom: tuple) -> None:
                    ratios = [_ratio(block[top[0]][str(b)][top[1]], block[bottom[0]][str(b)][bottom[1]]) for b in budgets]
                    lines.append(f"| {label} | " + " | ".join("-" if r is None else f"{r:.2f}x" for r in ratios) + " |")

                chain = block["chain"]["tau"]
                lines.append(f"| tau chain | {'-' if chain is None else f'{chain:.2f}'} (any budget) |" + " |" * (len(budgets) - 1))
                row("tau DDTree", "ddtree", "tau")
                row("tau MFD", "mfd", "tau")
                ratio_row("MFD / DDTree", ("mfd", "tau"), ("ddtree", "tau"))
                if "mfd_uniform" in block:
                    row("tau MFD unweighted (same drafter, no gate)", "mfd_uniform", "tau")
                    ratio_row("MFD unweighted / DDTree", ("mfd_uniform", "tau"), ("ddtree", "tau"))
                row("tau ceiling (best tree, same output)", "mfd", "ceiling_tau")
                ratio_row("ceiling / DDTree (no tree does better)", ("mfd", "ceiling_tau"), ("ddtree", "tau"))
                ratio_row("MFD / ceiling", ("mfd", "tau"), ("mfd", "ceiling_tau"))
                row("tau blind ceiling (best tree of the cue-blind law)", "mfd", "blind_ceiling_tau")
                ratio_row("MFD / blind ceiling", ("mfd", "tau"), ("mfd", "blind_ceiling_tau"))
                if float(t) > 0:
                    row("E[accepted] DDTree (exact)", "ddtree", "expected_accepted")
                    row("E[accepted] MFD (exact)", "mfd", "expected_accepted")
                    if "mfd_uniform" in block:
                        row("E[accepted] MFD unweighted (exact)", "mfd_uniform", "expected_accepted")
                    row("E[accepted] best tree (exact ceiling)", "mfd", "ceiling_expected_accepted")
                row("chimera share DDTree", "ddtree", "chimera_share", "{:.3f}")
                row("chimera share MFD", "mfd", "chimera_share", "{:.3f}")
                row("effective modes MFD", "mfd", "effective_modes")
                row("share of rounds whose block can branch (MFD)", "mfd", "multimodal_round_share")
                if kind == "generation":
                    row("share of rounds rooted at a marker, DDTree", "ddtree", "marker_root_share")
                    row("share of rounds rooted at a marker, MFD", "mfd", "marker_root_share")
                last = block["mfd"][str(budgets[-1])]
                lines.append(f"\nrounds (MFD, B={budgets[-1]}): {last['rounds']} (+ {last['off_universe_rounds']} after a "
                             f"target error, not counted); identical outputs across methods: {block['identical_outputs']}")
    d = report["diagnostics"]
    known = d["known_answer_at_random_fork"]
    lines += ["", "### Known answer at a random fork (closed form, no training): E[accepted draft tokens]", "",
              "| | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for key, label in (("product", "product tree of the exact marginals (ideal DDTree)"),
                       ("mixture", "mixture tree, one exact mode per future, unweighted (ideal MFD, no gate)"),
                       ("mixture_with_priors", "the same with a perfect gate, pi_j = P(F_j) (weighted MFD)"),
                       ("best", "best tree (ceiling)"), ("product_chimera_share", "chimera share, ideal DDTree")):
        lines.append(f"| {label} | " + " | ".join(f"{known[str(b)][key]:.2f}" for b in budgets) + " |")
    fit, know = d["target_fit"], d["single_drafter_at_forks"]
    lines += ["", "### Known answer vs what was learned", "",
              f"- target at random forks: P(F0..F3) = {_fmt(fit['random_fork_future_probs'])} "
              f"(known {_fmt(fit['known_future_probs'])})",
              f"- target at cued forks: P(cued future) = {fit['cued_future_prob']:.3f}, argmax right "
              f"{fit['cued_argmax_accuracy']:.3f}; deterministic tokens: P = {fit['deterministic_token_prob']:.3f}; "
              f"cue markers: P(cue0..cue3) = {_fmt(fit['cue_marker_probs'])}",
              f"- target samples (drafter data) that leave the universe: {d['target_samples_off_universe']:.3f}",
              f"- single-mode drafter at random forks: P(F0..F3 first token) = "
              f"{_fmt(know['random_fork_future_probs'])}; at cued forks P(cued future) = "
              f"{know['cued_fork_cued_future_prob']:.3f} (reads the cue: 1, blind: 0.25)",
              "- MFD mode -> future (share of fork blocks whose mode argmax chain follows it):"]
    for k, row in enumerate(d["mfd_mode_assignment"]):
        lines.append(f"  - mode {k}: " + ", ".join(f"{n} {v:.2f}" for n, v in row.items()))
    for kind, gate in d.get("mfd_gate_at_forks", {}).items():
        lines.append(f"- MFD's mode gate at {kind} forks ({gate['blocks']} blocks): weight on the modes of F0..F3 "
                     f"{_fmt(gate['weight_on_future'])}"
                     + (f" (known {_fmt(list(FUTURE_PROBS))})" if kind == "random" else " (blind: .25 each)")
                     + f"; its top mode follows the future that came in {gate['top_mode_follows_it']:.2f} of them")
    b = report["bound"]
    lines += [f"- bound 2^(m-1) - 1 on DDTree trees holding two futures: {b['checks']} checks, "
              f"{b['violations']} violations"]
    for key, e in report["expectation"].items():
        ratio, share = e["mfd_over_ddtree"], e["ddtree_chimera_share"]
        lines.append(f"- expectation at T = 1, B = {EXPECTED_BUDGET} ({key}): MFD / DDTree "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} (>= {EXPECTED_RATIO}), DDTree chimera share "
                     f"{'-' if share is None else f'{share:.3f}'} (>= {EXPECTED_CHIMERAS}): {'met' if e['met'] else 'NOT met'}"
                     + ("" if e["ceiling_over_ddtree"] is None
                        else f"; the best tree itself reaches {e['ceiling_over_ddtree']:.2f}x DDTree"))
    for method, goal in report.get("goals", {}).items():
        label = "MFD" if method == "mfd" else "MFD unweighted"
        lines.append(f"- goal, {label} >= DDTree in all {len(goal['over_ddtree'])} cells: "
                     + ("met" if not goal["below_ddtree"] else
                        f"{len(goal['below_ddtree'])} below: " + ", ".join(
                            f"{k} {goal['over_ddtree'][k]:.2f}x" for k in goal["below_ddtree"])))
        lines.append(f"- goal, {label} >= {GOAL_CEILING_SHARE} x the best tree on whole generations from "
                     f"B = {GOAL_CEILING_FROM}: " + ("met" if not goal["below_ceiling_goal"] else ", ".join(
                         f"{k} {goal['over_ceiling'][k]['ceiling']:.2f} (blind ceiling: "
                         f"{_fmt_ratio(goal['over_ceiling'][k]['blind_ceiling'])})" for k in goal["below_ceiling_goal"])))
    lines.append("- wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in report["seconds"].items()))
    return "\n".join(lines).lstrip("\n")


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _fmt(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def plot_report(report: dict, path) -> None:
    """Whole generations, one column per (T, set): tau against the budget for DDTree, MFD (and MFD
    unweighted), the best tree (the ceiling) and the cue-blind best tree, and below it the chimera share
    of DDTree's and MFD's trees."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [(t, name) for t in report["results"] for name in report["results"][t]]
    fig, axes = plt.subplots(2, len(columns), figsize=(3.2 * len(columns), 5.5), squeeze=False)
    for col, (t, name) in enumerate(columns):
        block = report["results"][t][name]["generation"]
        budgets = sorted(int(b) for b in block["ddtree"])
        tau, share = axes[0][col], axes[1][col]
        for method, label in (("ddtree", "DDTree"), ("mfd", "MFD"), ("mfd_uniform", "MFD unweighted")):
            if method not in block:
                continue
            style = ":" if method == "mfd_uniform" else "-"
            tau.plot(budgets, [block[method][str(b)]["tau"] for b in budgets], style, marker="o", label=label)
            share.plot(budgets, [block[method][str(b)]["chimera_share"] for b in budgets], style, marker="o", label=label)
        tau.plot(budgets, [block["ddtree"][str(b)]["ceiling_tau"] for b in budgets], "--", color="gray",
                 label="best tree")
        tau.plot(budgets, [block["ddtree"][str(b)]["blind_ceiling_tau"] for b in budgets], ":", color="gray",
                 label="best tree, cue-blind")
        tau.set_title(f"T = {float(t):g}, {name} sequences", fontsize=9)
        for ax in (tau, share):
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.grid(alpha=0.3)
        share.set_xlabel("tree budget B")
    axes[0][0].set_ylabel("tau (tokens per round)")
    axes[1][0].set_ylabel("chimera share of the tree")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(path), dpi=110)
    plt.close(fig)


def write_results(report: dict, path, command: str) -> None:
    """The report as JSON at `path` (with the date and the command), as Markdown and as a plot next to it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"date": dt.date.today().isoformat(), "command": command, **report}
    path.write_text(json.dumps(payload, indent=1) + "\n")
    path.with_suffix(".md").write_text(format_report(report) + "\n")
    plot_report(report, path.with_suffix(".png"))
