"""A test-only SGLang plugin: a running request whose rid is `hold-after-T-...` stops the decode rounds of its
server once it has T output tokens, until it is aborted. A test that aborts a request in flight then aborts
it in flight on any machine: without the hold, a slow client or a fast server could see the request finish
on its own before the abort lands. (`servers.held_rid` makes such a rid; the client aborts once it has
streamed T tokens, which the hold lets it receive.)

Held, the scheduler runs no decode round, as when its running batch is empty; once the request has an abort
pending (SGLang sets its `to_finish`), the next round runs and ends it as SGLang ends an aborted request.
Hooks:
- `Scheduler.update_running_batch` (a plain server's decode rounds): held, it returns None, "skip decode
  this step" in SGLang's own contract;
- `SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run` (a PD decode server's rounds):
  held, it plans no batch and keeps the running batch as it is.
Servers load it with `servers.plugin_env("hold_decode")`."""

import logging
import re

logger = logging.getLogger(__name__)
DECODE = "sglang.srt.managers.scheduler.Scheduler.update_running_batch"
PD_DECODE = "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run"
HELD_RID = re.compile(r"hold-after-(\d+)-")
logged = set()  # the rids whose hold this process logged


def held(batch) -> bool:
    """Whether a request of `batch` holds its decode rounds: T output tokens out, no abort pending."""
    for req in [] if batch is None else batch.reqs:
        match = HELD_RID.match(str(req.rid))
        if match and len(req.output_ids) >= int(match.group(1)) and req.to_finish is None and not req.finished():
            if req.rid not in logged:
                logged.add(req.rid)
                logger.warning("hold_decode: %s holds decoding at %d output tokens", req.rid, len(req.output_ids))
            return True
    return False


def hold_decode(original, scheduler, batch, *args, **kwargs):
    return None if held(batch) else original(scheduler, batch, *args, **kwargs)


def hold_pd_decode(original, scheduler, running_batch, *args, **kwargs):
    from sglang.srt.managers.scheduler import NextBatchPlan

    if held(running_batch):
        return NextBatchPlan(batch_to_run=None, running_batch=running_batch)
    return original(scheduler, running_batch, *args, **kwargs)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(DECODE, hold_decode, HookType.AROUND)
    HookRegistry.register(PD_DECODE, hold_pd_decode, HookType.AROUND)
