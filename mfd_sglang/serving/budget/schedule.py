"""The default tree budget on CUDA: a schedule by batch size, from a roofline model of a round.

When (`schedule_applies`): an MFD / MFD_D server on CUDA launched without --speculative-num-draft-tokens
and without --mfd-auto-budget. The launch budget is then the CUDA default, B = 64
(`options.default_num_draft_tokens`): the largest the schedule plays, and what SGLang reserves per request.
A budget the user passes is served as given at every batch size; CPU servers keep their fixed default.

The rule (`BudgetSchedule.budget(n)`), for a decode round of n requests: of the budgets b of
`candidate_budgets(B)` whose predicted round costs at most `ROUND_STEPS` plain decode steps of the same n
requests,

    draft(n, path at n) + forward(n (b + 1) tokens)  <=  ROUND_STEPS x forward(n tokens),

the one with the most predicted tokens per second, prior_tokens(b) / round(b), and plain decoding
(budget 0: no draft, the root alone) where none fits. The bound: at the defaults a round loses to plain
decoding only when it commits fewer than ROUND_STEPS tokens per request (the break-even accept length,
bonus included), by this model; 2.5: the paper's speed-ups at batch 1 (up to 7.8x, README) need accept
lengths well above it, while a drafter that accepts nothing loses at most 2.5x. The prior (`prior_tokens`): the accept length grows by `DOUBLING_GAIN` = 7% per doubling
of the budget, as measured here for DDTree and MFD trees from B = 8 to 64 (docs/results.md, SmolLM2's
drafters on 239 prompts: +7.0-7.3% per doubling); only its ratios between budgets matter. So a budget
doubles only while the round grows by less than 7%: 64 while the verify is weight-bound, smaller as the
window nears the GPU's compute bound. The path at n is the one the worker drafts: MFD's K modes (with a
mode gate and --mfd-num-modes K', each request's K' best), MFD_D's single mode from
--mfd-switch-threshold requests on.

The model (`RoundModel`): the roofline of the round's weight products on the GPU cost ledger's device
(`gpu_cost.H200`), each max(weights read / HBM bandwidth, 2 x weights x rows / peak FLOPs):
  forward(r)      the target over r tokens: its decoder layers and head (`decoder_weights`, from its config:
                  attention and dense MLP per layer; a hybrid or MoE target's layers are counted as dense),
                  per tensor-parallel rank;
  draft(n, path)  the drafter's layers over its n K' T block rows (K' modes, block T) and the head over its
                  n K' (T - 1) scored rows (the draft vocabulary's, else the target's).
Left out, on both sides or on MFD's: launch floors, attention over the context (the plain step reads the
same KV), the tree, accept and commit (0.1-0.4 ms a round in the ledger). The plain step is therefore a
perfectly fused target's: against a real, slower step the bound holds with room. The ledger prints the
schedule's rounds in its own, finer model beside a plain step (`gpu_ledger.default_budget_rows`).

Deterministic: a pure function of the configs, B, the tensor-parallel size and n, so every rank plays the
same budget with no broadcast. Under attention DP, n is every DP rank's requests together
(`MFDWorkerV2.scheduled_batch_size`): the MLP runs them all, and every rank, an idle one included, must
verify one window width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from mfd_sglang.checkpoint import DrafterConfig
from mfd_sglang.gpu_cost import H200, DeviceModel

from mfd_sglang.serving.budget.rule import PLAIN, SINGLE_MODE, Arm, Path, candidate_budgets

ROUND_STEPS = 2.5  # the break-even accept length the rule allows (module docstring)
DOUBLING_GAIN = 0.07  # the prior's relative gain in accept length per doubling of the budget (module docstring)


def prior_tokens(budget: int, doubling_gain: float = DOUBLING_GAIN) -> float:
    """The prior's accept length at `budget`, relative to budget 1's: (1 + gain) per doubling."""
    return (1 + doubling_gain) ** math.log2(budget)


def layer_weights(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> int:
    """Weights of one decoder layer: q, k, v, o projections and a gated MLP (norms are negligible)."""
    return hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate


def decoder_weights(text_config: dict) -> int:
    """The weights a target forward reads, from its text config: every layer as a dense attention + MLP
    layer, and the head (vocabulary x hidden; the embedding rows a forward gathers are negligible)."""
    c = text_config
    missing = [key for key in ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                               "vocab_size") if not c.get(key)]
    if missing:
        raise ValueError(f"the default budget schedule on CUDA reads the target's {', '.join(missing)} from its "
                         "config.json, which has none; pass --speculative-num-draft-tokens N for a fixed budget.")
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or hidden // heads)
    layer = layer_weights(hidden, heads, int(c.get("num_key_value_heads") or heads), head_dim,
                          int(c["intermediate_size"]))
    return int(c["num_hidden_layers"]) * layer + int(c["vocab_size"]) * hidden


@dataclass(frozen=True)
class RoundModel:
    """Roofline seconds of a round's weight products (module docstring)."""

    target_weights: int  # per tensor-parallel rank
    drafter_weights: int  # the drafter's layers (it runs whole on every rank)
    head_weights: int  # the scored vocabulary x hidden
    block: int  # T: root + drafted positions
    num_modes: int  # K of the K-mode path (or the gate's K')
    dtype_bytes: int = 2
    device: DeviceModel = H200

    @classmethod
    def of(cls, drafter: DrafterConfig, target_text_config: dict, *, tp_size: int = 1,
           num_modes: int | None = None) -> "RoundModel":
        """The model of `drafter` on the target of `target_text_config` over tp_size ranks; num_modes: the
        K-mode path's modes (--mfd-num-modes), default all."""
        d = drafter
        return cls(target_weights=decoder_weights(target_text_config) // max(int(tp_size), 1),
                   drafter_weights=d.num_hidden_layers * layer_weights(d.hidden_size, d.num_attention_heads,
                                                                       d.num_key_value_heads, d.head_dim,
                                                                       d.intermediate_size),
                   head_weights=(d.draft_vocab_size or d.vocab_size) * d.hidden_size, block=d.block_size,
                   num_modes=min(num_modes or d.num_modes, d.num_modes))

    def product_seconds(self, weights: int, rows: int) -> float:
        """rows through `weights`: max(reading them, 2 x weights x rows FLOPs)."""
        return max(weights * self.dtype_bytes / self.device.hbm_bytes_per_s,
                   2 * weights * rows / self.device.flops_per_s)

    def plain_seconds(self, n: int) -> float:
        """A plain decode step of n requests: the target over n tokens."""
        return self.product_seconds(self.target_weights, n)

    def draft_seconds(self, n: int, modes: int) -> float:
        return (self.product_seconds(self.drafter_weights, n * modes * self.block)
                + self.product_seconds(self.head_weights, n * modes * (self.block - 1)))

    def round_seconds(self, n: int, budget: int, modes: int) -> float:
        """A round of n requests drafting `modes` modes, verifying n (budget + 1) tokens; plain decoding at 0."""
        if budget == 0:
            return self.plain_seconds(n)
        return self.draft_seconds(n, modes) + self.product_seconds(self.target_weights, n * (budget + 1))


