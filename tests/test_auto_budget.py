"""The automatic budget (MFD_SGLANG_AUTO_BUDGET=1, `mfd_sglang.serving.budget`): the chooser against
simulated servers whose best arm is known, and an MFD_D server with it on CPU (tiny pair, fp32): exact
greedy output across batch sizes while it switches budgets (plain decoding included), seeded sampling
unchanged, logprobs of the emitted tokens, no leak."""

from __future__ import annotations

import concurrent.futures
import random

import pytest
import requests
import torch

from conftest import target_greedy
from mfd_sglang.serving.budget import BudgetChooser, RoundClock, batch_bucket, candidate_budgets
from mfd_sglang.serving.options import read_options
from servers import generate_ids, log_tail
from test_mfd_server import served_without_leaks, start_server
from test_verify import TOP_K_ALL, reference_sample


def test_candidate_budgets_and_buckets():
    assert candidate_budgets(16) == (0, 4, 8, 16)
    assert candidate_budgets(64) == (0, 4, 8, 16, 32, 64)
    assert candidate_budgets(5) == (0, 4, 5)
    assert candidate_budgets(1) == (0, 1)
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 4, 8, 16]


class SimulatedServer:
    """Rounds of a server whose acceptance and cost are known. A request's round draws u ~ U(0, 1) and
    commits 1 + floor(depth(path) * u * log2(1 + b) / log2(1 + B)) tokens at budget b (the same draw
    for every budget: what a smaller tree would have committed never exceeds the larger's). A round
    costs base + per_token * bs * (b + 1) + draft(path) * bs (b > 0), +-5% noise."""

    def __init__(self, max_budget: int, depth: dict, base: float, per_token: float, draft: dict, seed: int = 0):
        self.max_budget, self.depth, self.base, self.per_token, self.draft = max_budget, depth, base, per_token, draft
        self.rng = random.Random(seed)

    def committed(self, path: bool, budgets: list[int], u: float) -> list[int]:
        scale = torch.log2(torch.tensor(1.0 + self.max_budget)).item()
        return [1 + int(self.depth[path] * u * torch.log2(torch.tensor(1.0 + b)).item() / scale) for b in budgets]

    def cost(self, bs: int, arm) -> float:
        path, b = arm
        return self.base + self.per_token * bs * (b + 1) + (self.draft[path] * bs if b else 0.0)

    def value(self, bs: int, arm) -> float:
        """Expected tokens per request per second of an arm (the mean over u on a fine grid)."""
        path, b = arm
        grid = [(i + 0.5) / 2000 for i in range(2000)]
        tokens = sum(self.committed(path, [b], u)[0] for u in grid) / len(grid)
        return tokens / self.cost(bs, arm)

    def run(self, chooser: BudgetChooser, bs: int, rounds: int) -> list:
        played = []
        for _ in range(rounds):
            arm = chooser.choose(bs)
            budgets = chooser.measured_budgets(arm)
            chooser.record_acceptance(arm, [self.committed(arm[0], budgets, self.rng.random()) for _ in range(bs)])
            chooser.record_round_time(bs, arm, self.cost(bs, arm) * self.rng.uniform(0.95, 1.05))
            played.append(arm)
        return played


@pytest.mark.parametrize("case", ["speculation-pays", "verify-too-dear", "mfd_d"])
def test_the_chooser_settles_on_the_best_arm_at_every_batch_size(case):
    """After a short exploration the chooser plays an arm worth >= 97% of the best one (the best by the
    simulation's own law) in >= 85% of the rounds, at each batch size in turn; where speculation does
    not pay it plays plain decoding (budget 0)."""
    paths = (False, True) if case == "mfd_d" else (False,)
    # K modes win at bs 1, MFD_D's single mode at 2 and 4, plain decoding at 8 (unless the verify is
    # too dear for any tree)
    sim = SimulatedServer(16, depth={False: 6.0, True: 4.5}, base=0.02,
                          per_token=0.0008 if case != "verify-too-dear" else 0.01, draft={False: 0.006, True: 0.0005})
    chooser = BudgetChooser(16, paths=paths)
    best_arms = {}
    for bs in (1, 2, 4, 8):
        values = {arm: sim.value(bs, arm) for arm in chooser.arms}
        best = max(values.values())
        best_arms[bs] = max(values, key=values.get)
        played = sim.run(chooser, bs, 400)[100:]
        good = sum(values[arm] >= 0.97 * best for arm in played)
        assert good >= 0.85 * len(played), (bs, best_arms[bs], {a: played.count(a) for a in set(played)})
    if case == "verify-too-dear":
        assert all(arm == (False, 0) for arm in best_arms.values())
    else:  # the simulations are built so that the choice changes with the batch size
        assert len(set(best_arms.values())) > 1, best_arms
    if case == "mfd_d":
        assert {path for path, _ in best_arms.values()} == {False, True}, best_arms


