"""Tree verify on hybrid Gated DeltaNet targets (Qwen3.5 / Qwen3.6) for MFD / MFD_D (SGLang 0.5.23).

SGLang's hybrid linear-attention backend verifies EAGLE trees exactly: each node's convolution reads
its ancestors and its recurrent state starts from its parent's, through the tree links of the verify
input (``retrieve_next_token`` / ``retrieve_next_sibling``, which MFD's layout provides). It takes that
path only when ``speculative_eagle_topk > 1``, which MFD pins to 1 for SGLang's generic accounting;
with top-k 1 it would run MFD's tree as a chain (wrong tokens, no error). Two hooks turn the tree
path on for MFD without changing top-k anywhere else:

- ``sglang.srt.layers.attention.hybrid_linear_attn_backend.MambaAttnBackendBase.__init__`` (AFTER): the
  backend's ``topk`` (read only to choose the tree path and size its CUDA-graph tree buffers) becomes
  ``TREE_TOPK`` on an MFD target runner;
- ``sglang.srt.mem_cache.memory_pool.conv_window_dedup_enabled`` (AROUND): the per-step verify
  convolution windows keep SGLang's dense layout under MFD (the deduplicated one assumes a chain: a
  step's window overlaps the previous step's).

After acceptance the worker commits the state after each request's last accepted node
(``MFDWorkerV2.commit_verified``, through SGLang's ``commit_mamba_states_after_verify``).
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
BACKEND_INIT = "sglang.srt.layers.attention.hybrid_linear_attn_backend.MambaAttnBackendBase.__init__"
CONV_WINDOW_DEDUP = "sglang.srt.mem_cache.memory_pool.conv_window_dedup_enabled"
TREE_TOPK = 2  # any value > 1 selects the backend's tree path


def tree_path_after(result, backend, model_runner, *args, **kwargs):
    from mfd_sglang.serving.launch.algorithms import is_mfd

    if is_mfd(model_runner.spec_algorithm) and not model_runner.is_draft_worker:
        backend.topk = max(backend.topk, TREE_TOPK)


def dense_conv_windows_around(original, *args, **kwargs):
    from sglang.srt.runtime_context import get_spec

    from mfd_sglang.serving.launch.algorithms import is_mfd

    return False if is_mfd(get_spec().speculative_algorithm) else original(*args, **kwargs)


def install() -> None:
    from mfd_sglang.patches import register_once

    register_once(BACKEND_INIT, tree_path_after, "after")
    register_once(CONV_WINDOW_DEDUP, dense_conv_windows_around, "around")
