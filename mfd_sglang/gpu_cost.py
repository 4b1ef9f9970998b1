"""GPU cost on a CPU: the kernels code launches on CUDA (traced on fake CUDA tensors), their minimum bytes
and FLOPs, Triton kernels' sm_90a / sm_80 compiles, and a predicted time from one fitted constant. What
the ledger (`gpu_ledger`) applies to a round's stages.

Tracing (`KernelTrace`). The serving code runs unchanged on fake CUDA tensors (`FakeTensorMode`: shapes,
dtypes and `is_cuda` of real CUDA tensors, no storage, no GPU), so every module takes its CUDA path: the
Triton tree and mode attention (their wrappers check `is_cuda`; `DraftStage` picks its backends from its
device), no host sync (a sync would raise on fake tensors). Three recorders run together:
  * aten ops (a `TorchDispatchMode`): each op that is not free (`FREE_OPS`) and writes at least one
    element is ONE kernel (a lower bound for ops that launch several, e.g. sort, topk, cumsum) with
    its minimum bytes (`aten_bytes`) and FLOPs (`aten_flops`); counted "traced";
  * Triton launches (`JITFunction.run` replaced while tracing): each `kernel[grid](...)` is one kernel
    with its real grid, arguments and constexprs, recorded instead of launched; counted "traced", its
    bytes and FLOPs "modelled" by `triton_bytes` / `triton_flops` (kernels that read a pool in place
    are charged the rows they read, not the pool);
  * `F.scaled_dot_product_attention` (a `TorchFunctionMode`): one fused attention kernel (on a GPU SDPA
    picks the memory-efficient / flash kernel; off a GPU torch would decompose it into its math
    path); counted "modelled", its bytes the inputs and the output, its FLOPs 4 * B * Hq * Lq * Lk * d.
Free ops (`FREE_OPS`): views and metadata (view, _unsafe_view, _reshape_alias, expand, t, transpose,
permute, select, slice, unsqueeze, squeeze, as_strided, detach, alias, split, split_with_sizes, chunk,
unbind, narrow, diagonal, unfold, lift_fresh, sym_* queries) and allocations without a fill (empty,
empty_like, empty_strided, new_empty, new_empty_strided).

Bytes and FLOPs of an aten op: every tensor input read once (an expanded input counts its distinct
elements) plus every output written; gathers (index, gather, index_select, embedding) read only the
rows they return; copy_ / fill_ / zero_ do not read their destination; in-place scatters (index_put_,
scatter_, scatter_add_, scatter_reduce_, index_copy_) write only their source's elements. FLOPs:
2 * M * N * K for mm / addmm / bmm / baddbmm / _scaled_mm (a batched product counts every batch), else
1 per element of the largest tensor involved.

Compiles (`compile_kernel`): a recorded Triton launch compiled with `triton.compile` for a target GPU
(Triton's bundled ptxas, no GPU needed) at the launch's own signature and constexprs; registers, local
memory (ptxas spills, and the 28-byte array of libdevice's sin / cos range reduction where a kernel calls
them: Triton keeps no local arrays of its own), shared memory
(Triton's dynamic allocation + the cubin's static), SASS instructions (cuobjdump) and its loops
(backward branches).

Issue-bound time (`issue_seconds`) of a Triton launch: the instructions one warp executes, each SASS
instruction counted once per trip of the innermost loop holding it (`SERIAL_LOOPS` gives the total trips
of each loop, in the order of their backward branches), at one instruction per clock per warp scheduler:
max(per program: warp instructions * ceil(warps / 4) / clock, whole grid: warp instructions * warps *
programs / (SMs * 4 * clock)). A lower bound: one warp per scheduler hides no latency.

Predicted time (`kernel_seconds`): per kernel max(bytes / HBM bandwidth, FLOPs / peak, issue-bound time,
launch floor); a stage is the sum of its kernels (CUDA graphs: launches back to back, no host gaps). The
one constant, the launch floor, is fitted (`fit_launch_floor`) to measured rows by least squares of the
relative error. H200: 4.8 TB/s, 990 TFLOPS bf16, 132 SMs, 1.98 GHz.
"""

