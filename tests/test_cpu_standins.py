"""The pure-torch `sgl_kernel` stand-in (mfd_sglang/cpu/sgl_kernel_standin).

The `*_cpu` helpers of SGLang's CPU engine against the Triton twins inside SGLang 0.5.23, run under
TRITON_INTERPRET=1 on random inputs of several shapes. TRITON_INTERPRET must be set before triton is
imported, and other test modules import triton earlier in the same pytest process, so these
comparisons run in one fresh subprocess (this file run as a script: `python tests/test_cpu_standins.py`),
and each test reads its own verdict.

The names SGLang binds on CUDA (model_ops and the placeholders) against independent float64 / Python
references in this process, on CPU and, when present, on CUDA; and SGLang's CUDA modules imported with
torch.cuda.is_available forced true, in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FORCED_H200_IMPORTS

REPO = Path(__file__).resolve().parents[1]
STANDIN_DIR = REPO / "mfd_sglang" / "cpu" / "sgl_kernel_standin"

CHECKS = [
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
    "build_tree_kernel_efficient_cpu",
    "reconstruct_indices_from_tree_mask",
]
HOOK_CHECKS = ["_full_mask_hooks"]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("standins") / "verdicts.json"
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN_DIR), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, __file__, str(out)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"comparison subprocess failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", CHECKS)
def test_standin_matches_triton_twin(verdicts, name):
    v = verdicts.get(name)
    assert v is not None, f"{name}: not checked"
    assert v["ok"], f"{name}: {v['detail']}"
    assert v["cases"] >= 3, f"{name}: only {v['cases']} cases ran"


def test_full_mask_hooks(verdicts):
    """patches/full_mask.py: install() is idempotent, gated by MFD_SGLANG_CPU in
    install_if_requested, forces FULL_MASK (also in modules that imported the function by name),
    and the NGRAM QLEN_ONLY -> FULL_MASK conversion gives the GPU layout."""
    v = verdicts["_full_mask_hooks"]
    assert v["ok"], v["detail"]


# SGLang's hybrid Gated DeltaNet modules (Qwen3.5 / Qwen3.6), whose import on a CPU binds torch.ops.sgl_kernel ops.
HYBRID_GDN_MODULES = ("sglang.srt.models.qwen3_5", "sglang.srt.layers.attention.linear.gdn_backend",
                      "sglang.srt.layers.attention.linear.kernels.gdn_triton")


def bound_at_import(module: str) -> set[str]:
    """The `torch.ops.sgl_kernel.NAME` references a module's source makes outside functions and classes
    (what importing it binds, under `if _is_cpu:` and the like); ops used only inside functions are
    behind run-time checks (the AMX ones)."""
    import ast
    import importlib.util

    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Attribute) and ast.unparse(child.value) == "torch.ops.sgl_kernel":
                names.add(child.attr)
            visit(child)

    visit(ast.parse(Path(importlib.util.find_spec(module).origin).read_text()))
    return names


def test_torch_ops_are_those_sglangs_hybrid_modules_bind(verdicts):
    """The stand-in registers exactly the torch.ops.sgl_kernel ops that SGLang's hybrid GDN modules bind
    when imported on a CPU (read from their sources), never `convert_weight_packed` (SGLang's Intel AMX
    probe: registering it would route models onto AMX)."""
    expected = {f"sgl_kernel::{name}" for module in HYBRID_GDN_MODULES for name in bound_at_import(module)}
    assert expected, "no torch.ops.sgl_kernel binding found in SGLang's hybrid GDN modules"
    assert set(verdicts["_torch_ops"]["registered"]) == expected
    assert not verdicts["_torch_ops"]["amx_probe"]


# ------------------------------------------------------------------------------------------------
# The ops SGLang binds from sgl_kernel on CUDA (run in this process, on CPU and, when present, CUDA)
# ------------------------------------------------------------------------------------------------

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
# (module, name) of every placeholder: imported by SGLang on CUDA, never called for a dense bf16 / fp32 model
PLACEHOLDERS = [("", n) for n in ("int8_scaled_mm", "moe_sum", "moe_sum_reduce")] + [
    ("quantization", n) for n in ("ggml_dequantize", "ggml_moe_a8", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8")
] + [("kvcacheio", "transfer_kv_" + n) for n in (
    "all_layer", "all_layer_direct_lf_pf", "all_layer_lf_pf", "all_layer_lf_ph", "all_layer_mla",
    "all_layer_mla_lf_pf", "direct", "per_layer", "per_layer_direct_pf_lf", "per_layer_mla", "per_layer_mla_pf_lf",
    "per_layer_pf_lf", "per_layer_ph_lf")]


@pytest.fixture(scope="module")
def standin():
    """The stand-in package and its submodules, imported from STANDIN_DIR and then taken out of
    sys.modules / sys.path again, so that nothing imported later in this process mistakes it for an
    installed sgl_kernel."""
    import importlib
    import types

    def ours(name: str) -> bool:
        return name == "sgl_kernel" or name.startswith("sgl_kernel.")

    saved = {k: v for k, v in sys.modules.items() if ours(k)}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(STANDIN_DIR))
    try:
        pkg = importlib.import_module("sgl_kernel")
        subs = {n: importlib.import_module(f"sgl_kernel.{n}") for n in ("kvcacheio", "quantization", "utils")}
    finally:
        sys.path.remove(str(STANDIN_DIR))
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
    assert getattr(pkg, "MFD_SGLANG_CPU_STANDIN", False), pkg.__file__
    return types.SimpleNamespace(pkg=pkg, **subs)


def _close(got: torch.Tensor, want64: torch.Tensor, dtype: torch.dtype) -> None:
    """got (dtype) equals the float64 reference up to one rounding to dtype: in bf16 nearly every
    element is exactly the rounded reference, as when the op computes in fp32 and rounds once (an
    extra bf16 rounding inside the op, e.g. of silu(gate) before the product, misses often)."""
    assert got.dtype == dtype
    want = want64.to(dtype)
    tol = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)
    if dtype == torch.bfloat16:
        # away from the tails where fp32 itself cancels (GELU of x << 0), in which the op and the
        # float64 reference part by more than a rounding
        away = want64.abs() >= 1e-2
        exact = (got == want)[away].double().mean().item()
        assert exact >= 0.98, f"only {exact:.1%} of the bf16 elements equal the once-rounded reference"


def _rms_ref(x64: torch.Tensor, w64: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * (w64 + offset)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
def test_rmsnorm_matches_reference(standin, device, dtype, gemma):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype).to(device)
    w = (torch.randn(96, generator=g) * 0.5 + 1).to(dtype).to(device)
    fn = standin.pkg.gemma_rmsnorm if gemma else standin.pkg.rmsnorm
    before = x.clone()
    got = fn(x, w, 1e-5)
    want = _rms_ref(x.double(), w.double(), 1e-5, 1.0 if gemma else 0.0)
    _close(got, want, dtype)
    assert torch.equal(x, before)  # returns a new tensor, input untouched
    out = torch.empty_like(x)
    assert fn(x, w, 1e-5, out=out) is out and torch.equal(out, got)
    # any leading shape (the Qwen3 q/k norms see [tokens, heads, head_dim])
    _close(fn(x.view(7, 4, 24), w[:24], 1e-5), _rms_ref(x.view(7, 4, 24).double(), w[:24].double(), 1e-5,
                                                           1.0 if gemma else 0.0), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
def test_fused_add_rmsnorm_updates_input_and_residual_in_place(standin, device, dtype, gemma):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 64, generator=g).to(dtype).to(device)
    residual = (torch.randn(9, 64, generator=g) * 2).to(dtype).to(device)
    w = (torch.randn(64, generator=g) * 0.5 + 1).to(dtype).to(device)
    total = x.double() + residual.double()
    fn = standin.pkg.gemma_fused_add_rmsnorm if gemma else standin.pkg.fused_add_rmsnorm
    assert fn(x, residual, w, 1e-6) is None
    _close(residual, total, dtype)
    _close(x, _rms_ref(total, w.double(), 1e-6, 1.0 if gemma else 0.0), dtype)


def _gelu_ref(a: torch.Tensor) -> torch.Tensor:
    return 0.5 * a * (1 + torch.erf(a / 2**0.5))


def _gelu_tanh_ref(a: torch.Tensor) -> torch.Tensor:
    return 0.5 * a * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (a + 0.044715 * a**3)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,act", [("silu_and_mul", lambda a: a / (1 + torch.exp(-a))),
                                      ("gelu_and_mul", _gelu_ref), ("gelu_tanh_and_mul", _gelu_tanh_ref)])
def test_gated_activation_matches_reference(standin, device, dtype, name, act):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 5, 2 * 40, generator=g) * 3).to(dtype).to(device)
    fn = getattr(standin.pkg, name)
    x64 = x.double()
    want = act(x64[..., :40]) * x64[..., 40:]
    got = fn(x)
    assert got.shape == (3, 5, 40)
    _close(got, want, dtype)
    out = torch.empty(3, 5, 40, dtype=dtype, device=device)
    assert fn(x, out) is out and torch.equal(out, got)
    with pytest.raises(ValueError, match="shape"):
        fn(x, torch.empty(3, 5, 80, dtype=dtype, device=device))


def _random_probs(g, rows: int, vocab: int) -> torch.Tensor:
    probs = torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2, dim=-1)
    probs[0, :5] = probs[0].max() + 0.1  # row 0: its 5 largest probabilities tie
    return (probs / probs.sum(-1, keepdim=True)).float()


def _renorm_ref(probs: torch.Tensor, keep) -> torch.Tensor:
    """Row by row in Python: keep(row values) -> the pivot; values >= pivot kept, renormalised."""
    out = torch.zeros(probs.shape, dtype=torch.float64)
    for r, row in enumerate(probs.double().tolist()):
        pivot = keep(r, sorted(row, reverse=True))
        kept = [v if v >= pivot else 0.0 for v in row]
        out[r] = torch.tensor(kept) / sum(kept)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_renorm_prob_matches_reference(standin, device):
    g = torch.Generator().manual_seed(6)
    probs = _random_probs(g, 6, 50)
    # row 0: k = 2 lands inside the 5-way tie (all 5 are kept); TOP_K_ALL (1 << 30) keeps everything
    ks = torch.tensor([2, 1, 7, 50, 1 << 30, 13])
    want = _renorm_ref(probs, lambda r, desc: desc[min(int(ks[r]), len(desc)) - 1])
    got = standin.pkg.top_k_renorm_prob(probs.to(device), ks.to(device))
    assert got.dtype == torch.float32 and got.device.type == device
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-6, rtol=1e-6)
    assert int((got[0] > 0).sum()) == 5 and int((got[4] > 0).sum()) == 50
    # a plain int applies to every row
    want3 = _renorm_ref(probs, lambda r, desc: desc[2])
    torch.testing.assert_close(standin.pkg.top_k_renorm_prob(probs.to(device), 3).double().cpu(), want3,
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_renorm_prob_matches_reference(standin, device):
    g = torch.Generator().manual_seed(7)
    probs = _random_probs(g, 6, 50)
    ps = torch.tensor([0.5, 0.05, 0.3, 0.9, 1.0, 0.75])

    def nucleus_pivot(r, desc):
        """The smallest value of the shortest descending prefix holding mass >= p (all if none)."""
        mass = 0.0
        for v in desc:
            mass += v
            if mass >= float(ps[r]):
                return v
        return desc[-1]

    want = _renorm_ref(probs, nucleus_pivot)
    got = standin.pkg.top_p_renorm_prob(probs.to(device), ps.to(device))
    assert got.dtype == torch.float32 and got.device.type == device
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-6, rtol=1e-6)
    assert int((got[4] > 0).sum()) == 50  # p = 1 keeps everything
    assert 1 <= int((got[1] > 0).sum()) < 50
    want_float = _renorm_ref(probs, lambda r, desc: nucleus_pivot(0, desc))  # a float applies to every row
    torch.testing.assert_close(standin.pkg.top_p_renorm_prob(probs.to(device), 0.5).double().cpu(), want_float,
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool])
def test_weak_ref_tensor_aliases_without_owning(standin, device, dtype):
    from torch.multiprocessing.reductions import StorageWeakRef

    base = torch.randint(0, 2, (5, 8)).to(dtype).to(device)
    view = base.t()[2:6]  # non-contiguous, with a storage offset
    weak = standin.pkg.weak_ref_tensor(view)
    assert (weak.shape, weak.stride(), weak.storage_offset(), weak.dtype, weak.device) == (
        view.shape, view.stride(), view.storage_offset(), view.dtype, view.device)
    assert weak.data_ptr() == view.data_ptr() and torch.equal(weak, view)
    weak[1, 3] = 1 - view[1, 3] if dtype != torch.bool else ~view[1, 3]
    assert torch.equal(weak, view)  # the same memory, both ways
    owner = StorageWeakRef(base.untyped_storage())
    del base, view
    assert owner.expired(), "weak_ref_tensor kept its tensor's memory alive"
    del weak  # never read: its memory is gone
    assert standin.pkg.weak_ref_tensor(torch.empty(0, 3, device=device)).shape == (0, 3)


def test_is_arch_support_pdl_follows_the_device(standin):
    """Hopper (compute capability 9.0) and later; False without CUDA."""
    want = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    assert standin.utils.is_arch_support_pdl() is want


@pytest.mark.parametrize("module,name", PLACEHOLDERS)
def test_placeholders_raise_naming_the_op(standin, module, name):
    fn = getattr(getattr(standin, module) if module else standin.pkg, name)
    qualified = f"sgl_kernel.{module + '.' if module else ''}{name}"
    with pytest.raises(NotImplementedError, match=qualified.replace(".", r"\.") + " "):
        fn(torch.zeros(2, 2), torch.zeros(2, 2))


def test_copy_all_layer_kv_cache_cpu_refuses_device_addresses(standin):
    """It reads raw addresses through ctypes: device addresses must be refused, not dereferenced."""
    ptrs = torch.zeros(2, dtype=torch.uint64, device="meta")
    with pytest.raises(ValueError, match="host memory only"):
        standin.pkg.copy_all_layer_kv_cache_cpu(ptrs, torch.tensor([8, 8]), torch.tensor([0]), torch.tensor([1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cpu_helpers_run_on_cuda_tensors(standin):
    """The *_cpu helpers (SGLang's CPU engine calls them) are plain torch: on CUDA tensors they give
    what they give on CPU (copy_all_layer_kv_cache_cpu excepted: host addresses only)."""
    k = standin.pkg
    g = torch.Generator().manual_seed(8)

    def both(fn, *args, **kwargs):
        """fn on CPU tensors and on CUDA copies; the (mutated) tensor arguments of each run."""
        runs = []
        for dev in ("cpu", "cuda"):
            moved = [a.clone().to(dev) if isinstance(a, torch.Tensor) else a for a in args]
            fn(*moved, **kwargs)
            runs.append([a.cpu() for a in moved if isinstance(a, torch.Tensor)])
        return runs

    def same(runs):
        assert all(torch.equal(a, b) for a, b in zip(*runs))

    rpi, start, end = torch.tensor([2, 0]), torch.tensor([1, 3]), torch.tensor([4, 5])
    r2t, loc = torch.randint(0, 99, (3, 8), generator=g, dtype=torch.int32), torch.arange(10, 15)
    same(both(k.assign_req_to_token_pool_cpu, rpi, r2t, start, end, loc, 8))
    same(both(k.assign_extend_cache_locs_cpu, rpi, r2t, start, end, torch.zeros(5, dtype=torch.int64), 8))
    same(both(k.assign_draft_cache_locs_contiguous_cpu, rpi, r2t, torch.tensor([1, 2]),
              torch.zeros(6, dtype=torch.int64), 8, 1, 3))
    same(both(k.fill_bonus_tokens_cpu, torch.arange(12).view(3, 4), torch.tensor([1, 4, 2]),
              torch.zeros(3, dtype=torch.int32), 4))
    same(both(k.fill_accept_out_cache_loc_cpu, torch.tensor([[0, 2, -1], [4, -1, -1]], dtype=torch.int32),
              torch.arange(100, 106), torch.zeros(6, dtype=torch.int64)))
    same(both(k.rotate_input_ids_cpu, torch.arange(9), torch.tensor([0, 4]), torch.tensor([4, 5]),
              torch.tensor([70, 80])))
    # a two-level tree per request: root 0 -> {1, 2}, 1 -> {3}
    cand = torch.tensor([[5, 7, 8, 9], [5, 6, 8, 9]])
    ridx = torch.arange(8).view(2, 4)
    rnext, rsib = torch.tensor([[1, 3, -1, -1]] * 2), torch.tensor([[-1, 2, -1, -1]] * 2)
    target = torch.tensor([[7, 9, 1, 2], [8, 3, 4, 5]])
    runs = both(k.verify_tree_greedy_cpu, torch.zeros(8, dtype=torch.int32), torch.full((2, 3), -1, dtype=torch.int32),
                torch.zeros(2, dtype=torch.int32), cand, ridx, rnext, rsib, target)
    same(runs)
    assert runs[1][2].tolist() == [2, 1]  # request 0 accepts 7 then 9; request 1 accepts 8
    parent_list, selected = torch.tensor([[-1, 0, 1], [-1, 1, 0]]), torch.tensor([[0, 1, 2], [0, 1, 3]])
    for mode in (0, 1):
        numel = (2 * 4 * 4 + 4 * (3 + 5)) if mode == 0 else 2 * 4 * 4
        same(both(k.build_tree_kernel_efficient_cpu, parent_list, selected, torch.tensor([3, 5]),
                  torch.zeros(numel, dtype=torch.bool), torch.zeros(8, dtype=torch.int64),
                  torch.zeros(2, 4, dtype=torch.int64), torch.full((2, 4), -1), torch.full((2, 4), -1), 2, 3, 4, mode))
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool).repeat(2, 1)
    same(both(k.speculative.reconstruct_indices_from_tree_mask, mask.flatten(), torch.tensor([3, 5]),
              torch.zeros(8, dtype=torch.int64), *(torch.zeros(2, 4, dtype=torch.int64) for _ in range(3)), 2, 4))


# SGLang's modules a dense Qwen3 / Llama server (triton attention, MFD, CUDA graphs) loads on CUDA, and
# those whose CUDA branch binds sgl_kernel names; importing them pulls in the rest.
CUDA_SERVER_MODULES = [
    "sglang.srt.entrypoints.http_server", "sglang.srt.entrypoints.engine", "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tp_worker", "sglang.srt.managers.detokenizer_manager", "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.model_executor.model_runner", "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner", "sglang.srt.model_executor.runner.eager_runner",
    "sglang.srt.model_executor.runner_backend.full_cuda_graph_backend",
    "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend",
    "sglang.srt.model_executor.runner_backend_utils.weak_ref_tensor",
    "sglang.srt.model_executor.model_runner_components.cuda_graph_setup",
    "sglang.srt.model_executor.model_runner_components.attention_backend_setup", "sglang.srt.model_loader.loader",
    "sglang.srt.models.qwen3", "sglang.srt.models.qwen2", "sglang.srt.models.llama",
    "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.attention.attention_registry",
    "sglang.srt.layers.sampler", "sglang.srt.layers.logits_processor", "sglang.srt.layers.layernorm",
    "sglang.srt.layers.activation", "sglang.srt.layers.rotary_embedding", "sglang.srt.layers.moe.fused_moe_triton",
    "sglang.srt.layers.quantization", "sglang.srt.layers.quantization.gguf", "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.memory_pool_host", "sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.allocation",
    "sglang.srt.speculative.eagle_worker_v2", "sglang.srt.speculative.eagle_utils", "sglang.srt.speculative.spec_utils",
    "sglang.srt.speculative.standalone_worker_v2", "sglang.srt.speculative.ngram_worker",
    "sglang.srt.speculative.dflash_worker_v2", "mfd_sglang.plugin", "mfd_sglang.serving.worker",
    "mfd_sglang.serving.verify_graph", "mfd_sglang.cuda_graph",
    # the GPU check's tree_mask section (benchmarks/tree_mask_check.py) builds on SGLang's attention test kit
    "sglang.test.kits.attention_unittest.attention_methods.dense_attention", "sglang.srt.runtime_context",
]

# Run with the stand-in first on the path: make SGLang believe it is on an H200, import the modules,
# then drive SGLang's own CUDA call sites (forward_cuda) with CPU tensors against its forward_native.
FORCED_CUDA_PROBE = FORCED_H200_IMPORTS + r"""
import sgl_kernel
from sglang.srt.utils import is_cuda
from sglang.srt.layers import activation, layernorm

out = {"standin": sgl_kernel.__file__, "is_cuda": is_cuda(), "failures": failures,
       "bound": layernorm.fused_add_rmsnorm is sgl_kernel.fused_add_rmsnorm
                and activation._sgl_silu_and_mul is sgl_kernel.silu_and_mul}
g = torch.Generator().manual_seed(0)
x, res = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
diffs = {}
for cls in (layernorm.RMSNorm, layernorm.GemmaRMSNorm):
    norm = cls(16, eps=1e-6)
    norm.weight.data.copy_(torch.randn(16, generator=g))
    diffs[cls.__name__] = (norm.forward_cuda(x.clone()) - norm.forward_native(x.clone())).abs().max().item()
    got_x, got_res = norm.forward_cuda(x.clone(), res.clone())  # in place: the kernel's (input, residual)
    want_x, want_res = norm.forward_native(x.clone(), res.clone())
    diffs[cls.__name__ + "+residual"] = max((got_x - want_x).abs().max().item(),
                                            (got_res - want_res).abs().max().item())
# 7 fp32 columns: not a multiple of the JIT kernel's 16-byte vector, so SGLang takes sgl_kernel's op
gate_up = torch.randn(5, 14, generator=g)
act = activation.SiluAndMul()
diffs["SiluAndMul"] = (act.forward_cuda(gate_up) - act.forward_native(gate_up)).abs().max().item()
out["diffs"] = diffs
print(json.dumps(out))
"""


def test_sglang_cuda_modules_import_with_the_standin_and_its_call_sites_match_forward_native():
    """With torch.cuda.is_available forced true, every module a dense CUDA server loads imports
    against the stand-in (no missing sgl_kernel name), SGLang's CUDA branches bound the stand-in's
    ops, and its forward_cuda call sites give what its forward_native gives."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STANDIN_DIR), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    proc = subprocess.run([sys.executable, "-c", FORCED_CUDA_PROBE, json.dumps(CUDA_SERVER_MODULES)], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert str(STANDIN_DIR) in out["standin"]
    assert out["is_cuda"], "forcing CUDA did not take: SGLang took its non-CUDA branches"
    assert not out["failures"], "\n".join(f"{m}:\n{tb}" for m, tb in out["failures"].items())
    assert out["bound"], "layernorm / activation did not bind the stand-in's ops"
    assert all(d < 1e-5 for d in out["diffs"].values()), out["diffs"]
    assert len(out["diffs"]) == 5


# ------------------------------------------------------------------------------------------------
# The comparisons (run in the subprocess)
# ------------------------------------------------------------------------------------------------


def _random_req_to_token(g, num_rows, pool_len, dtype):
    import torch

    return torch.randint(0, 10_000, (num_rows, pool_len), generator=g, dtype=torch.int64).to(dtype)


def _case_assign(g, bs, pool_len, num_rows, max_len, reverse: bool):
    """(reverse False) assign_req_to_token_pool; (reverse True) assign_extend_cache_locs."""
    import torch

    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool
    from sglang.srt.utils import next_power_of_2

    import sgl_kernel

    rpi = torch.randperm(num_rows, generator=g)[:bs].to(torch.int64)
    start = torch.randint(0, pool_len - max_len, (bs,), generator=g, dtype=torch.int64)
    lens = torch.randint(0, max_len + 1, (bs,), generator=g, dtype=torch.int64)
    end = start + lens
    total = int(lens.sum())
    if not reverse:
        r2t_a = _random_req_to_token(g, num_rows, pool_len, torch.int32)
        r2t_b = r2t_a.clone()
        loc = torch.randint(0, 10_000, (total + 3,), generator=g, dtype=torch.int64)
        assign_req_to_token_pool[(bs,)](rpi, r2t_a, start, end, loc, pool_len, next_power_of_2(bs))
        sgl_kernel.assign_req_to_token_pool_cpu(rpi, r2t_b, start, end, loc, pool_len)
        return torch.equal(r2t_a, r2t_b)
    r2t = _random_req_to_token(g, num_rows, pool_len, torch.int32)
    out_a = torch.full((total + 3,), -7, dtype=torch.int64)
    out_b = out_a.clone()
    assign_extend_cache_locs[(bs,)](rpi, r2t, start, end, out_a, pool_len, next_power_of_2(bs))
    sgl_kernel.assign_extend_cache_locs_cpu(rpi, r2t, start, end, out_b, pool_len)
    return torch.equal(out_a, out_b)


def _case_draft_locs(g, bs, topk, steps, pool_len, num_rows):
    import torch

    from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous

    import sgl_kernel

    rpi = torch.randperm(num_rows, generator=g)[:bs].to(torch.int64)
    r2t = _random_req_to_token(g, num_rows, pool_len, torch.int32)
    seq = torch.randint(1, pool_len - topk * steps, (bs,), generator=g, dtype=torch.int64)
    out_a = torch.full((bs * topk * steps + 2,), -7, dtype=torch.int64)
    out_b = out_a.clone()
    assign_draft_cache_locs_contiguous[(bs,)](rpi, r2t, seq, out_a, pool_len, topk, steps, BS=bs)
    sgl_kernel.assign_draft_cache_locs_contiguous_cpu(rpi, r2t, seq, out_b, pool_len, topk, steps)
    return torch.equal(out_a, out_b)


def _case_copy_kv(g, num_layers, num_slots, row_shape, dtype, num_locs):
    import torch

    from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_tiled

    import sgl_kernel

    state = torch.randint(0, 2**31 - 1, (1,), generator=g)
    src = torch.randperm(num_slots, generator=g)[:num_locs].to(torch.int64)
    tgt = torch.randperm(num_slots, generator=g)[:num_locs].to(torch.int64)
    results = []
    for impl in ("triton", "standin"):
        torch.manual_seed(int(state))
        bufs = [torch.randn((num_slots, *row_shape)).to(dtype) for _ in range(2 * num_layers)]
        ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
        strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in bufs])
        if impl == "triton":
            upper = 1
            while upper < num_locs:
                upper *= 2
            stride_bytes = int(strides[0])
            bytes_per_tile = 512
            copy_all_layer_kv_cache_tiled[(len(bufs), (stride_bytes + bytes_per_tile - 1) // bytes_per_tile)](
                ptrs, strides, tgt, src, num_locs, upper, BYTES_PER_TILE=bytes_per_tile
            )
        else:
            sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
        results.append([b.clone() for b in bufs])
    # and the semantics themselves: every target row holds its source row's old value
    torch.manual_seed(int(state))
    ref = [torch.randn((num_slots, *row_shape)).to(dtype) for _ in range(2 * num_layers)]
    for b in ref:
        b[tgt] = b[src].clone()
    return all(torch.equal(x, y) and torch.equal(x, r) for x, y, r in zip(*results, ref))


def _case_bonus(g, bs, stride):
    import torch

    from sglang.kernels.ops.speculative.eagle import fill_bonus_tokens

    import sgl_kernel

    tokens = torch.randint(0, 5000, (bs, stride), generator=g, dtype=torch.int64)
    lens = torch.randint(1, stride + 1, (bs,), generator=g, dtype=torch.int32)
    a = torch.full((bs,), -1, dtype=torch.int32)
    b = a.clone()
    fill_bonus_tokens[(bs,)](tokens, lens, a, stride)
    sgl_kernel.fill_bonus_tokens_cpu(tokens, lens, b, stride)
    return torch.equal(a, b)


def _case_accept_loc(g, bs, width, num_out):
    import torch

    from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc
    from sglang.srt.utils import next_power_of_2

    import sgl_kernel

    idx = torch.full((bs, width), -1, dtype=torch.int32)
    for b in range(bs):
        k = int(torch.randint(1, width + 1, (1,), generator=g))
        idx[b, :k] = torch.randperm(num_out, generator=g)[:k].to(torch.int32)
    loc = torch.randint(0, 10_000, (num_out,), generator=g, dtype=torch.int64)
    size = bs * width
    a = torch.zeros(size, dtype=torch.int64)
    b_ = a.clone()
    fill_accept_out_cache_loc[(size,)](idx, loc, a, next_power_of_2(size))
    sgl_kernel.fill_accept_out_cache_loc_cpu(idx, loc, b_)
    return torch.equal(a, b_)


def _case_rotate(g, bs, max_len, with_select):
    import torch

    from sglang.kernels.ops.speculative.multi_layer_eagle import rotate_input_ids_kernel

    import sgl_kernel

    lens = torch.randint(0, max_len + 1, (bs,), generator=g, dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    total = int(lens.sum()) + 2
    ids = torch.randint(0, 5000, (total,), generator=g, dtype=torch.int64)
    new = torch.randint(0, 5000, (bs,), generator=g, dtype=torch.int64)
    select = None
    if with_select:
        select = starts + torch.clamp(lens - 1, min=0)
        select = torch.where(lens > 1, starts + lens - 2, select)  # not always the last slot
    a, b = ids.clone(), ids.clone()
    rotate_input_ids_kernel[(bs,)](a, starts, lens, new, select, BLOCK_SIZE=4096 if with_select else 8)
    sgl_kernel.rotate_input_ids_cpu(b, starts, lens, new, select)
    return torch.equal(a, b)


def _random_eagle_selection(g, topk, depth, num_draft):
    """A valid EAGLE draft selection: parent_list [topk*(depth-1)+1] and selected_index
    [num_draft-1] as eagle_utils.organize_draft_results builds them (scores indexed over
    topk + (depth-1)*topk*topk candidates; a candidate at depth d>0 is child of a selected token
    from depth d-1, parent_list[1 + (d-1)*topk + j] naming that step's j-th kept token)."""
    import torch

    # candidates: depth 0 has topk (parent: root); depth d has topk*topk: (parent beam j, child c)
    # flat candidate id: d=0 -> c (0..topk-1); d>=1 -> topk + (d-1)*topk*topk + j*topk + c
    # kept beam at step d (the tokens parent_list refers to): top-k of that depth, here random.
    kept = [torch.randperm(topk, generator=g).tolist()]  # depth 0 beam = candidate ids
    for d in range(1, depth):
        ids = torch.randperm(topk * topk, generator=g)[:topk].tolist()
        kept.append([topk + (d - 1) * topk * topk + i for i in ids])
    parent_list = [-1]
    for d in range(depth - 1):
        parent_list += kept[d]
    # choose num_draft-1 candidates closed under parents
    chosen: set[int] = set()

    def parent_of(cand):
        if cand < topk:
            return None
        d = (cand - topk) // (topk * topk) + 1
        j = ((cand - topk) % (topk * topk)) // topk
        return kept[d - 1][j]

    pool = list(range(topk)) + [topk + (d - 1) * topk * topk + i for d in range(1, depth) for i in range(topk * topk)]
    order = torch.randperm(len(pool), generator=g).tolist()
    while len(chosen) < num_draft - 1:
        progressed = False
        for k in order:
            c = pool[k]
            if c in chosen:
                continue
            p = parent_of(c)
            if p is None or p in chosen:
                chosen.add(c)
                progressed = True
                break
        if not progressed:
            break
    selected = sorted(chosen)
    return parent_list, selected


def _case_build_tree(g, bs, topk, depth, num_draft, mode):
    import torch

    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton, TreeMaskMode

    import sgl_kernel

    parents, selected = [], []
    for _ in range(bs):
        p, s = _random_eagle_selection(g, topk, depth, num_draft)
        if len(s) < num_draft - 1:
            return None
        parents.append(p)
        selected.append(s)
    parent_list = torch.tensor(parents, dtype=torch.int64)
    sel = torch.tensor(selected, dtype=torch.int64).reshape(bs, num_draft - 1)
    seq = torch.randint(1, 20, (bs,), generator=g, dtype=torch.int64)
    if mode == TreeMaskMode.FULL_MASK:
        numel = int(seq.sum()) * num_draft + bs * num_draft * num_draft
    else:
        numel = bs * num_draft * num_draft
    outs = []
    for impl in ("triton", "standin"):
        mask = torch.ones(numel, dtype=torch.bool)
        pos = torch.full((bs * num_draft,), -5, dtype=torch.int64)
        ridx = torch.full((bs, num_draft), -5, dtype=torch.int64)
        rnext = torch.full((bs, num_draft), -1, dtype=torch.int64)
        rsib = torch.full((bs, num_draft), -1, dtype=torch.int64)
        args = (parent_list, sel, seq, mask, pos, ridx, rnext, rsib, topk, depth, num_draft, mode)
        if impl == "triton":
            sgl_build_tree_kernel_triton(*args)
        else:
            sgl_kernel.build_tree_kernel_efficient_cpu(*args[:-1], int(mode))
        outs.append((mask, pos, ridx, rnext, rsib))
    return all(torch.equal(x, y) for x, y in zip(*outs))


def _random_tree(g, n):
    """parents of nodes 1..n-1 (parents precede children) -> per node its parent index."""
    import torch

    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


def _case_verify(g, bs, num_draft, spec_tokens, vocab):
    import torch

    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton

    import sgl_kernel

    cand = torch.randint(0, vocab, (bs, num_draft), generator=g, dtype=torch.int64)
    ridx = torch.arange(bs * num_draft, dtype=torch.int64).reshape(bs, num_draft)
    rnext = torch.full((bs, num_draft), -1, dtype=torch.int64)
    rsib = torch.full((bs, num_draft), -1, dtype=torch.int64)
    for b in range(bs):
        par = _random_tree(g, num_draft)
        for i in range(num_draft - 1, 0, -1):  # same insertion order as the tree builder
            p = par[i]
            if rnext[b, p] != -1:
                rsib[b, i] = rnext[b, p]
            rnext[b, p] = i
    # targets agree with the tree often: copy a random child's token
    target = torch.randint(0, vocab, (bs, num_draft), generator=g, dtype=torch.int64)
    for b in range(bs):
        for i in range(num_draft):
            c = int(rnext[b, i])
            if c != -1 and torch.rand(1, generator=g) < 0.7:
                target[b, i] = cand[b, c]
    outs = []
    for impl in ("triton", "standin"):
        pred = torch.full((bs * num_draft,), -3, dtype=torch.int32)
        acc = torch.full((bs, spec_tokens), -1, dtype=torch.int32)
        num = torch.full((bs,), -1, dtype=torch.int32)
        if impl == "triton":
            verify_tree_greedy_triton(pred, acc, num, cand, ridx, rnext, rsib, target)
        else:
            sgl_kernel.verify_tree_greedy_cpu(
                predicts=pred, accept_index=acc, accept_token_num=num, candidates=cand,
                retrive_index=ridx, retrive_next_token=rnext, retrive_next_sibling=rsib, target_predict=target,
            )
        outs.append((pred, acc, num))
    return all(torch.equal(x, y) for x, y in zip(*outs)), int(outs[1][2].max())


def _case_reconstruct(g, bs, n):
    import torch

    from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_triton

    from sgl_kernel.speculative import reconstruct_indices_from_tree_mask

    mask = torch.zeros((bs, n, n), dtype=torch.bool)
    for b in range(bs):
        par = _random_tree(g, n)
        for i in range(n):
            j = i
            while j != -1:
                mask[b, i, j] = True
                j = par[j]
    seq = torch.randint(1, 50, (bs,), generator=g, dtype=torch.int64)
    outs = []
    for impl in ("triton", "standin"):
        pos = torch.full((bs * n,), -9, dtype=torch.int64)
        ridx, rnext, rsib = (torch.full((bs, n), -9, dtype=torch.int64) for _ in range(3))
        fn = reconstruct_indices_from_tree_mask_triton if impl == "triton" else reconstruct_indices_from_tree_mask
        fn(mask.reshape(-1), seq, pos, ridx, rnext, rsib, bs, n)
        outs.append((pos, ridx, rnext, rsib))
    return all(torch.equal(x, y) for x, y in zip(*outs))


def _check_hooks() -> dict:
    import torch

    import mfd_sglang.cpu as cpu
    from mfd_sglang.patches import full_mask
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.speculative import eagle_utils
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    problems = []
    if eagle_utils.default_tree_mask_mode() != TreeMaskMode.QLEN_ONLY:
        problems.append("precondition: stock default_tree_mask_mode() on the CPU engine is no longer QLEN_ONLY "
                        "(SGLang changed: re-check whether patches/full_mask.py is still needed)")
    os.environ.pop(cpu.ENV_FLAG, None)
    if cpu.install_if_requested() or full_mask.is_installed():
        problems.append("install_if_requested() installed without MFD_SGLANG_CPU=1")
    os.environ[cpu.ENV_FLAG] = "1"
    if not cpu.install_if_requested():
        problems.append("install_if_requested() did not install with MFD_SGLANG_CPU=1")
    cpu.install()  # idempotent
    n_hooks = {t: len(HookRegistry._hooks[t]) for t in (full_mask.DEFAULT_TREE_MASK_MODE, full_mask.NGRAM_PREPARE)}
    if any(v != 1 for v in n_hooks.values()):
        problems.append(f"hooks registered more than once: {n_hooks}")
    full_mask.install(apply=True)
    if eagle_utils.default_tree_mask_mode() != TreeMaskMode.FULL_MASK:
        problems.append("default_tree_mask_mode() is not FULL_MASK after install(apply=True)")
    from sglang.srt.layers.attention import verify_mask

    if verify_mask.default_tree_mask_mode() != TreeMaskMode.FULL_MASK:
        problems.append("verify_mask's by-name import of default_tree_mask_mode was not rebound")
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    if not hasattr(NGRAMWorker._prepare_for_speculative_decoding, "__wrapped__"):
        problems.append("NGRAMWorker._prepare_for_speculative_decoding is not wrapped")

    # QLEN_ONLY -> FULL_MASK, against the NGRAM worker's own GPU construction
    n, seq = 3, [2, 4]
    qlen = torch.rand(len(seq) * n * n) > 0.5
    blocks = qlen.reshape(len(seq), n, n)
    want = torch.cat([torch.cat((torch.ones(n, s, dtype=torch.bool), blocks[i]), 1).flatten() for i, s in enumerate(seq)])
    got = full_mask.qlen_to_full_mask(qlen, torch.tensor(seq), n)
    if not torch.equal(got, want):
        problems.append("qlen_to_full_mask layout differs")
    return {"ok": not problems, "cases": 1, "detail": "; ".join(problems)}


def _run_all() -> dict:
    import functools
    import traceback

    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1"
    import sgl_kernel

    assert getattr(sgl_kernel, "MFD_SGLANG_CPU_STANDIN", False), f"wrong sgl_kernel: {sgl_kernel.__file__}"
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode

    g = torch.Generator().manual_seed(1234)
    P = functools.partial
    cases = {
        "assign_req_to_token_pool_cpu": [
            P(_case_assign, g, bs, 64, 12, ml, False) for bs, ml in [(1, 5), (3, 33), (8, 17), (12, 1)]
        ],
        "assign_extend_cache_locs_cpu": [
            P(_case_assign, g, bs, 64, 12, ml, True) for bs, ml in [(1, 5), (3, 33), (8, 17), (12, 1)]
        ],
        "assign_draft_cache_locs_contiguous_cpu": [
            P(_case_draft_locs, g, bs, k, s, 40, 10) for bs, k, s in [(1, 1, 3), (4, 2, 3), (7, 4, 5)]
        ],
        "copy_all_layer_kv_cache_cpu": [
            P(_case_copy_kv, g, nl, 30, shape, dt, nlocs)
            for nl, shape, dt, nlocs in [
                (1, (2, 8), torch.float32, 1),
                (3, (4, 16), torch.float32, 7),
                (2, (1, 64), torch.bfloat16, 12),
            ]
        ],
        "fill_bonus_tokens_cpu": [P(_case_bonus, g, bs, st) for bs, st in [(1, 1), (3, 4), (9, 7)]],
        "fill_accept_out_cache_loc_cpu": [
            P(_case_accept_loc, g, bs, w, no) for bs, w, no in [(1, 3, 8), (4, 4, 32), (6, 8, 64)]
        ],
        "rotate_input_ids_cpu": [
            P(_case_rotate, g, bs, ml, sel) for bs, ml, sel in [(1, 5, False), (4, 20, False), (5, 9, True), (3, 1, True)]
        ],
        "verify_tree_greedy_cpu": [
            P(_case_verify, g, bs, nd, st, v) for bs, nd, st, v in [(1, 4, 4, 3), (3, 8, 5, 2), (5, 16, 8, 3), (2, 32, 12, 2)]
        ],
        "build_tree_kernel_efficient_cpu": [
            P(_case_build_tree, g, bs, k, d, nd, m)
            for bs, k, d, nd in [(1, 1, 3, 4), (2, 2, 3, 6), (3, 4, 4, 12), (2, 8, 2, 9)]
            for m in (TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY)
        ],
        "reconstruct_indices_from_tree_mask": [
            P(_case_reconstruct, g, bs, n) for bs, n in [(1, 1), (2, 4), (3, 8), (4, 19)]
        ],
    }
    verdicts: dict = {}
    for name, fns in cases.items():
        ok, ran, detail, extra = True, 0, "", []
        for k, fn in enumerate(fns):
            try:
                res = fn()
            except Exception:
                ok, detail = False, f"case {k} raised:\n{traceback.format_exc()}"
                break
            if res is None:
                continue
            if isinstance(res, tuple):
                res, info = res
                extra.append(info)
            ran += 1
            if not res:
                ok, detail = False, f"case {k}: outputs differ from the Triton twin"
                break
        if name == "verify_tree_greedy_cpu" and ok and max(extra, default=0) < 2:
            ok, detail = False, f"no case accepted 2+ tokens ({extra}); the test lost its teeth"
        verdicts[name] = {"ok": ok, "cases": ran, "detail": detail}

    try:
        verdicts["_full_mask_hooks"] = _check_hooks()
    except Exception:
        verdicts["_full_mask_hooks"] = {"ok": False, "cases": 0, "detail": traceback.format_exc()}
    verdicts["_torch_ops"] = {
        "registered": sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("sgl_kernel::")),
        "amx_probe": hasattr(torch.ops.sgl_kernel, "convert_weight_packed")}
    return verdicts


if __name__ == "__main__":
    result = _run_all()
    Path(sys.argv[1]).write_text(json.dumps(result, indent=1))
