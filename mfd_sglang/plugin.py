"""SGLang plugin entry point (`sglang.srt.plugins` group, see setup.py).

SGLang calls `register()` once per process (launcher, scheduler, detokenizer) before it parses
arguments, so what is registered here is known everywhere:
  - the speculative algorithms `MFD` and `MFD_D` (`mfd_sglang.serving.launch.algorithms`) with their worker
    factory, `mfd_worker_class`: this module is where the algorithms meet the worker, so neither of
    `serving/launch/algorithms.py` and `serving/worker.py` imports the other;
  - their HookRegistry hooks: MFD's options as flags of SGLang's parser (`mfd_sglang.patches.mfd_flags`), the target check (hybrid / sliding-window targets are refused) and
    the drafter-path check before SGLang's argument resolution acts on them
    (`mfd_sglang.patches.launch_checks`), the per-request checks
    (`mfd_sglang.patches.request_checks`), the penalty state on the forward's sampling info
    (`mfd_sglang.patches.penalty_state`), the target's decode CUDA-graph runner as a tree-verify one
    (`mfd_sglang.patches.tree_verify_graph_runner`), the tree path of the hybrid linear-attention
    backend (`mfd_sglang.patches.hybrid_tree_verify`) and `/server_info`'s accept length from the first
    round on (`mfd_sglang.patches.accept_length_info`);
  - the `mfd_cpu` attention backend (plain torch, for CPU-only machines; `mfd_sglang.cpu.attention`);
  - the CPU HookRegistry hooks, when `python -m mfd_sglang.cpu.launch_server` started the process
    tree (`MFD_SGLANG_CPU=1`); SGLang applies hooks per process, so they are registered again in
    every spawned child;
  - the check that all of these hooks were applied (`mfd_sglang.patches.installed_check`): SGLang
    only logs a hook target it cannot resolve, so a process in which one is missing refuses to start,
    naming it.
SGLang only logs an exception raised here, and the launch then fails later with "Unknown
speculative algorithm name: MFD"; so a failure to register the algorithms is also printed on
stderr with its cause.
"""

import importlib.util
import logging
import sys

logger = logging.getLogger(__name__)


def source_checkout_error() -> str | None:
    """Why this `mfd_sglang` cannot register, when it is the repository's source folder rather than the
    installed package: `patches/` and `kernels/` live at the repository root and only an install maps
    them into `mfd_sglang` (setup.py's package_dir). `python -m ...` started in the repository root puts
    the root first on sys.path, so that folder shadows the installed package."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    if (here / "patches").is_dir() or importlib.util.find_spec("mfd_sglang.patches") is not None:
        return None
    return (f"mfd_sglang was imported from {here}, a source checkout without its patches/ and kernels/ "
            "(only an install maps them in): the process was started in the repository root, which "
            "`python -m` puts first on sys.path. Start the server from another directory, with the package "
            "installed (pip install . in the clone, as README.md's Install section says).")


def mfd_worker_class(server_args):
    """The worker factory of MFD and MFD_D (`register_algorithms`): SGLang calls it in each scheduler
    process for the class of the speculative worker."""
    # Imported here so that an error in the worker module surfaces at launch with its own
    # traceback instead of hiding behind "Unknown speculative algorithm".
    from .serving.worker import MFDWorkerV2

    return MFDWorkerV2


def register() -> None:
    problem = source_checkout_error()
    if problem:
        print(f"[mfd_sglang] {problem}", file=sys.stderr, flush=True)
        raise ImportError(problem)
    from . import __version__
    from .cpu import install_if_requested
    from .cpu.attention import register_cpu_attention_backend
    from .patches import (accept_length_info, hybrid_tree_verify, installed_check, launch_checks, mfd_flags,
                          penalty_state, request_checks, retraction_backup, tree_verify_graph_runner)

    try:
        from .serving.launch.algorithms import register_algorithms

        algorithms = register_algorithms(mfd_worker_class)
    except Exception as e:
        print(f"[mfd_sglang] could not register the MFD / MFD_D speculative algorithms: "
              f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
    mfd_flags.install()
    launch_checks.install()
    request_checks.install()
    penalty_state.install()
    tree_verify_graph_runner.install()
    hybrid_tree_verify.install()
    retraction_backup.install()
    accept_length_info.install()
    backend = register_cpu_attention_backend()
    cpu_hooks = install_if_requested()
    installed_check.install()
    logger.debug("mfd_sglang %s plugin: algorithms %s, attention backend %r, CPU hooks %s", __version__,
                 algorithms, backend, "installed" if cpu_hooks else "not requested")
