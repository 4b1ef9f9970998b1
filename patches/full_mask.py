"""Force FULL_MASK speculative tree masks on SGLang's CPU engine (SGLang 0.5.23).

Wraps two SGLang 0.5.23 internals with HookRegistry hooks:

- ``sglang.srt.speculative.eagle_utils.default_tree_mask_mode`` (REPLACE): on the CPU engine it
  returns ``TreeMaskMode.QLEN_ONLY``, the per-request N x N layout that only the Intel AMX verify
  kernel (``intel_amx`` backend, which needs the unpublished CPU build of sgl-kernel) reads. Every
  other attention backend that runs on CPU (``triton`` under ``TRITON_INTERPRET=1``, and this
  project's CPU backend) reads the custom mask as FULL_MASK (N x (seq_len + N) rows per request),
  so with QLEN_ONLY the EAGLE-family workers (EAGLE, STANDALONE, UNO, plugin algorithms that call
  ``build_tree_kernel_efficient`` with the default mode, and the verify-mask buffer of
  ``srt/layers/attention/verify_mask.py``) verify against a garbled mask: the output is wrong from
  the second token on, with no error. The hook makes it return FULL_MASK; HookRegistry rebinds the
  modules that imported it by name (``eagle_worker_v2``, ``multi_layer_eagle_worker_v2``,
  ``uno_worker_v2``, ``verify_mask``, ``scheduler_pp_mixin``).
- ``sglang.srt.speculative.ngram_worker.NGRAMWorker._prepare_for_speculative_decoding`` (AFTER):
  the NGRAM worker builds FULL_MASK only ``if USE_FULL_MASK and not _is_cpu``; on CPU it leaves the
  QLEN_ONLY mask in ``batch.spec_info.custom_mask``. The hook rebuilds the FULL_MASK layout from it
  (prefix columns True, then the N x N tree block), exactly as the worker does on GPUs.

Only an exact comparison of speculative output with non-speculative output catches this class of
bug. Re-check both internals on every SGLang upgrade (grep ``default_tree_mask_mode`` and
``USE_FULL_MASK``).

``install()`` registers the hooks (idempotent per process). They take effect when
``HookRegistry.apply_hooks()`` runs, which ``sglang.srt.plugins.load_plugins()`` does in every
SGLang process after running the plugin entry points; ``install(apply=True)`` applies at once.
Hooks registered in one process do not exist in spawned children, so each process must call
``install()`` from a plugin entry point (``mfd_sglang.cpu.install_if_requested``).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
DEFAULT_TREE_MASK_MODE = "sglang.srt.speculative.eagle_utils.default_tree_mask_mode"
NGRAM_PREPARE = "sglang.srt.speculative.ngram_worker.NGRAMWorker._prepare_for_speculative_decoding"


def full_mask_tree_mask_mode(*args, **kwargs):
    """REPLACE hook for ``default_tree_mask_mode``: always FULL_MASK."""
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    return TreeMaskMode.FULL_MASK


def qlen_to_full_mask(qlen_mask, seq_lens_cpu, num_draft_tokens: int):
    """[bs*N*N] QLEN_ONLY mask -> flat FULL_MASK: per request N rows of (seq_len ones | its N x N
    block), requests concatenated (the layout the NGRAM worker builds on GPUs)."""
    import torch

    n = int(num_draft_tokens)
    lens = [int(x) for x in seq_lens_cpu.reshape(-1).tolist()]
    bs = len(lens)
    blocks = qlen_mask.reshape(-1)[: bs * n * n].reshape(bs, n, n).to(torch.bool)
    parts = []
    for i, seq_len in enumerate(lens):
        ones = torch.ones((n, seq_len), dtype=torch.bool, device=qlen_mask.device)
        parts.append(torch.cat((ones, blocks[i]), dim=1).reshape(-1))
    if not parts:
        return qlen_mask.new_zeros((0,), dtype=torch.bool)
    return torch.cat(parts)


def ngram_full_mask_after(result, self, batch, *args, **kwargs):
    """AFTER hook for ``NGRAMWorker._prepare_for_speculative_decoding``."""
    spec_info = getattr(batch, "spec_info", None)
    mask = getattr(spec_info, "custom_mask", None)
    if mask is None or not batch.forward_mode.is_target_verify():
        return result
    n = int(self.draft_token_num)
    bs = len(batch.reqs)
    if mask.numel() != bs * n * n:  # already FULL_MASK (or a layout this hook does not know)
        return result
    spec_info.custom_mask = qlen_to_full_mask(mask, batch.seq_lens_cpu[:bs], n)
    return result


def install(apply: bool = False) -> None:
    """Register both hooks with SGLang's HookRegistry (once per process)."""
    from mfd_sglang.patches import register_once

    added = [register_once(DEFAULT_TREE_MASK_MODE, full_mask_tree_mask_mode, "replace"),
             register_once(NGRAM_PREPARE, ngram_full_mask_after, "after")]
    if any(added):
        logger.debug("mfd_sglang: FULL_MASK hooks registered (SGLang %s)", SGLANG_VERSION)
    if apply:
        from sglang.srt.plugins.hook_registry import HookRegistry

        HookRegistry.apply_hooks()


def is_installed() -> bool:
    from mfd_sglang.patches import is_registered

    return is_registered(DEFAULT_TREE_MASK_MODE, full_mask_tree_mask_mode)
