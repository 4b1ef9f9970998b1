"""The MFD and MFD_D speculative algorithms, registered in SGLang 0.5.23's plugin registry.

`register_algorithms(worker_factory)` registers both names once per process through
`SpeculativeAlgorithm.register(name, spec_class=..., validate_server_args=...)` (see
`sglang/srt/speculative/spec_registry.py`); `worker_factory(server_args)` returns the worker class
and is supplied by the composition root (`mfd_sglang.plugin`), so this module never imports the
worker. The launch-time callbacks it registers (the validator, `handle_server_args`) live in
`mfd_sglang.serving.launch.resolve`.

`is_mfd(algorithm)` is the one answer to "is this MFD or MFD_D?": it takes SGLang's
`SpeculativeAlgorithm` (or anything with a `.name`), an algorithm name in any case, or None.

The spec class answers the capability questions the 0.5.23 core asks every algorithm:

- `is_dflash_family()` True: the target captures the hidden states of the drafter's
  `target_layer_ids` (`spec_aux_hidden_state._resolve_dflash_aux_hidden_state`), the decode batch
  reserves its verify slots through the draft input's `prepare_for_decode`, and requests pass
  through `validate_dflash_request` (extended by `mfd_sglang.patches.request_checks`).
  `is_dflash()` stays False: the stock DFlash worker and its launch hook are not ours.
- `--speculative-num-draft-tokens` is the verify width N = B + 1 (root included), so KV reservation,
  logits buffers and CUDA-graph widths are sized by it.
- `handle_server_args` fills the SGLang fields MFD implies (`launch.resolve_server_args`).
"""

from __future__ import annotations

from typing import Callable

from mfd_sglang.serving.launch.resolve import resolve_server_args, validate_server_args

ALGORITHMS = ("MFD", "MFD_D")


def is_mfd(algorithm) -> bool:
    """Whether `algorithm` (a SpeculativeAlgorithm-like object with `.name`, a name in any case, or
    None) is MFD or MFD_D."""
    return str(getattr(algorithm, "name", algorithm) or "").upper() in ALGORITHMS


def _spec_class():
    """The CustomSpecAlgo subclass (built lazily: sglang is imported only inside SGLang processes)."""
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class MFDSpecAlgo(CustomSpecAlgo):
        """MFD / MFD_D: a one-pass block drafter, a mixture tree, one tree verify per round."""

        def is_dflash_family(self) -> bool:
            return True

        def supports_target_verify_for_draft(self) -> bool:
            return True

        def supports_prefill_shared_read_done(self) -> bool:
            # The worker consumes the prefill's hidden states inside the same call.
            return True

        def has_draft_kv(self) -> bool:
            return True

        def carries_draft_hidden_states(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def get_platform_worker_cls(self):
            return None

        def build_disagg_draft_input(self, batch, last_tokens_tensor, future_map):
            # The decode server's first round under PD disaggregation: MFD's draft input is DFLASH's (the
            # first token as the root, the prompt's drafter context already moved with its KV).
            from sglang.srt.speculative.dflash_disaggregation import build_dflash_disagg_draft_input

            return build_dflash_disagg_draft_input(batch, last_tokens_tensor, future_map)

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True,
                              needs_confidence_relay=False):
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

        def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int, is_draft_worker: bool) -> int:
            return num_draft_tokens

        def handle_server_args(self, server_args) -> None:
            resolve_server_args(server_args)

    return MFDSpecAlgo


def register_algorithms(worker_factory: Callable) -> tuple[str, ...]:
    """Register MFD and MFD_D (idempotent per process) with `worker_factory(server_args)` returning
    their worker class. Returns the names registered now."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec as registered_spec

    spec_class = _spec_class()
    added = []
    for name in ALGORITHMS:
        if registered_spec(name) is not None:
            continue
        SpeculativeAlgorithm.register(name, supports_overlap=True, validate_server_args=validate_server_args,
                                      spec_class=spec_class)(worker_factory)
        added.append(name)
    return tuple(added)
