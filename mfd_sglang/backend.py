"""Which implementation runs the steps of MFD's round: one vocabulary, one resolver.

Every step of a round with a fast path has exactly two implementations with one contract:

- ``"torch"``: the pure-torch reference (any device; what training, the reference engine and CPU
  servers run);
- ``"triton"``: the Triton kernels of ``mfd_sglang.kernels`` (CUDA tensors, or CPU tensors under
  ``TRITON_INTERPRET=1`` in tests), each held to its torch reference by a test.

A server decides once, at start, which of the two its round runs (`resolve_backend` of the launch's
``--mfd-kernels`` and its device); the worker hands the result to its stages (`DraftStage.backend`,
which the drafter, tree, verify layout, verify mask, accept and commit read; FP8 drafting's quantizer
takes it from the drafter). Library functions with a ``backend=`` argument default to ``"torch"``:
nothing picks an implementation from a tensor's device at run time.

``--mfd-kernels`` takes ``auto`` (Triton on CUDA, torch elsewhere), ``triton`` (refused on a device
that is not CUDA) or ``torch`` (every step on the torch path, on CUDA too: the way around a Triton
kernel that fails on a GPU).
"""

from __future__ import annotations

import os

BACKENDS = ("torch", "triton")
KERNEL_CHOICES = ("auto",) + BACKENDS


def check_backend(backend: str) -> str:
    """backend itself when it is one of `BACKENDS`; else ValueError naming the choices."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(repr(b) for b in BACKENDS)}")
    return backend


def interpreted() -> bool:
    """Whether Triton runs under its interpreter (TRITON_INTERPRET=1: kernels on CPU tensors, tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(choice: str, device) -> str:
    """The backend a server's round runs for `--mfd-kernels choice` on `device` (SGLang's --device, e.g.
    "cuda", "cuda:1", "cpu"). ValueError naming the flag: an unknown choice, or triton on a device that
    is not CUDA (allowed under the Triton interpreter)."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"--mfd-kernels {choice!r}: pass one of {', '.join(KERNEL_CHOICES)}.")
    on_cuda = str(device).startswith("cuda")
    if choice == "auto":
        return "triton" if on_cuda else "torch"
    if choice == "triton" and not on_cuda and not interpreted():
        raise ValueError(f"--mfd-kernels triton runs MFD's Triton kernels, which need a CUDA device (this server "
                         f"runs on {device}); pass --mfd-kernels auto or torch.")
    return choice
