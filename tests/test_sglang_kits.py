"""SGLang 0.5.23's own server test kits (`sglang/test/kits/`, shipped in its wheel) against real CPU servers
on SmolLM2-135M-Instruct (fp32) with the shipped drafter: the plain server, MFD and MFD_D each run every kit
test below. A kit test that passes on the plain server must pass on both MFD servers; the few that fail on
the plain server are marked as expected failures there (`PLAIN_FAILS`, each with its reason), so a change
either way shows.

Scaled for 2 CPU cores, sizes only (every assertion is the kit's own):
- generated lengths are capped at `MAX_NEW_TOKENS` in the speculative kits (they ask up to 1024) and at
  `HELPER_MAX_NEW_TOKENS` in the fixture's send_request / run_decode (the abort and penalty kits, which
  check the status only); the matched-stop kit keeps its 1000, its stops end the output early;
- the logprob sweep's prompt lengths and start positions are divided by `LOGPROB_SWEEP_DIVISOR`
  (200 .. 2000 tokens become 10 .. 100);
- the radix-cache tree has `RADIX_NODES` nodes of up to `RADIX_CHUNK` tokens (400 of 256 in the kit);
- abort-all's requests ask 4000 tokens (16000 in the kit, beyond SmolLM2's context of 8192);
- the scheduler-stress kit's 8k-token prompt (a minute of prefill here; it cannot be scaled from outside)
  runs only with MFD_SGLANG_ALL_KITS=1.
Acceptance-length thresholds (`acc_length_thres`, `batch_accept_len_thres`) are meant for large GPU
drafters (3.1, 1.75); here they are set below what the shipped drafter reaches on the kit's prompts (raw
text, while the drafter was trained on chat-templated answers): measured 1.33 (MFD) and 1.31 (MFD_D) for
one request, 1.78 (MFD) and 1.75 (MFD_D) for the batch of four, with the drafters of 2026-12-02.

The test suite runs the kits on MFD_D (about 5 minutes on 2 cores); MFD_SGLANG_ALL_KITS=1 adds the plain
server and MFD (about 12 minutes more) and the 8k-token prompt.
"""

from __future__ import annotations

import functools
import os
import tempfile
import unittest
from unittest import mock

import requests

from mfd_sglang.lab import smollm2
from mfd_sglang.server_process import ServerProcess, free_port, launch_command
from sglang.test.kits import radix_cache_server_kit, spec_server_kits
from sglang.test.kits.abort_timeout_kit import AbortAllMixin
from sglang.test.kits.basic_api_contract_kit import BasicAPIContractMixin
from sglang.test.kits.basic_decode_correctness_kit import BasicDecodeCorrectnessMixin
from sglang.test.kits.basic_scheduler_stress_kit import BasicSchedulerStressMixin
from sglang.test.kits.matched_stop_kit import MatchedStopMixin
from sglang.test.kits.spec_server_kits import (
    SpecCorrectnessKit, SpecFeatureKit, SpecGrammarKit, SpecLogprobKit, SpecPenaltyKit, SpecSamplingMaskKit,
)
from sglang.test.server_fixtures import spec_eagle_fixture
from sglang.test.server_fixtures.spec_eagle_fixture import SpecEagleServerBase
from test_mfd_server import assert_healthy_without_leaks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRAFTER = os.path.join(REPO, "drafters", "smollm2-135m", "mfd")
BUDGET = 16
MAX_NEW_TOKENS = 64
HELPER_MAX_NEW_TOKENS = 32  # the fixture's send_request / run_decode: their kits only check the status
LOGPROB_SWEEP_DIVISOR = 20
RADIX_NODES, RADIX_CHUNK = 24, 16
ALL_KITS = os.environ.get("MFD_SGLANG_ALL_KITS") == "1"


class _CappedRequests:
    """`requests` as a kit module sees it: a POST generates at most `cap` tokens (an OpenAI chat request
    without max_tokens too: it would run to the context length)."""

    def __init__(self, cap: int):
        self.cap = cap

    def __getattr__(self, name):
        return getattr(requests, name)

    def post(self, url, json=None, **kwargs):
        for params in _sampling_params(json):
            if params.get("max_new_tokens", 0) > self.cap:
                params["max_new_tokens"] = self.cap
        if url.endswith("/v1/chat/completions") and (json.get("max_tokens") or self.cap + 1) > self.cap:
            json["max_tokens"] = self.cap
        return requests.post(url, json=json, **kwargs)


def _sampling_params(payload) -> list[dict]:
    params = (payload or {}).get("sampling_params", [])
    return params if isinstance(params, list) else [params]


def _scaled_logprob_check(check, test, args):
    input_len, output_len, temperature, start, return_logprob, top_logprobs_num = args
    return check(test, (input_len // LOGPROB_SWEEP_DIVISOR, output_len, temperature, start // LOGPROB_SWEEP_DIVISOR,
                        return_logprob, top_logprobs_num))