def test_a_larger_batch_does_not_retime_trees_a_smaller_one_ruled_out():
    """Where the verify is too dear for any tree, the first batch size times the trees once; at the
    larger ones, where each tree costs relatively more still, the trees' relative cost at the smaller
    size bounds theirs, so only the probes play a tree (the simulation's trees cost 2.5x plain
    decoding at bs 1 and more above; without the bound every tree is timed again at every size)."""
    sim = SimulatedServer(16, depth={False: 6.0}, base=0.02, per_token=0.01, draft={False: 0.006})
    chooser = BudgetChooser(16)
    first = sim.run(chooser, 1, 100)
    assert len({arm for arm in first if arm[1] > 0}) == 3  # every tree timed at bs 1
    for bs in (2, 4, 8):
        played = sim.run(chooser, bs, 100)
        trees = [arm for arm in played if arm[1] > 0]
        assert len(trees) <= 3 and played[-1] == (False, 0), (bs, trees)


def test_acceptance_of_every_smaller_budget_is_kept_from_one_round():
    chooser = BudgetChooser(16, paths=(False, True))
    assert chooser.measured_budgets((True, 8)) == [0, 4, 8]
    chooser.record_acceptance((True, 8), [[1, 2, 3], [1, 1, 5]])
    assert chooser.tokens((True, 8)) is None  # 2 request-rounds: too few to count (min_requests 8)
    for _ in range(3):
        chooser.record_acceptance((True, 8), [[1, 2, 3], [1, 1, 5]])
    assert chooser.tokens((True, 4)) == pytest.approx(1.5) and chooser.tokens((True, 8)) == pytest.approx(4.0)
    assert chooser.tokens((False, 4)) is None and chooser.tokens((True, 16)) is None
    assert chooser.tokens((False, 0)) == 1.0


def test_round_clock_times_consecutive_decode_rounds_only():
    clock = RoundClock()
    assert clock.decode_round(2, (False, 8)) is None
    bs, arm, seconds = clock.decode_round(3, (False, 4))
    assert (bs, arm) == (2, (False, 8)) and seconds >= 0
    clock.other_forward()  # a prefill in between: the interval is not a round's
    assert clock.decode_round(3, (False, 4)) is None


def test_the_option_is_checked():
    assert read_options({"MFD_SGLANG_AUTO_BUDGET": "1"}).auto_budget
    assert not read_options({}).auto_budget
    with pytest.raises(ValueError, match="MFD_SGLANG_AUTO_BUDGET='yes'"):
        read_options({"MFD_SGLANG_AUTO_BUDGET": "yes"})
    with pytest.raises(ValueError, match="unset MFD_SGLANG_SWITCH_THRESHOLD=2"):
        read_options({"MFD_SGLANG_AUTO_BUDGET": "1", "MFD_SGLANG_SWITCH_THRESHOLD": "2"})


# --- a real server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def auto_server(tiny_pair, tmp_path_factory):
    """MFD_D with the automatic budget, at most B = 16, room for 6 running requests, INFO log."""
    srv = start_server(tmp_path_factory, tiny_pair, tiny_pair / "drafter", "MFD_D", 16, max_running=6,
                       log_level="info", extra_env={"MFD_SGLANG_AUTO_BUDGET": "1"})
    yield from served_without_leaks(srv)


def test_auto_budget_stays_exact_while_it_switches(auto_server, hf_target, tiny_prompts):
    """Six requests of different lengths at once (6 -> 1 running), then one alone: greedy output equal
    to the target's, while the server ran plain-decoding rounds (budget 0), the largest tree, and both
    drafting paths."""
    model, tok = hf_target
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in tiny_prompts[:6]]
    lengths = [8, 24, 12, 32, 10, 16]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        outputs = list(pool.map(lambda i: generate_ids(auto_server, prompts[i], lengths[i])[0], range(6)))
    for ids, n, got in zip(prompts, lengths, outputs):
        assert got == target_greedy(model, ids, n), log_tail(auto_server.log_path)
    alone, meta = generate_ids(auto_server, prompts[1], 24)
    assert alone == outputs[1]
    log = auto_server.log()
    for arm in ("plain decoding (budget 0)", "budget 16, K-mode draft", "budget 16, single-mode draft"):
        assert f"timing {arm}" in log, log_tail(auto_server.log_path)


def test_auto_budget_keeps_seeded_sampling_and_logprobs(auto_server, hf_target, tiny_prompts):
    """A seeded T > 0 request gives plain sampling with its seed's coins, alone and among others; a
    greedy request's returned logprobs are the target's log-softmax at each emitted token."""
    model, tok = hf_target
    ids = tok(tiny_prompts[2], add_special_tokens=False)["input_ids"]
    law, n = dict(temperature=1.5, top_p=0.95, min_p=0.02), 20
    expected = reference_sample(model, ids, n, (1.5, TOP_K_ALL, 0.95, 0.02), seed=3)

    def run(i):
        extra = {"sampling_seed": 3} if i == 0 else {}
        return generate_ids(auto_server, ids, n if i == 0 else 2 * n, **law, **extra)[0]

    assert run(0) == expected
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(run, range(4)))[0] == expected

    prompt = tok(tiny_prompts[0], add_special_tokens=False)["input_ids"]
    response = requests.post(auto_server.base_url + "/generate", json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 24, "temperature": 0}}, timeout=600).json()
    pairs = response["meta_info"]["output_token_logprobs"]
    tokens = [t for _, t, _ in pairs]
    assert tokens == target_greedy(model, prompt, 24)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    expected_logprobs = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor([lp for lp, _, _ in pairs]), expected_logprobs, atol=1e-4)
