"""The worker's SGLang-facing contract. MFDWorkerV2 forwards nothing to the target worker, so every name
the installed SGLang reads from a spec worker must be its own: held here to SGLang's source (outside its
own spec workers), so an SGLang upgrade that reads a new name fails this test instead of a server. And
`is_mfd`, the one way the plugin asks whether SGLang runs MFD or MFD_D."""

import ast
import inspect
import pathlib
import re
import textwrap

# Names SGLang 0.5.23 reads from a spec worker only for other algorithms or only when present.
NOT_OURS = {
    "dump_info_records": "DSpark only (internal state)",
    "clear_info_records": "DSpark only (internal state)",
    "set_dspark_forced_budget_frac": "DSpark only (internal state)",
    "block_accept_estimate_log_suffix": "DSpark only (metrics)",
    "get_confidence_budget_prepare": "only with a confidence relay, which MFD's spec class does not ask for",
    "prepare_for_kv_cache_release": "read with getattr(..., None): absent means nothing to prepare",
}


def names_sglang_reads() -> dict[str, set[str]]:
    """{name: files} of every `draft_worker.NAME` / `model_worker.NAME` / getattr(..., "NAME") on the
    scheduler's spec worker, outside SGLang's own spec workers and other hardware backends."""
    import sglang

    root = pathlib.Path(sglang.__file__).parent / "srt"
    pattern = re.compile(r"\b(?:draft_worker|model_worker)\.([A-Za-z_]\w*)"
                         r"|getattr\(\s*(?:self\.|scheduler\.|self\.scheduler\.)?(?:draft_worker|model_worker),\s*\"(\w+)\"")
    names: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("speculative/", "hardware_backend/")):
            continue
        for match in pattern.finditer(path.read_text()):
            names.setdefault(match.group(1) or match.group(2), set()).add(rel)
    return names


def instance_attributes(cls) -> set[str]:
    """The `self.NAME = ...` assignments of cls.__init__."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return {target.attr for node in ast.walk(tree) if isinstance(node, ast.Assign) for target in node.targets
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"}


def test_every_name_sglang_reads_from_a_spec_worker_is_the_workers_own():
    from mfd_sglang.serving.worker import MFDWorkerV2

    assert not hasattr(MFDWorkerV2, "__getattr__")
    names = names_sglang_reads()
    assert {"forward_batch_generation", "init_cuda_graphs", "model_runner"} <= set(names)  # the scan sees them
    own = instance_attributes(MFDWorkerV2)
    missing = {name: sorted(files) for name, files in names.items()
               if not hasattr(MFDWorkerV2, name) and name not in own and name not in NOT_OURS}
    assert not missing, f"SGLang reads these from its spec worker, which MFDWorkerV2 lacks: {missing}"


def test_is_mfd_answers_for_every_spelling_sglang_hands_it():
    from types import SimpleNamespace

    from mfd_sglang.serving.launch.algorithms import is_mfd

    assert is_mfd("MFD") and is_mfd("mfd_d") and is_mfd(SimpleNamespace(name="MFD_D"))
    assert not is_mfd(None) and not is_mfd("DFLASH") and not is_mfd(SimpleNamespace(name="EAGLE"))
    assert not is_mfd("MFD_DX") and not is_mfd(SimpleNamespace(name=None))