class KitServer(SpecEagleServerBase):
    """A CPU server on SmolLM2-135M-Instruct (fp32) for the kits; `algorithm` None serves without speculation."""

    algorithm: str | None = None
    max_running_requests = 32
    abort_all_max_new_tokens = 4000  # the kit's 16000 is beyond SmolLM2's context (8192)
    # Set below what the shipped drafter reaches on the kit's prompts (see the module docstring); the kit's
    # defaults (3.1, 1.75) are for large GPU drafters.
    acc_length_thres = 1.2
    batch_accept_len_thres = 1.5

    @classmethod
    def setUpClass(cls):
        cls.model = str(smollm2.prepare_target(progress=False).path)
        cls.target_model = cls.model
        cls._tokenizer = None
        cls._patches = [
            mock.patch.object(spec_server_kits, "requests", _CappedRequests(MAX_NEW_TOKENS)),
            mock.patch.object(spec_eagle_fixture, "requests", _CappedRequests(HELPER_MAX_NEW_TOKENS)),
            mock.patch.object(spec_server_kits, "run_logprob_check",
                              functools.partial(_scaled_logprob_check, spec_server_kits.run_logprob_check)),
            mock.patch.object(radix_cache_server_kit, "gen_radix_tree",
                              functools.partial(radix_cache_server_kit.gen_radix_tree,
                                                num_nodes=RADIX_NODES, chunk_len=RADIX_CHUNK)),
        ]
        for patch in cls._patches:
            patch.start()
        port = free_port()
        env = dict(os.environ, HF_HUB_OFFLINE="1", SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="1")
        env.setdefault("OMP_NUM_THREADS", "2")
        cmd = launch_command(cls.model, port=port, algorithm=cls.algorithm, drafter=DRAFTER,
                             budget=BUDGET if cls.algorithm else None, dtype="float32", extra_args=[
                                 "--max-running-requests", str(cls.max_running_requests),
                                 "--max-total-tokens", "20000", "--log-level", "warning"])
        log = os.path.join(tempfile.mkdtemp(prefix="mfd-kits-"), f"{cls.__name__}.log")
        cls.server = ServerProcess(cmd, log, port=port, env=env, cwd=REPO).start()
        cls.base_url = cls.server.base_url
        cls.process = cls.server.proc

    @classmethod
    def tearDownClass(cls):
        for patch in getattr(cls, "_patches", []):
            patch.stop()
        server = getattr(cls, "server", None)
        if server is not None:
            try:
                assert_healthy_without_leaks(server)
            finally:
                server.stop()


KITS = (SpecCorrectnessKit, SpecLogprobKit, SpecPenaltyKit, SpecFeatureKit, SpecGrammarKit, SpecSamplingMaskKit,
        MatchedStopMixin, BasicAPIContractMixin, BasicDecodeCorrectnessMixin, BasicSchedulerStressMixin, AbortAllMixin)

# Kit tests that fail on the plain server, and why. They are expected failures on every server here (MFD's
# output is the plain server's), so an MFD server that passes one differs from the plain server and fails.
PLAIN_FAILS = {
    "test_basic_math": "SmolLM2-135M answers 17, not 391",
    "test_concurrent_requests": "SmolLM2-135M names none of the 8 capitals after the kit's one-word prefix",
    "test_constrained_decoding": "SmolLM2-135M's JSON object does not close (uncapped, it ran past 2000 tokens)",
}
# Kit tests of speculation itself: they fail on the plain server by definition (no verify rounds).
SPECULATIVE_ONLY = {"test_acc_length", "test_grammar_logprob_count_matches_completion_tokens",
                    "test_grammar_structured_output_no_trailing_tokens"}


def expecting_failure(cls, names) -> None:
    """Mark these kit tests of `cls` as expected failures (a wrapper each: marking the kit's own function
    would mark it for every class)."""
    for name in names:
        def test(self, _kit_test=getattr(cls, name)):
            return _kit_test(self)
        setattr(cls, name, unittest.expectedFailure(functools.wraps(getattr(cls, name))(test)))


only_with_all_kits = unittest.skipUnless(
    ALL_KITS,
    "the test suite runs the kits on MFD_D (both drafting paths: K modes for a request alone, the single "
    "mode when batched); MFD_SGLANG_ALL_KITS=1 adds the plain server and MFD (about 12 minutes more)")


@only_with_all_kits
class TestPlainServerKits(KitServer, *KITS):
    algorithm = None


@only_with_all_kits
class TestMFDServerKits(KitServer, *KITS):
    algorithm = "MFD"


class TestMFDDServerKits(KitServer, *KITS):
    algorithm = "MFD_D"

    @unittest.skipUnless(ALL_KITS, "an 8k-token prefill, about a minute on 2 cores: with MFD_SGLANG_ALL_KITS=1")
    def test_long_prompt(self):
        BasicSchedulerStressMixin.test_long_prompt(self)


expecting_failure(TestPlainServerKits, PLAIN_FAILS.keys() | SPECULATIVE_ONLY)
expecting_failure(TestMFDServerKits, PLAIN_FAILS)
expecting_failure(TestMFDDServerKits, PLAIN_FAILS)


if __name__ == "__main__":
    unittest.main()
