"""SGLang 0.5.23's own server test kits (`sglang/test/kits/`, shipped in its wheel) against real CPU servers
on SmolLM2-135M-Instruct (fp32) with the shipped drafter: the plain server, MFD and MFD_D.

In CI, one server each: MFD_D runs every kit test below (its single-mode path from 3 running requests on);
MFD runs `MFD_CI_TESTS` (the cheapest test of each kit class, and the kits' accept lengths, batch generation,
logprobs and stops); MFD_D with a switch threshold above the batch (`TestMFDDKModeBatchKits`) runs the batch
kit tests on its K-mode tree, the round-trace test plugin showing K-mode rounds of 3 or more requests; the
plain server runs `PLAIN_FAILS`. MFD_SGLANG_ALL_KITS=1 runs every kit test on MFD and on the plain server too,
and the 8k-token prompt. A kit test that passes on the plain server must pass on MFD and MFD_D. The few whose
check SmolLM2 fails on the plain server (`PLAIN_FAILS`, each with its reason) fail it on MFD's servers for the
same reason, their answers being the plain server's: there the kit test's requests are sent to a plain
server too (`plain_reference`, started on first use, which is also the plain kit class's server) and the
answers must be equal, token for token; on the plain server itself the kit's check must fail on answers that
came back 200. The kit tests of speculation itself (`SPECULATIVE_ONLY`) are not run on the plain server.

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

On 2 cores: MFD_D's kits about 5 minutes, MFD's CI tests, the K-mode batch class and the plain reference
about 5 minutes more; MFD_SGLANG_ALL_KITS=1 about 10 minutes more than that.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import tempfile
import threading
import unittest
from types import SimpleNamespace
from unittest import mock

import requests

from mfd_sglang.lab import smollm2
from servers import (ServerProcess, admitted_together, assert_healthy_without_leaks, free_port, launch_command,
                     plugin_env, round_traces, start)
from sglang.test.kits import abort_timeout_kit, radix_cache_server_kit, spec_server_kits
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRAFTER = os.path.join(REPO, "drafters", "smollm2-135m", "mfd")
BUDGET = 16
MAX_NEW_TOKENS = 64
HELPER_MAX_NEW_TOKENS = 32  # the fixture's send_request / run_decode: their kits only check the status
LOGPROB_SWEEP_DIVISOR = 20
RADIX_NODES, RADIX_CHUNK = 24, 16
MAX_RUNNING_REQUESTS = 32
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


def start_kit_server(algorithm: str | None, name: str, extra_env: dict | None = None) -> ServerProcess:
    """A CPU server on SmolLM2-135M-Instruct (fp32) for the kits, with `algorithm` (None: no speculation)
    and the shipped drafter at tree budget `BUDGET`, under SGLang's strict idle KV-leak check."""
    model = str(smollm2.prepare_target(progress=False).path)
    port = free_port()
    folder = tempfile.mkdtemp(prefix="mfd-kits-")
    env = dict(os.environ, HF_HUB_OFFLINE="1", SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="1",
               MFD_TEST_HOLD_FILE=os.path.join(folder, "hold_admission"), **(extra_env or {}))
    env.setdefault("OMP_NUM_THREADS", "2")
    cmd = launch_command(model, port=port, algorithm=algorithm, drafter=DRAFTER,
                         budget=BUDGET if algorithm else None, dtype="float32", extra_args=[
                             "--max-running-requests", str(MAX_RUNNING_REQUESTS),
                             "--max-total-tokens", "20000", "--log-level", "warning"])
    return start(cmd, os.path.join(folder, f"{name}.log"), port=port, env=env)


_plain_reference: list[ServerProcess] = []


def plain_reference() -> ServerProcess:
    """The plain server the MFD servers' answers to `PLAIN_FAILS` requests are held to: started on first
    use, beside the kit class's own server, and checked and stopped when the module ends."""
    if not _plain_reference:
        _plain_reference.append(start_kit_server(None, "plain-reference"))
    return _plain_reference[0]


def tearDownModule():
    for server in _plain_reference:
        try:
            assert_healthy_without_leaks(server)
        finally:
            server.stop()


