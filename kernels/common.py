"""What every Triton wrapper shares: whether the kernels run on the interpreter, the check each wrapper makes
before a launch (CUDA tensors, or the interpreter), and the launch shape of the two tree walks
(`verify_layout`, `accept_path`)."""

import triton

from mfd_sglang.handoffs import DraftTree
from mfd_sglang.kernels.params import pow2

_TILE_CELLS = 64 * 64  # cells of a tree walk's [rows, nodes] comparison tile: 32 a thread at 4 warps


@triton.jit
def _probe():
    pass


def is_interpreted() -> bool:
    """Whether the kernels run on the Triton interpreter (CPU tensors allowed)."""
    # TRITON_INTERPRET is read when @triton.jit runs, i.e. when this module is imported.
    return type(_probe).__name__ == "InterpretedFunction"


def require_cuda(tensor, what: str, hint: str = "") -> None:
    """ValueError unless `tensor` is a CUDA tensor or the kernels run on the interpreter: what every
    Triton wrapper checks first. what: the kernel, as the message names it."""
    if not tensor.is_cuda and not is_interpreted():
        raise ValueError(f"{what} needs CUDA tensors or TRITON_INTERPRET=1 (set before triton is imported), got "
                         f"a tensor on {tensor.device}{hint}")


def tree_walk_config(tree: DraftTree) -> tuple[int, int, dict]:
    """(bs, budget, the launch's constexprs and warps) of a tree walk over a batched tree: one program a request."""
    if tree.tokens.dim() != 2:
        raise ValueError("the tree walk kernels need a batched tree ([bs, budget] fields)")
    require_cuda(tree.tokens, "the Triton tree walk")
    bs, budget = tree.tokens.shape
    # The [B, B] comparisons of a program over its tree nodes (the root on its own: B = 64 fills 64 lanes) in
    # tiles of _TILE_CELLS: one tile up to B = 64; a whole [256, 256] one spills on sm_90a and sm_80.
    nodes = pow2(budget)
    return bs, budget, dict(BP=nodes, TILE=min(nodes, max(1, _TILE_CELLS // nodes)), num_warps=4)