from __future__ import annotations

import ast
import contextlib
import math
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

FREE_OPS = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "expand", "t", "transpose", "permute", "select", "slice",
    "unsqueeze", "squeeze", "as_strided", "detach", "alias", "split", "split_with_sizes", "chunk", "unbind",
    "narrow", "diagonal", "unfold", "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
})
GATHER_OPS = frozenset({"index", "gather", "index_select", "embedding"})
NO_DESTINATION_READ = frozenset({"copy_", "fill_", "zero_"})
SCATTER_INTO = frozenset({"index_put_", "scatter_", "scatter_add_", "scatter_reduce_", "index_copy_"})
MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})


@dataclass(frozen=True)
class DeviceModel:
    name: str
    hbm_bytes_per_s: float
    flops_per_s: float  # dense bf16 tensor-core peak
    sms: int
    clock_hz: float
    schedulers_per_sm: int = 4


H200 = DeviceModel("H200", 4.8e12, 990e12, sms=132, clock_hz=1.98e9)
H100 = DeviceModel("H100", 3.35e12, 989e12, sms=132, clock_hz=1.98e9)  # SXM: HBM3, dense bf16


@dataclass
class Kernel:
    """One kernel launch of a stage. source: "aten", "triton" or "sdpa"; counted: "traced" (recorded as it
    would launch) or "modelled" (one fused kernel standing for a composite op); issue_s: issue-bound time
    (Triton launches with a compile; 0 otherwise)."""

    name: str
    stage: str
    source: str
    counted: str
    bytes: int
    flops: int
    issue_s: float = 0.0
    launch: "TritonLaunch | None" = None


@dataclass
class TritonLaunch:
    """A recorded `kernel[grid](...)`: the JITFunction, its grid, its arguments by parameter name and its
    launch options (num_warps, ...); context_len: the tracing scenario's context length (pool reads)."""

    kernel: object
    grid: tuple
    args: dict
    options: dict
    context_len: int

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @property
    def programs(self) -> int:
        return math.prod(self.grid)

    @property
    def num_warps(self) -> int:
        return int(self.options.get("num_warps", 4))

    def constexprs(self) -> dict:
        return {p.name: self.args[p.name] for p in self.kernel.params if p.is_constexpr}

    def key(self) -> tuple:
        """What a compile depends on: kernel, constexprs, scalar types with Triton's specialization of them
        (`scalar_specialization`: an int equal to 1 a constexpr, one divisible by 16 marked so, unless the
        kernel does not specialize it) and options."""
        scalars = tuple((p.name, *scalar_specialization(p, value)) for p in self.kernel.params
                        if not p.is_constexpr and not torch.is_tensor(value := self.args[p.name]))
        return (self.name, tuple(sorted(self.constexprs().items())), scalars, tuple(sorted(self.options.items())))


# --- bytes and FLOPs ------------------------------------------------------------------------------------

def _tensors(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's distinct elements (an expanded dim, stride 0, counts once)."""
    return t.element_size() * math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0)


def aten_bytes(name: str, args, kwargs, outputs: list[torch.Tensor]) -> int:
    """Minimum bytes an aten op moves (see the module docstring)."""
    inputs = _tensors(list(args) + list(kwargs.values()))
    written = sum(t.numel() * t.element_size() for t in outputs)
    if name in GATHER_OPS:  # the source (first tensor) is read only where gathered: the output's size
        return sum(distinct_bytes(t) for t in inputs[1:]) + 2 * written
    if name in NO_DESTINATION_READ:
        return sum(distinct_bytes(t) for t in inputs[1:]) + written
    if name in SCATTER_INTO:
        rest = inputs[1:]
        source = max((distinct_bytes(t) for t in rest if t.is_floating_point()), default=0) or max(
            (distinct_bytes(t) for t in rest), default=0)
        return sum(distinct_bytes(t) for t in rest) + source
    return sum(distinct_bytes(t) for t in inputs) + written


