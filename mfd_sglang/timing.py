"""Device-synchronised wall-clock timing (torch only). CUDA work is queued, so a timed section waits
for the device before its clock starts and again before it stops; elsewhere the work runs on the
host and the waits are no-ops.

- `synchronize(device)`: wait for the device's queued work (CUDA), nothing elsewhere.
- `timed(fn, device)`: (fn(), its seconds), the device synchronised around the call.
- `median_seconds(fn, device, repeats)`: the latency of one call: one untimed run (compilation,
  caches), then the median of `repeats` runs, each timed on its own.
- `mean_ms(fn, device, repeats)`: the throughput of back-to-back calls: one untimed call, then
  `repeats` calls timed together, their mean in milliseconds.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def synchronize(device) -> None:
    """Wait for the queued work of `device` (a torch.device or its name) when it is CUDA."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device) -> tuple[T, float]:
    """(fn(), the wall seconds it took), the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    value = fn()
    synchronize(device)
    return value, time.perf_counter() - start


def median_seconds(fn: Callable[[], object], device, repeats: int = 3) -> float:
    """Median wall time of fn() over `repeats` runs after one untimed run, the device synchronised."""
    timed(fn, device)
    return statistics.median([timed(fn, device)[1] for _ in range(repeats)])


def mean_ms(fn: Callable[[], object], device, repeats: int) -> float:
    """Mean milliseconds of fn() over `repeats` calls after one warm-up call (compilation for Triton)."""
    fn()

    def calls() -> None:  # each result dropped at once, as a caller's loop would
        for _ in range(repeats):
            fn()

    return timed(calls, device)[1] / repeats * 1000
