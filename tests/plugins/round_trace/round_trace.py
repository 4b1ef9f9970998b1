"""A test-only SGLang plugin: every MFD decode round logs, per request, the arm the draft stage drafted and
the draft tokens the target accepted, so that a test can hold what ran to the reference engine round by
round (`servers.round_traces`, `references.assert_rounds_as_reference`): an arm the worker chose but did not
draft shows up as an accept count the reference engine does not reach for that arm. Logs one line per
request and round:

    round_trace: tp_rank=R rid=RID bs=BS single_mode=0|1 budget=B modes=K'|all accepted=N

(`bs`: the requests in the round's batch; `accepted`: accepted draft tokens, the bonus token excluded,
before any max_new_tokens cut, as SGLang's `spec_correct_drafts_histogram` counts them). Servers load it
with this folder on their PYTHONPATH (the dist-info beside it declares the entry point:
`servers.plugin_env`)."""

import logging

logger = logging.getLogger(__name__)
DRAFT_TREE = "mfd_sglang.serving.draft_stage.DraftStage.tree"
DECODE_ROUND = "mfd_sglang.serving.worker.MFDWorkerV2.forward_decode"
drafted = {}  # "arm": the arm the draft stage was last called with (one scheduler thread per process)


def record_arm(result, stage, roots, seq_lens, req_pool_indices, max_len, arm):
    drafted["arm"] = arm


def log_round(result, worker, batch, *args, **kwargs):
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank

    arm = drafted.pop("arm")
    rank = get_tensor_model_parallel_rank()
    for req, accept_len in zip(batch.reqs, result.accept_lens.tolist()):
        logger.warning("round_trace: tp_rank=%d rid=%s bs=%d single_mode=%d budget=%d modes=%s accepted=%d", rank,
                       req.rid, len(batch.reqs), arm.single_mode, arm.budget, "all" if arm.modes is None else arm.modes,
                       accept_len - 1)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(DRAFT_TREE, record_arm, HookType.AFTER)
    HookRegistry.register(DECODE_ROUND, log_round, HookType.AFTER)