class KitServer(SpecEagleServerBase):
    """A kit class's server (`start_kit_server`); `algorithm` None serves without speculation, on the module's
    shared plain server (`plain_reference`)."""

    algorithm: str | None = None
    server_env: dict = {}  # the server's environment beyond start_kit_server's
    max_running_requests = MAX_RUNNING_REQUESTS
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
        cls.server = plain_reference() if cls.algorithm is None else start_kit_server(cls.algorithm, cls.__name__,
                                                                                       cls.server_env)
        cls.base_url = cls.server.base_url
        cls.process = cls.server.proc

    @classmethod
    def tearDownClass(cls):
        for patch in getattr(cls, "_patches", []):
            patch.stop()
        server = getattr(cls, "server", None)
        if server is not None and cls.algorithm is not None:  # the shared plain server stops with the module
            try:
                assert_healthy_without_leaks(server)
            finally:
                server.stop()


KITS = (SpecCorrectnessKit, SpecLogprobKit, SpecPenaltyKit, SpecFeatureKit, SpecGrammarKit, SpecSamplingMaskKit,
        MatchedStopMixin, BasicAPIContractMixin, BasicDecodeCorrectnessMixin, BasicSchedulerStressMixin, AbortAllMixin)

# Kit tests whose check fails on the plain server, and why.
PLAIN_FAILS = {
    "test_basic_math": "SmolLM2-135M answers 17, not 391",
    "test_concurrent_requests": "SmolLM2-135M names none of the 8 capitals after the kit's one-word prefix",
    "test_constrained_decoding": "SmolLM2-135M's JSON object does not close (uncapped, it ran past 2000 tokens)",
}
# Kit tests of speculation itself: the plain server has no verify rounds to report.
SPECULATIVE_ONLY = {"test_acc_length", "test_grammar_logprob_count_matches_completion_tokens",
                    "test_grammar_structured_output_no_trailing_tokens"}
# MFD's kit tests in CI: per kit class its cheapest test on MFD_D (2 cores), among those whose check SmolLM2
# passes (SpecFeatureKit's cheapest, test_constrained_decoding, is in PLAIN_FAILS; MFD_D covers it), and for
# the API contract the cheapest that generates (/health_generate) rather than /get_server_info; and the kits'
# accept lengths, batch generation, logprobs and stops.
MFD_CI_TESTS = {
    SpecCorrectnessKit: ("test_first_token_finish", "test_acc_length", "test_batch_generation"),
    SpecLogprobKit: ("test_logprob_start_len", "test_logprob_match", "test_logprob_decode_match_prefill",
                     "test_token_ids_logprob_ragged"),  # test_logprob_mixed (45 s here): MFD_D runs it
    SpecPenaltyKit: ("test_penalty_mixed",),  # its only test
    SpecFeatureKit: ("test_radix_attention",),
    SpecGrammarKit: ("test_grammar_logprob_count_matches_completion_tokens",),
    SpecSamplingMaskKit: ("test_sampling_mask",),
    MatchedStopMixin: ("test_finish_length", "test_finish_stop_str", "test_finish_stop_regex_str",
                       "test_finish_stop_eos"),
    BasicAPIContractMixin: ("test_health_generate",),
    BasicDecodeCorrectnessMixin: ("test_max_token_one",),
    BasicSchedulerStressMixin: ("test_streaming_response",),
    AbortAllMixin: ("test_abort_all",),
}
assert set(MFD_CI_TESTS) == set(KITS) and all(name in vars(kit) for kit, names in MFD_CI_TESTS.items() for name in names)
# The kit tests that batch requests, and how many at once; on MFD's servers they are admitted together.
BATCHED = {"test_batch_generation": 4, "test_concurrent_requests": 8}
# They run on MFD_D's K-mode tree too (`TestMFDDKModeBatchKits`).
K_MODE_BATCH_TESTS = {SpecCorrectnessKit: "test_batch_generation", BasicSchedulerStressMixin: "test_concurrent_requests"}


