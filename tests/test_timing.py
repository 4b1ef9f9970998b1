"""mfd_sglang.timing on a fake clock: which runs count, what is returned, and (with torch.cuda's
synchronize recorded, no GPU needed) that the device is waited for around every timed section on
CUDA and never elsewhere."""

from __future__ import annotations

import pytest
import torch

from mfd_sglang import timing


class FakeClock:
    """time.perf_counter that only moves when a scripted call runs: call i takes durations[i]."""

    def __init__(self, durations: list[float]):
        self.now, self.durations, self.calls, self.events = 0.0, list(durations), 0, []

    def perf_counter(self) -> float:
        return self.now

    def call(self) -> int:
        self.now += self.durations[self.calls]
        self.calls += 1
        self.events.append("call")
        return self.calls


@pytest.fixture
def clock(monkeypatch):
    def install(durations, device_syncs=False):
        fake = FakeClock(durations)
        monkeypatch.setattr(timing.time, "perf_counter", fake.perf_counter)

        def synchronize(device):
            if not device_syncs:
                raise AssertionError(f"torch.cuda.synchronize({device}) off CUDA")
            fake.events.append(f"sync {device}")

        monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
        return fake
    return install


def test_the_median_is_over_the_timed_runs_only(clock):
    fake = clock([100.0, 1.0, 7.0, 3.0])  # the untimed first run is by far the slowest
    assert timing.median_seconds(fake.call, "cpu") == 3.0
    assert fake.calls == 4  # one untimed + the default 3 repeats
    fake = clock([0.5, 4.0, 2.0, 9.0, 6.0, 8.0])
    assert timing.median_seconds(fake.call, torch.device("cpu"), repeats=5) == 6.0
    assert fake.calls == 6


def test_mean_ms_times_the_repeats_together_after_one_warm_up(clock):
    fake = clock([100.0, 1.0, 2.0, 6.0])
    assert timing.mean_ms(fake.call, "cpu", 3) == pytest.approx(3000.0)
    assert fake.calls == 4


def test_timed_returns_the_value_and_its_seconds(clock):
    fake = clock([2.5])
    assert timing.timed(fake.call, "cpu") == (1, 2.5)


def test_cuda_sections_wait_for_the_device_before_and_after(clock):
    fake = clock([1.0, 2.0, 3.0], device_syncs=True)
    assert timing.timed(fake.call, "cuda:1") == (1, 1.0)
    assert fake.events == ["sync cuda:1", "call", "sync cuda:1"]
    fake.events.clear()
    timing.median_seconds(fake.call, "cuda:1", repeats=1)
    assert fake.events == ["sync cuda:1", "call", "sync cuda:1"] * 2  # the untimed run too
    fake = clock([1.0] * 4, device_syncs=True)
    timing.mean_ms(fake.call, torch.device("cuda"), 3)
    assert fake.events == ["call", "sync cuda", "call", "call", "call", "sync cuda"]
