"""A test-only SGLang plugin: once a scheduler is built (SGLang seeds every rank's generator from
`--random-seed` at the end of its setup), each tensor-parallel rank reseeds torch's global generator with
a seed of its own. Otherwise an unseeded request's coins agree across ranks by construction on a CPU, and a
test could not tell whether the worker broadcasts rank 0's sampled first token and accepted paths
(`MFDWorkerV2.from_rank0`). On a GPU the generators can part (a draw on one rank only); this makes them part
from the start. `tests/test_tp_server.py` puts this folder on the servers' PYTHONPATH (the dist-info beside
it declares the entry point)."""

import logging

import torch

logger = logging.getLogger(__name__)
SCHEDULER_INIT = "sglang.srt.managers.scheduler.Scheduler.__init__"
SEED_PER_RANK = 7919


def reseed_per_rank(result, *args, **kwargs):
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank

    rank = get_tensor_model_parallel_rank()
    seed = SEED_PER_RANK * (rank + 1)
    torch.manual_seed(seed)
    logger.warning("rank_rng: TP rank %d reseeded torch with %d", rank, seed)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SCHEDULER_INIT, reseed_per_rank, HookType.AFTER)