class _Recording:
    """`requests` as a kit module sees it, keeping each POST's path, payload (as sent: after any cap) and
    answer."""

    def __init__(self, inner, base_url: str):
        self.inner, self.base_url = inner, base_url
        self.exchanges: list[tuple[str, dict, int, object]] = []
        self.lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def post(self, url, json=None, **kwargs):
        response = self.inner.post(url, json=json, **kwargs)
        with self.lock:
            self.exchanges.append((url[len(self.base_url):], copy.deepcopy(json), response.status_code,
                                   response.json() if response.status_code == 200 else response.text))
        return response


def run_recorded(test, kit_test) -> tuple[list, AssertionError | None]:
    """Run a kit test with its module's POSTs recorded: (the exchanges, the kit's failed assertion or None)."""
    module = sys.modules[kit_test.__module__]
    recording = _Recording(module.requests, test.base_url)
    with mock.patch.object(module, "requests", recording):
        try:
            kit_test(test)
        except AssertionError as failure:
            return recording.exchanges, failure
    return recording.exchanges, None


def generated(answer) -> object:
    """What an answer of /generate or of the OpenAI API generated: text, token ids where given, finish
    reason and token count (per prompt or choice)."""
    if isinstance(answer, list):
        return [generated(item) for item in answer]
    if "choices" in answer:
        return ([(c.get("message", {}).get("content", c.get("text")), c.get("finish_reason")) for c in answer["choices"]],
                answer.get("usage", {}).get("completion_tokens"))
    meta = answer["meta_info"]
    return answer["text"], answer.get("output_ids"), meta["finish_reason"], meta["completion_tokens"]


def answers_as_the_plain_server(kit_test, reason: str):
    """On an MFD server, a kit test in PLAIN_FAILS: its requests get the plain server's answers, which is
    why the kit's check fails here as there (`reason`)."""
    @functools.wraps(kit_test)
    def test(self):
        exchanges, _ = run_recorded(self, kit_test)
        self.assertTrue(exchanges, "the kit test sent no request")
        plain = plain_reference()
        for path, payload, status, answer in exchanges:
            self.assertEqual(status, 200, answer)
            reference = requests.post(plain.base_url + path, json=payload, timeout=600)
            self.assertEqual(reference.status_code, 200, reference.text)
            self.assertEqual(generated(answer), generated(reference.json()), f"{path} {payload}")
    return test


def fails_the_kits_check(kit_test, reason: str):
    """On the plain server, a kit test in PLAIN_FAILS: answered (every request 200), and the kit's check
    fails (`reason`)."""
    @functools.wraps(kit_test)
    def test(self):
        exchanges, failure = run_recorded(self, kit_test)
        self.assertTrue(exchanges, "the kit test sent no request")
        self.assertEqual([status for _, _, status, _ in exchanges], [200] * len(exchanges), exchanges)
        self.assertIsNotNone(failure, f"the kit's check passed, so this no longer holds: {reason}")
    return test


def replace_tests(cls, names, make) -> None:
    """Give `cls` its own test for each of these kit tests (`make(kit_test, name)`): changing the kit's own
    function would change it for every class."""
    for name in names:
        setattr(cls, name, make(getattr(cls, name), name))


def with_k_mode_batches(kit_test):
    """A kit test that must have run MFD_D's K-mode tree on 3 or more requests at once: what the round-trace
    test plugin logged while it ran shows such rounds."""
    @functools.wraps(kit_test)
    def test(self):
        since = len(self.server.log())
        kit_test(self)
        rounds = [r for traced in round_traces(self.server, since=since).values() for r in traced]
        k_mode = max((r.batch_size for r in rounds if not r.arm[0] and r.arm[1] > 0), default=0)
        self.assertGreaterEqual(k_mode, 3, f"K-mode rounds of at most {k_mode} requests in {len(rounds)} traced")
    return test


def admitted_at_once(kit_test, requests: int):
    """A kit test that sends `requests` requests at once, on a server that admits none of them until all have
    arrived (`servers.admitted_together`): they share their first batch, and so MFD_D's path and the rounds'
    batches are the same on any machine."""
    @functools.wraps(kit_test)
    def test(self):
        with admitted_together(self.server, requests):
            kit_test(self)
    return test


