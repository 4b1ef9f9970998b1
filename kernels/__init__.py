"""Triton kernels (installed as `mfd_sglang.kernels`; never as a top-level `kernels`, which sglang's
dependency of that name would collide with). Each kernel has a pure-torch reference in `mfd_sglang`
and a test holding it to that reference."""
