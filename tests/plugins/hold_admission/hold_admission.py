"""A test-only SGLang plugin: a test arms a hold, and the server's scheduler then admits no waiting request
until N requests wait, so that N requests sent together are certain to share their first batch whatever the
machine's speed. A test whose precondition needs requests in one batch (a forced retraction, MFD_D's
single-mode path, a K-mode batch) would otherwise depend on how their arrivals interleave with rounds.

The test arms it by writing `GENERATION N` to the file `$MFD_TEST_HOLD_FILE` (`servers.admitted_together`)
before it sends the requests; each generation holds once. Every rank reads the file and counts its own
waiting queue, which tensor-parallel ranks share, so they all admit at the same step; a health check's
request (SGLang's `HEALTH_CHECK` rid) is not counted. Unarmed, or once the generation's N requests were
admitted, the hooks call SGLang's own code.

It holds the one place each kind of server admits requests from its waiting queue:
- `Scheduler.get_new_batch_prefill` (a plain or PD-prefill server's prefill batch): held, it plans no batch
  and keeps the running batch as it is;
- `SchedulerDisaggregationDecodeMixin.get_new_prebuilt_batch` (a PD decode server: requests whose KV has
  arrived wait there, holding their preallocated KV, until they join the running batch): held, it returns
  None, as it does with an empty queue.

When the generation's N requests wait it logs `hold_admission: generation G admitting N waiting requests`
and admits them as SGLang would (one prefill batch or one prebuilt batch, within SGLang's own limits).
Servers load it with `servers.plugin_env("hold_admission")`; `servers.start_server` sets the file's path."""

import logging
import os

logger = logging.getLogger(__name__)
PREFILL = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
PREBUILT = "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.get_new_prebuilt_batch"
admitted = set()  # the generations this process has admitted


def holding(scheduler) -> bool:
    """Whether the armed generation's N requests are still to arrive."""
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

    try:
        with open(os.environ["MFD_TEST_HOLD_FILE"]) as armed:
            generation, wanted = map(int, armed.read().split())
    except FileNotFoundError:
        return False
    if generation in admitted:
        return False
    waiting = sum(not str(req.rid).startswith(HEALTH_CHECK_RID_PREFIX) for req in scheduler.waiting_queue)
    if waiting < wanted:
        return True
    admitted.add(generation)
    logger.warning("hold_admission: generation %d admitting %d waiting requests", generation, waiting)
    return False


def hold_prefill(original, scheduler, running_batch, *args, **kwargs):
    from sglang.srt.managers.scheduler import NextBatchPlan

    if holding(scheduler):
        return NextBatchPlan(batch_to_run=None, running_batch=running_batch)
    return original(scheduler, running_batch, *args, **kwargs)


def hold_prebuilt(original, scheduler, running_batch, *args, **kwargs):
    return None if holding(scheduler) else original(scheduler, running_batch, *args, **kwargs)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(PREFILL, hold_prefill, HookType.AROUND)
    HookRegistry.register(PREBUILT, hold_prebuilt, HookType.AROUND)
