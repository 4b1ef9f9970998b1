"""Triton's compile keys of the kernels a piece of code launches, on fake CUDA tensors (no GPU): `CompileKeys`
records, per launch, the key Triton's JIT looks its compiled kernels up by (`JITFunction.run`: its binder's
specialisation of every argument, constexprs included, and the launch options), so a test can count the
compiles a run would trigger on a GPU.

The binder is Triton's own for an sm_90 target; a tensor is specialised by its dtype and its pointer's alignment,
here its storage offset's (a CUDA allocation starts 256-byte aligned), integers by their type, by equality to 1
and by divisibility by 16 (unless the kernel says `do_not_specialize`). Launches run nothing: outputs stay fake.
"""

from __future__ import annotations

import collections
import contextlib

import torch


class _Pointer:
    """What Triton's specialisation reads of a tensor argument: its dtype and data pointer."""

    def __init__(self, tensor: torch.Tensor):
        self.dtype = tensor.dtype
        self._offset = tensor.storage_offset() * tensor.element_size()

    def data_ptr(self) -> int:
        return 256 + self._offset


def _pointers(value):
    return _Pointer(value) if isinstance(value, torch.Tensor) else value


class CompileKeys:
    """with CompileKeys() as keys: ... -> keys.seen: {kernel name: {compile key: launches}} (fake CUDA mode)."""

    def __init__(self):
        self.seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._binders = {}
        self._stack = contextlib.ExitStack()

    def key(self, jit_fn, args, kwargs) -> str:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import compute_cache_key, create_function_from_signature

        if jit_fn not in self._binders:
            backend = make_backend(GPUTarget("cuda", 90, 32))
            self._binders[jit_fn] = create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
        _, specialization, options = self._binders[jit_fn](*map(_pointers, args),
                                                           **{k: _pointers(v) for k, v in kwargs.items()})
        return compute_cache_key({}, specialization, options)

    def snapshot(self) -> set[tuple[str, str]]:
        return {(name, key) for name, keys in self.seen.items() for key in keys}

    def __enter__(self) -> "CompileKeys":
        from torch._subclasses.fake_tensor import FakeTensorMode
        from triton.runtime.jit import JITFunction

        from mfd_sglang.gpu_cost import patched

        recorder = self

        def run(jit_fn, *args, grid, warmup, **kwargs):
            recorder.seen[jit_fn.fn.__name__][recorder.key(jit_fn, args, kwargs)] += 1

        self._stack.enter_context(FakeTensorMode(allow_non_fake_inputs=False))
        self._stack.enter_context(patched(JITFunction, "run", run))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