def aten_flops(name: str, args, outputs: list[torch.Tensor]) -> int:
    """2 * M * N * K for the matrix products, else one per element of the largest tensor involved."""
    if name in MATMULS:
        a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
        return 2 * a.numel() * b.shape[-1]  # a [.., M, K] @ b [.., K, N]
    return max((t.numel() for t in _tensors(list(args)) + outputs), default=0)


def attention_cost(q, k, v, mask) -> tuple[int, int]:
    """(bytes, FLOPs) of one fused attention kernel: q, k, v, the mask read once, the output written."""
    out_bytes = q.numel() // q.shape[-1] * v.shape[-1] * q.element_size()
    read = sum(distinct_bytes(t) for t in (q, k, v)) + (distinct_bytes(mask) if torch.is_tensor(mask) else 0)
    batch_heads_queries = q.numel() // q.shape[-1]
    return read + out_bytes, 2 * batch_heads_queries * k.shape[-2] * (q.shape[-1] + v.shape[-1])


def triton_bytes(launch: TritonLaunch) -> int:
    """Every tensor argument once, except the tables read in part: `_mode_attention_kernel` reads each
    request's context rows (context_len per request and kv head) of PK / PV and req_to_token;
    `_block_input_kernel` two embedding rows per request (its root's, the mask's); `_commit_rows_kernel` the
    committed rows of the window's features."""
    args = launch.args

    def whole(*names):
        return sum(args[n].numel() * args[n].element_size() for n in names)

    if launch.name == "_block_input_kernel":
        embed = args["embed_ptr"]
        return 2 * args["roots_ptr"].numel() * embed.shape[1] * embed.element_size() + whole(
            "roots_ptr", "starts_ptr", "modes_ptr", "norm_ptr", "x_ptr", "normed_ptr", "positions_ptr")
    if launch.name == "_commit_rows_kernel":
        return 2 * whole("rows_ptr") + whole("accepted_ptr", "seq_lens_ptr", "path_ptr", "positions_ptr")
    if launch.name == "_mode_attention_kernel":
        bs, kv_heads = args["Q"].shape[0], args["BK"].shape[1]
        rows = bs * launch.context_len
        pool = 2 * rows * kv_heads * args["HEAD_DIM"] * args["PK"].element_size()
        return pool + rows * args["REQ_TO_TOKEN"].element_size() + whole("Q", "BK", "BV", "OUT", "REQ_IDX", "CTX_LENS")
    return sum(t.numel() * t.element_size() for t in args.values() if torch.is_tensor(t))


def triton_flops(launch: TritonLaunch) -> int:
    """The tensor-core products: mode attention (QK^T and PV over context + block), the fused lm_head."""
    args = launch.args
    if launch.name == "_mode_attention_kernel":
        bs, heads, rows, dim = args["Q"].shape
        return 4 * bs * heads * rows * (launch.context_len + rows) * dim
    if launch.name == "_vocab_top_kernel":
        return 2 * args["n_rows"] * args["V"] * args["H"]
    return 0


# --- tracing --------------------------------------------------------------------------------------------

class _AtenRecorder(TorchDispatchMode):
    def __init__(self, trace: "KernelTrace"):
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace == "aten" and name not in FREE_OPS:
            outputs = _tensors(out)
            if name.endswith("_") and not outputs and args and torch.is_tensor(args[0]):
                outputs = [args[0]]
            if any(t.numel() for t in outputs):
                self.trace.add(Kernel(name, self.trace.current, "aten", "traced", aten_bytes(name, args, kwargs, outputs),
                                      aten_flops(name, args, outputs)))
        return out


class _FusedAttention(TorchFunctionMode):
    def __init__(self, trace: "KernelTrace"):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        moved, flops = attention_cost(q, k, v, mask)
        self.trace.add(Kernel("scaled_dot_product_attention", self.trace.current, "sdpa", "modelled", moved, flops))
        return q.new_empty(*q.shape[:-1], v.shape[-1])