@dataclass(frozen=True)
class BudgetSchedule:
    """The rule (module docstring) for one server: its model, launch budget and drafting paths."""

    model: RoundModel
    max_budget: int
    max_requests: int  # batches beyond it (there are none: --max-running-requests) play its budget
    k_path: Path = Path()  # the K-mode path (`Path(modes=K')` with a mode gate and --mfd-num-modes K')
    switch_threshold: int | None = None  # MFD_D: the single-mode path from this many requests on
    round_steps: float = ROUND_STEPS
    doubling_gain: float = DOUBLING_GAIN

    def path(self, n: int) -> Path:
        return SINGLE_MODE if self.switch_threshold is not None and n >= self.switch_threshold else self.k_path

    def modes(self, path: Path) -> int:
        return 1 if path.single_mode else self.model.num_modes

    @lru_cache(maxsize=None)
    def budget(self, n: int) -> int:
        """The budget of a round of n requests (module docstring): of the candidates whose predicted round
        costs at most `round_steps` plain steps, the one of most prior tokens per second (the larger on a
        tie); 0 when none does."""
        n = min(n, self.max_requests)
        modes, bound = self.modes(self.path(n)), self.round_steps * self.model.plain_seconds(n)
        rounds = {b: self.model.round_seconds(n, b, modes) for b in candidate_budgets(self.max_budget) if b > 0}
        fitting = [b for b, seconds in rounds.items() if seconds <= bound]
        return max(fitting, key=lambda b: (prior_tokens(b, self.doubling_gain) / rounds[b], b), default=0)

    def arm(self, n: int, path: Path) -> Arm:
        """A round's arm: `path` (the worker's, for its own requests) at the budget of n requests."""
        budget = self.budget(n)
        return PLAIN if budget == 0 else path.at(budget)

    def budgets(self) -> tuple[int, ...]:
        """The budgets rounds play, ascending."""
        return tuple(sorted({self.budget(n) for n in range(1, self.max_requests + 1)}))

    def describe(self) -> str:
        """The schedule as ranges of batch sizes, e.g. 'budget 64 at 1-3, budget 32 at 4-6, ..., plain decoding
        at 16-48 requests'."""
        spans, start = [], 1
        for n in range(1, self.max_requests + 1):
            if n == self.max_requests or self.budget(n + 1) != self.budget(n):
                b = self.budget(n)
                sizes = f"{start}" if start == n else f"{start}-{n}"
                spans.append(f"plain decoding at {sizes}" if b == 0 else f"budget {b} at {sizes}")
                start = n + 1
        return (f"by batch size ({', '.join(spans)} requests): of the budgets <= {self.max_budget} whose predicted "
                f"round costs <= {self.round_steps:g} plain decode steps (H200 roofline), the most tokens per "
                f"second at +{100 * self.doubling_gain:g}% accepted per doubling "
                "(mfd_sglang/serving/budget/schedule.py)")


