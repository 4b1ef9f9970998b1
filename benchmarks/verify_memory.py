"""Measured live tensor bytes of one MFD verify + accept round against `mfd_sglang.serving.launch.memory`'s plan.

    python benchmarks/verify_memory.py --batch-sizes 1 4 --budget 16 --vocab 151936

What a round holds from the target's tree-verify logits on, as `MFDWorkerV2.forward_decode` runs it: the
float32 logits [bs * (B + 1), V] (SGLang 0.5.23's logits processor returns float32; the accept step would
copy lower precision), `accept.accept_tree` (greedy: the argmax; T > 0: one sample per node by SGLang's
plain law, here top-p 0.9 without a top-k bound, so over the fully sorted vocabulary: the dearest), then
for requests that return logprobs the emitted tokens' rows and SGLang's `compute_spec_logprobs` over
them. A random mixture tree of budget B; no penalties, grammar or logit bias (each adds work of its own,
not measured here). On CPU: a TorchDispatchMode sees every tensor each op returns and counts a storage
no input of the op shares as allocated until it is freed; the peak of those plus the logits is the
measurement (what ops allocate inside, invisible here, is not counted). Prints one JSON line per batch
size and request kind: measured and planned (`MemoryPlan.verify_bytes`) bytes.
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

KINDS = ("greedy", "sampled", "sampled+logprobs")
TOP_K_OFF = 1 << 30  # SGLang's top_k for "no top-k"


class LiveTensorBytes(TorchDispatchMode):
    """The peak, over the ops run inside it, of the bytes of the storages those ops allocated and that
    are still alive (a storage an op returns that none of its inputs shares is a new one)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage address: (weak ref, bytes)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {ptr: entry for ptr, entry in self.live.items() if not entry[0].expired()}
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in inputs and ptr not in self.live and storage.nbytes() > 0:
                    self.live[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(size for _, size in self.live.values()))
        return out


def round_inputs(bs: int, budget: int, vocab: int, kind: str, seed: int = 0):
    """(tree, layout, logits [bs * (B + 1), V] float32, a batch as the worker reads it, seq_lens)."""
    from mfd_sglang.tree import build_mixture_tree
    from mfd_sglang.tree_layout import tree_to_verify_layout

    gen = torch.Generator().manual_seed(seed)
    drafted = torch.randn(bs, 4, 8, 64, generator=gen).log_softmax(-1)  # K = 4 modes, 8 positions, 64 tokens
    seq_lens = torch.full((bs,), 100)
    tree = build_mixture_tree(drafted, budget)
    layout = tree_to_verify_layout(tree, torch.zeros(bs, dtype=torch.long), seq_lens)
    logits = torch.randn(bs * (budget + 1), vocab, generator=gen)
    greedy = kind == "greedy"
    info = SimpleNamespace(
        is_all_greedy=greedy, temperatures=torch.full((bs, 1), 1.0), top_ks=torch.full((bs,), 1 if greedy else TOP_K_OFF),
        top_ps=torch.full((bs,), 0.9), min_ps=torch.zeros(bs), sampling_seed=None, max_top_k=None, logit_bias=None,
        penalizer_orchestrator=None, sampling_mask_batch_indices=None)
    batch = SimpleNamespace(sampling_info=info, seq_lens=seq_lens, return_logprob=kind.endswith("logprobs"),
                            reqs=[SimpleNamespace(sampling_params=SimpleNamespace(sampling_seed=None))] * bs,
                            top_logprobs_nums=[0] * bs, token_ids_logprobs=[None] * bs)
    return tree, layout, logits, batch, seq_lens


def verify_round(tree, layout, logits, batch, seq_lens) -> None:
    """The logits' part of `MFDWorkerV2.forward_decode`: accept, then the outputs of the emitted tokens."""
    from mfd_sglang.serving.accept import accept_tree
    from mfd_sglang.serving.outputs import round_outputs

    result, node_logits = accept_tree(tree, layout, logits, batch, seq_lens, backend="torch")  # CPU tensors
    output = SimpleNamespace(**dict.fromkeys(("next_token_top_logprobs_val", "next_token_top_logprobs_idx",
                                              "next_token_token_ids_logprobs_val", "next_token_token_ids_logprobs_idx")))
    round_outputs(batch, output, node_logits, result, layout.draft_token.shape[1])


def measure(bs: int, budget: int, vocab: int, kind: str) -> dict:
    """One round: {"measured": the logits plus the peak the round allocated, "planned": verify_bytes}."""
    from mfd_sglang.serving.launch.memory import MemoryPlan

    inputs = round_inputs(bs, budget, vocab, kind)
    logits = inputs[2]
    verify_round(*inputs)  # warm-up: lazy imports and first-call allocations
    with torch.inference_mode(), LiveTensorBytes() as tracked:
        verify_round(*inputs)
    plan = MemoryPlan(weight_bytes=0, context_bytes_per_token=0, hidden=0, intermediate=0, attention_width=0,
                      num_modes=1, block=2, budget=budget, vocab=vocab, draft_vocab=vocab, dtype_bytes=2)
    return {"bs": bs, "budget": budget, "vocab": vocab, "kind": kind,
            "measured": logits.numel() * logits.element_size() + tracked.peak, "planned": plan.verify_bytes(bs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    args = parser.parse_args()
    for bs in args.batch_sizes:
        for kind in args.kinds:
            row = measure(bs, args.budget, args.vocab, kind)
            row["ratio"] = round(row["planned"] / row["measured"], 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
