"""The soak benchmark's short version (`benchmarks/soak.py`, 20 minutes there): 20 s of mixed requests
(greedy exact against the target, penalised greedy exact, seeded T = 1 reproducible, aborted streams) from
three clients against an MFD server on the tiny pair whose KV pool holds fewer requests than are sent,
with SGLang's strict idle leak check; the server ends idle, healthy, at its warm-up idle KV usage and
memory, with no error in its log."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import soak  # noqa: E402


def test_short_soak_stays_exact_and_leaves_the_server_as_it_found_it(tiny_pair, tmp_path):
    result = soak.soak(tiny_pair, algorithm="MFD", budget=8, duration=20, workers=3, max_total_tokens=1024,
                       rss_slack_mib=64, seed=0, log_dir=tmp_path, log=lambda *a: None)
    assert result["passed"], "\n".join(result["failures"])
    assert all(count > 0 for count in result["requests"].values()), result["requests"]