def num_draft_tokens_given(server_args) -> bool:
    """Whether the launch gave --speculative-num-draft-tokens (SGLang's raw input: what the user typed,
    before MFD's default fills it; a record without it counts as given)."""
    raw = getattr(server_args, "_raw_input", None)
    return raw is None or raw.get("speculative_num_draft_tokens") is not None


def schedule_applies(server_args, options) -> bool:
    """The default schedule is in force: CUDA, no --speculative-num-draft-tokens, no --mfd-auto-budget."""
    return (str(server_args.device).startswith("cuda") and not options.auto_budget
            and not num_draft_tokens_given(server_args))


def budget_schedule(server_args, options, drafter: DrafterConfig, target_text_config: dict, *, budget: int,
                    algorithm: str) -> BudgetSchedule | None:
    """The server's schedule where `schedule_applies`, else None: the same for the launcher's memory plan
    and every scheduler's worker (the same arguments and configs)."""
    if not schedule_applies(server_args, options):
        return None
    gated_modes = (options.num_modes if drafter.mode_prior == "gate" and options.num_modes is not None
                   and options.num_modes < drafter.num_modes else None)
    model = RoundModel.of(drafter, target_text_config, tp_size=int(server_args.tp_size or 1),
                          num_modes=options.num_modes)
    # Under attention DP a round reads every DP rank's requests together, at most --max-running-requests.
    return BudgetSchedule(model, budget, int(server_args.max_running_requests), k_path=Path(modes=gated_modes),
                          switch_threshold=options.switch_threshold if algorithm == "MFD_D" else None)