class KernelTrace:
    """Records the CUDA kernels of code run on fake CUDA tensors, per stage (`stage(name)`).

        with KernelTrace(context_len=512) as trace:   # fake CUDA mode, all three recorders on
            with trace.stage("draft"):
                ...
        trace.kernels  # [Kernel]

    Tensors made inside are fake (no storage); make a scenario's inputs inside too."""

    def __init__(self, context_len: int = 0):
        self.context_len = context_len
        self.kernels: list[Kernel] = []
        self.current: str | None = None  # kernels run outside every stage (set-up) are not recorded
        self._stack = contextlib.ExitStack()

    def add(self, kernel: Kernel) -> None:
        if self.current is not None:
            self.kernels.append(kernel)

    @contextlib.contextmanager
    def stage(self, name: str):
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    def labelled(self, name: str, fn: Callable) -> Callable:
        """fn, its kernels counted under stage `name` (to split a stage the serving code calls inside another)."""
        def run(*args, **kwargs):
            with self.stage(name):
                return fn(*args, **kwargs)
        return run

    def _record_launch(self, jit_fn, *args, grid, warmup, **kwargs):
        names = [p.name for p in jit_fn.params]
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        for p in jit_fn.params:
            if p.name not in bound and p.has_default:
                bound[p.name] = p.default
        options = {k: v for k, v in kwargs.items() if k not in names}
        grid = grid(bound) if callable(grid) else grid
        launch = TritonLaunch(jit_fn, tuple(int(g) for g in grid), bound, options, self.context_len)
        self.add(Kernel(launch.name, self.current, "triton", "traced", triton_bytes(launch), triton_flops(launch),
                        launch=launch))

    def __enter__(self) -> "KernelTrace":
        from torch._subclasses.fake_tensor import FakeTensorMode
        from triton.runtime.jit import JITFunction

        trace = self

        def run(jit_fn, *args, grid, warmup, **kwargs):
            trace._record_launch(jit_fn, *args, grid=grid, warmup=warmup, **kwargs)

        stack = self._stack
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=False))
        stack.enter_context(patched(JITFunction, "run", run))
        stack.enter_context(_FusedAttention(self))
        stack.enter_context(_AtenRecorder(self))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


@contextlib.contextmanager
def patched(owner, name: str, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


# --- Triton compiles ------------------------------------------------------------------------------------

_TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
                  torch.int32: "i32", torch.uint8: "u8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}
# Per-block shared memory limits (opt-in maximum): sm_90 227 KB, sm_80 163 KB.
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}


def scalar_specialization(param, value) -> tuple[str, object]:
    """(type, specialization) of a scalar argument of kernel parameter `param` as Triton's launcher makes them:
    ("constexpr", 1) for an int equal to 1, "D" for one divisible by 16, "" otherwise, None for floats, bools
    and parameters the kernel does not specialize (`@triton.jit(do_not_specialize=...)`)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    return tuple(native_specialize_impl(BaseBackend, value, param.is_const, not param.do_not_specialize,
                                        not param.do_not_specialize_on_alignment))


def compile_signature(launch: TritonLaunch) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of a launch as Triton's launcher specializes it: pointers marked divisible
    by 16 (CUDA allocations are 256-byte aligned), scalars as `scalar_specialization` (ints equal to 1
    constexpr, divisible by 16 marked so, where the kernel specializes them)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(launch.kernel.params):
        value = launch.args[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
        elif torch.is_tensor(value):
            signature[p.name] = "*" + _TRITON_DTYPES[value.dtype]
            if not p.do_not_specialize_on_alignment:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            kind, spec = scalar_specialization(p, value)
            signature[p.name] = kind
            if kind == "constexpr":
                constexprs[p.name] = value
            elif spec == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


@dataclass
class CompiledLaunch:
    """A launch's compile for one GPU arch (`compile_kernel`)."""

    name: str
    arch: int
    registers: int
    local_bytes: int  # ptxas spills, libdevice sin / cos's range-reduction array
    shared_bytes: int  # Triton's dynamic allocation + the cubin's static shared memory
    sass_instructions: int
    loops: list[tuple[int, int]] = field(default_factory=list)  # (first, last) instruction of each loop
    instructions: list[int] = field(default_factory=list)  # instruction addresses / 16, in order

    @property
    def shared_limit(self) -> int:
        return SHARED_LIMIT[self.arch]


