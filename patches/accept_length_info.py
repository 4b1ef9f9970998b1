"""`/server_info`'s `avg_spec_accept_length` for MFD / MFD_D from the first verify round on, and the automatic
budget's choices (SGLang 0.5.23).

Wraps ``sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController
._average_accept_length`` (AROUND). SGLang answers `/server_info` (each scheduler's internal state) with
``avg_spec_accept_length`` = the metrics reporter's lifetime counters ``spec_total_num_accept_tokens /
spec_total_num_forward_ct``, and leaves the key out while they are empty. The scheduler adds every decode
round to per-interval counters (``MetricsReporter.update_spec_metrics``: tokens emitted, requests verified)
and folds them into the lifetime ones only when it logs decode stats, every ``--decode-log-interval``
(40) decode batches. So for every speculative algorithm the key is missing until the 40th decode batch
and then lags up to 39 batches (on the tiny CPU pair: absent after a 16-token request's 6 rounds, 4.9
after a 400-token request's 77; the round counts are the same for MFD as for SGLang's own algorithms,
nothing here is plugin-specific). For MFD and MFD_D the hook adds the interval not yet folded, so the
value is the mean over every round so far, in SGLang's own definition (tokens emitted per request per
verify round, the bonus token included; what `meta_info.spec_accept_length` is per request). Other
algorithms see the original. Re-check the reporter's counters on SGLang upgrades.

Also runs after ``SchedulerInternalStateController._add_speculative`` (AFTER), which fills the speculative keys
of that state: under --mfd-auto-budget it adds ``mfd_auto_budget``, per batch-size bucket (a string key, the
largest batch size it holds) the chosen arm and its measured tokens per request per second beside plain
decoding's (`BudgetChooser.summary`), read from the scheduler's draft worker (MFD's worker).
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
AVERAGE_ACCEPT_LENGTH = ("sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
                         "._average_accept_length")
ADD_SPECULATIVE = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController._add_speculative"


def average_accept_length_around(original, controller, *args, **kwargs):
    """AROUND hook: on an MFD / MFD_D scheduler, the folded and the pending counters together (None before
    the first verify round); the original elsewhere."""
    from mfd_sglang.patches.request_checks import running_mfd

    if not running_mfd():
        return original(controller, *args, **kwargs)
    reporter = controller.scheduler.metrics_reporter
    rounds = reporter.spec_total_num_forward_ct + reporter.spec_num_forward_ct
    if rounds <= 0:
        return None
    return (reporter.spec_total_num_accept_tokens + reporter.spec_num_accept_tokens) / rounds


def auto_budget_state_after(result, controller, state, *args, **kwargs):
    """AFTER hook: the automatic budget's choices into the scheduler's internal state (module docstring)."""
    auto_budget = getattr(getattr(controller.scheduler, "draft_worker", None), "auto_budget", None)
    if auto_budget is not None:
        state["mfd_auto_budget"] = {str(bucket): choice for bucket, choice in auto_budget.chooser.summary().items()}
    return result


def install() -> None:
    """Register the hooks (once per process); SGLang's load_plugins() applies them."""
    from mfd_sglang.patches import register_once

    register_once(AVERAGE_ACCEPT_LENGTH, average_accept_length_around, "around")
    register_once(ADD_SPECULATIVE, auto_budget_state_after, "after")
