"""A retracted request's drafter context, backed up and restored with its target KV (SGLang 0.5.23).

Wraps ``Req.offload_kv_cache`` and ``Req.load_kv_cache`` of ``sglang.srt.managers.schedule_batch``
(AFTER). A PD decode server retracts requests when its KV pool runs out (or when SGLANG_TEST_RETRACT
forces it); with ``--disaggregation-decode-retraction-backup cpu_tensor`` SGLang copies a retracted
request's committed target KV to host tensors (``offload_kv_cache``: the allocator's own pool only) and,
when the request resumes, into the slots it gets then (``load_kv_cache``). MFD's drafter context lives
in a pool of its own at the same slot ids (`DraftContextPool`), which SGLang does not copy: without these
hooks a resumed request drafts from whatever its new slots held, and its output stays exact while its
acceptance is lost (tests/test_pd_disaggregation.py holds its rounds to the reference engine's). The
hooks copy the same rows of the drafter context pool that the worker registered on the target's
req-to-token pool (`DraftStage.init_context_pool`), and do nothing on a server without one.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
OFFLOAD = "sglang.srt.managers.schedule_batch.Req.offload_kv_cache"
LOAD = "sglang.srt.managers.schedule_batch.Req.load_kv_cache"


def committed_slots(req, req_to_token_pool):
    """The slots of the request's committed tokens, as SGLang's offload / load index them."""
    return req_to_token_pool.req_to_token[req.kv.req_pool_idx, : req.seqlen - 1]


def backup_context_after(result, req, req_to_token_pool, *args, **kwargs):
    pool = getattr(req_to_token_pool, "mfd_context_pool", None)
    if pool is not None:
        req.mfd_context_backup = pool.cpu_copy(committed_slots(req, req_to_token_pool))
    return result


def restore_context_after(result, req, req_to_token_pool, *args, **kwargs):
    backup = getattr(req, "mfd_context_backup", None)
    if backup is not None:
        req_to_token_pool.mfd_context_pool.load_cpu_copy(backup, committed_slots(req, req_to_token_pool))
        del req.mfd_context_backup
    return result


def install() -> None:
    from mfd_sglang.patches import register_once

    register_once(OFFLOAD, backup_context_after, "after")
    register_once(LOAD, restore_context_after, "after")