def _nvidia_tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compile_kernel(launch: TritonLaunch, arch: int, sass: bool = True) -> CompiledLaunch:
    """Compile a recorded launch for sm_<arch> (90: sm_90a) with Triton's bundled ptxas; resources from
    `cuobjdump -res-usage`, SASS from `cuobjdump -sass` (sass False: not disassembled, no instructions or
    loops; the disassembly takes ~0.4-1 s a kernel, a few ms the resources). Triton caches compiles
    (~/.triton/cache)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = compile_signature(launch)
    source = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {k: v for k, v in launch.options.items() if k in ("num_warps", "num_stages")}
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_nvidia_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout if sass else ""
    resources = dict(re.findall(r"(REG|SHARED|LOCAL|STACK):(\d+)", usage))
    addresses, loops = [], []
    for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass):
        index = int(address, 16) // 16
        addresses.append(index)
        branch = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) // 16 < index:
            loops.append((int(branch.group(1), 16) // 16, index))
    return CompiledLaunch(launch.name, arch, int(resources["REG"]), int(resources["LOCAL"]) + int(resources["STACK"]),
                          compiled.metadata.shared + int(resources["SHARED"]), len(addresses), loops, addresses)


SERVED_TREE_DEPTH = 15  # the deepest tree of a block-16 drafter (Qwen3 DFlash drafters): the walks' trips

# Total trips of each loop of a kernel (in the order of their backward branches in SASS), for the issue-bound
# estimate: kernel name -> (what the loops are, launch -> [trips]).
SERIAL_LOOPS: dict[str, tuple[str, Callable[[TritonLaunch], list[int]]]] = {
    "_merge_select_kernel": (
        "the depth loop d < D (each a sort of the M entries by prefix); then the selection over T = D * M "
        "entries in TILE_G tiles",
        lambda l: [l.args["D"], -(-l.args["D"] * l.args["K"] * l.args["B"] // l.args["TILE_G"])]),
    "_beam_kernel": ("the depth loop d < D (each two merges of the candidates that can rank)",
                     lambda l: [l.args["D"]]),
    "_vocab_topk_kernel": ("the vocabulary tiles of one row", lambda l: [-(-l.args["V"] // l.args["TILE_V"])]),
    "_mode_attention_kernel": ("the context tiles of BLOCK_N rows", lambda l: [-(-l.context_len // l.args["BLOCK_N"])]),
    "_vocab_top_kernel": (
        "per vocabulary tile of the split (outer): the hidden chunks of BLOCK_H (inner)",
        lambda l: [l.args["tiles_per_split"] * -(-l.args["H"] // l.args["BLOCK_H"]), l.args["tiles_per_split"]]),
    "_vocab_finish_kernel": ("the row's splits x BB keys in tiles of TILE",
                             lambda l: [-(-l.args["n_keys"] // l.args["TILE"])]),
    "_quantize_rows_kernel": ("the row's two passes of BLOCK columns",
                              lambda l: [-(-l.args["K"] // l.args["BLOCK"])] * 2),
    "_verify_layout_kernel": ("the walk up the parent links: the tree's depth, at most the drafter's block - 1 "
                              f"({SERVED_TREE_DEPTH} at the served shapes)", lambda l: [SERVED_TREE_DEPTH]),
    "_accept_path_kernel": ("the walk up the parent links (as the layout's)", lambda l: [SERVED_TREE_DEPTH]),
}


def warp_instructions(compiled: CompiledLaunch, trips: list[int]) -> int | None:
    """Instructions one warp of a program executes: each SASS instruction once per trip of the innermost
    loop holding it (trips: total trips per loop, in `compiled.loops` order); None when the SASS's loops
    are not the listed ones (a compiler change: the estimate needs a look)."""
    if len(trips) != len(compiled.loops):
        return None
    total = 0
    for index in compiled.instructions:
        holding = [(last - first, t) for (first, last), t in zip(compiled.loops, trips) if first <= index <= last]
        total += min(holding)[1] if holding else 1
    return total


def issue_seconds(launch: TritonLaunch, compiled: CompiledLaunch, device: DeviceModel = H200) -> float | None:
    """The issue-bound time of a launch (module docstring), None without a loop table for its kernel."""
    if launch.name not in SERIAL_LOOPS:
        return None
    per_warp = warp_instructions(compiled, SERIAL_LOOPS[launch.name][1](launch))
    if per_warp is None:
        return None
    warps = launch.num_warps
    per_program = per_warp * -(-warps // device.schedulers_per_sm) / device.clock_hz
    grid = per_warp * warps * launch.programs / (device.sms * device.schedulers_per_sm * device.clock_hz)
    return max(per_program, grid)


# --- the cost model and its fit -------------------------------------------------------------------------

def kernel_seconds(k: Kernel, floor_s: float, device: DeviceModel = H200) -> float:
    return max(k.bytes / device.hbm_bytes_per_s, k.flops / device.flops_per_s, k.issue_s, floor_s)


def roofline_seconds(kernels: list[Kernel], device: DeviceModel = H200) -> np.ndarray:
    """Each kernel's time before the launch floor: max(bytes / bandwidth, FLOPs / peak, issue-bound)."""
    return np.array([kernel_seconds(k, 0.0, device) for k in kernels])


