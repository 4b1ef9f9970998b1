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

Modules, one job each: `universe` (the universe and its known answer), `target` (its tokenizer, target and seed
drafter), `evaluation` (the reference engine's rounds against the known answer, what the drafters know at a
fork), `command` (make-multimodal: the run, its report and results). The names other modules use are
re-exported here.
"""

from .command import (KINDS, SETS, Run, Settings, cell_table, evaluate_engines, format_report, format_tau, load_run,
                      make_multimodal, write_results)
from .evaluation import DRAFT_DEPTH, ideal_tree, known_answer_at_fork, oracle_run
from .target import (SEQ_LEN, build_tokenizer, corpus, target_config, universe_for, write_seed_drafter,
                     write_training_data)
from .universe import (BLOCK_SIZE, CUE_DISTANCE, DRAFTER_WINDOW, FUTURE_LEN, FUTURE_PROBS, FUTURES, chimera_bound,
                       covered_mass, ideal_covered_mass, prefix_masses, splice_chimeras)

__all__ = ["BLOCK_SIZE", "CUE_DISTANCE", "DRAFTER_WINDOW", "DRAFT_DEPTH", "FUTURES", "FUTURE_LEN", "FUTURE_PROBS",
           "KINDS", "Run", "SEQ_LEN", "SETS", "Settings", "build_tokenizer", "cell_table", "chimera_bound", "corpus",
           "covered_mass", "evaluate_engines", "format_report", "format_tau", "ideal_covered_mass", "ideal_tree",
           "known_answer_at_fork", "load_run", "make_multimodal", "oracle_run", "prefix_masses", "splice_chimeras",
           "target_config", "universe_for", "write_results", "write_seed_drafter", "write_training_data"]