def abort_all_once_admitted(kit_test):
    """The abort-all kit test, which sends its requests and sleeps before it aborts them all: here it aborts
    once the server admitted every one of them (`servers.admitted_together`), so that none arrives after the
    abort to run on, whatever the machine's speed."""
    @functools.wraps(kit_test)
    def test(self):
        with admitted_together(self.server, self.abort_all_num_requests) as wait:
            with mock.patch.object(abort_timeout_kit, "time", SimpleNamespace(sleep=lambda _: wait())):
                kit_test(self)
    return test


class TestPlainServerKits(KitServer, *KITS):
    algorithm = None


class TestMFDServerKits(KitServer, *KITS):
    algorithm = "MFD"
    server_env = plugin_env("hold_admission")


class TestMFDDKModeBatchKits(KitServer, *K_MODE_BATCH_TESTS):
    """MFD_D whose switch to the single-mode path lies beyond its running requests: its K-mode tree on batches."""

    algorithm = "MFD_D"
    server_env = {"MFD_SGLANG_SWITCH_THRESHOLD": str(MAX_RUNNING_REQUESTS + 1),
                  **plugin_env("round_trace", "hold_admission")}


class TestMFDDServerKits(KitServer, *KITS):
    algorithm = "MFD_D"
    server_env = plugin_env("hold_admission")

    @unittest.skipUnless(ALL_KITS, "an 8k-token prefill, about a minute on 2 cores: with MFD_SGLANG_ALL_KITS=1")
    def test_long_prompt(self):
        BasicSchedulerStressMixin.test_long_prompt(self)


replace_tests(TestMFDDKModeBatchKits, {name for name in dir(TestMFDDKModeBatchKits) if name.startswith("test")}
              - set(K_MODE_BATCH_TESTS.values()), lambda test, name: unittest.skip(
                  "the K-mode batch class runs K_MODE_BATCH_TESTS")(test))
replace_tests(TestMFDDKModeBatchKits, set(K_MODE_BATCH_TESTS.values()) & set(PLAIN_FAILS), lambda test, name:
              answers_as_the_plain_server(test, PLAIN_FAILS[name]))
replace_tests(TestMFDDKModeBatchKits, K_MODE_BATCH_TESTS.values(), lambda test, name: with_k_mode_batches(test))
for speculative in (TestMFDServerKits, TestMFDDServerKits, TestMFDDKModeBatchKits):
    replace_tests(speculative, set(BATCHED) & set(dir(speculative)),
                  lambda test, name: admitted_at_once(test, BATCHED[name]))
    replace_tests(speculative, {"test_abort_all"} & set(dir(speculative)), lambda test, name: abort_all_once_admitted(test))
replace_tests(TestPlainServerKits, PLAIN_FAILS, lambda test, name: fails_the_kits_check(test, PLAIN_FAILS[name]))
replace_tests(TestPlainServerKits, SPECULATIVE_ONLY, lambda test, name: unittest.skip(
    "a kit test of speculation: the plain server has no verify rounds")(test))
replace_tests(TestMFDServerKits, PLAIN_FAILS, lambda test, name: answers_as_the_plain_server(test, PLAIN_FAILS[name]))
replace_tests(TestMFDDServerKits, PLAIN_FAILS, lambda test, name: answers_as_the_plain_server(test, PLAIN_FAILS[name]))
if not ALL_KITS:
    replace_tests(TestMFDServerKits, {name for name in dir(TestMFDServerKits) if name.startswith("test")}
                  - {name for names in MFD_CI_TESTS.values() for name in names}, lambda test, name: unittest.skip(
                      "CI runs MFD_CI_TESTS on MFD; MFD_SGLANG_ALL_KITS=1 runs every kit test")(test))
    replace_tests(TestPlainServerKits, {name for name in dir(TestPlainServerKits) if name.startswith("test")}
                  - set(PLAIN_FAILS), lambda test, name: unittest.skip(
                      "CI runs PLAIN_FAILS on the plain server; MFD_SGLANG_ALL_KITS=1 runs every kit test")(test))


if __name__ == "__main__":
    unittest.main()