def predicted_seconds(roofline: np.ndarray, floor_s: float) -> float:
    return float(np.maximum(roofline, floor_s).sum())


def fit_launch_floor(rows: list[tuple[np.ndarray, float]], *, lo: float = 0.0, hi: float = 20e-6) -> float:
    """The launch floor f minimising sum over rows of ((sum_i max(t_i, f) - measured) / measured)^2; rows:
    (per-kernel roofline seconds, measured seconds). A grid of 0.01 us, then a golden-section refinement."""
    def loss(f: float) -> float:
        return sum(((predicted_seconds(t, f) - m) / m) ** 2 for t, m in rows)

    grid = np.arange(lo, hi, 1e-8)
    best = float(grid[int(np.argmin([loss(f) for f in grid]))])
    a, b = max(lo, best - 1e-8), min(hi, best + 1e-8)
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        a, b = (a, d) if loss(c) <= loss(d) else (c, b)
    return (a + b) / 2


def log_rows(path: Path) -> list[dict]:
    """The 'round' rows of a GPU check log (one Python dict literal per line)."""
    rows = []
    for line in path.read_text().splitlines():
        if line.startswith("{'kind': 'round'"):
            rows.append(ast.literal_eval(line))
    return rows


def summarize(kernels: list[Kernel], floor_s: float, device: DeviceModel = H200) -> dict:
    """Launches, bytes, FLOPs and predicted ms of kernels; launches per kernel name."""
    names: dict[str, int] = {}
    for k in kernels:
        names[k.name] = names.get(k.name, 0) + 1
    return {"launches": len(kernels), "bytes": sum(k.bytes for k in kernels), "flops": sum(k.flops for k in kernels),
            "ms": round(1e3 * sum(kernel_seconds(k, floor_s, device) for k in kernels), 4),
            "floor_bound_launches": sum(kernel_seconds(k, 0.0, device) < floor_s for k in kernels),
            "by_kernel": dict(sorted(names.items(), key=lambda kv: -kv[1]))}


def by_stage(kernels: list[Kernel]) -> dict[str, list[Kernel]]:
    stages: dict[str, list[Kernel]] = {}
    for k in kernels:
        stages.setdefault(k.stage, []).append(k)
    return stages


def triton_launches(kernels: list[Kernel]) -> Iterator[TritonLaunch]:
    return (k.launch for k in kernels if k.launch is not None)


def attach_issue_times(kernels: list[Kernel], compiles: dict, device: DeviceModel = H200, arch: int = 90) -> None:
    """Set each Triton kernel's issue-bound time from its sm_<arch> compile (compiles: launch key -> compile,
    filled as needed)."""
    for k in kernels:
        if k.launch is None:
            continue
        key = (k.launch.key(), arch)
        if key not in compiles:
            compiles[key] = compile_kernel(k.launch, arch)
        k.issue_s = issue_seconds(k.launch, compiles[key], device) or 0.0
