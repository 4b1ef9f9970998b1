"""What the Triton top-k kernels (`mixture_tree`, `vocab_candidates`) share: the int64 rank key
they sort, and two launch helpers.

A rank key holds a float32 score's order-preserving int32 bits in its high half (negative floats
flip their magnitude bits; -0.0 maps as +0.0) and 2^31 - 1 - index in its low half (0 <= index <
2^31). Keys are distinct, so a descending top-k over them is a stable descending sort of the scores:
higher score first, ties to the lower index. `MIN_KEY` ranks below every real key (padding lanes).
The torch twin (`mfd_sglang.drafter.rank_keys` / `from_rank_keys`) builds and decodes the same keys.
"""

import triton
import triton.language as tl

MIN_KEY = tl.constexpr(-(2**63))


@triton.jit
def _ordered(x):
    """float32 -> int32 with the same order (-0.0 and +0.0 map alike)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    # Negative floats order by decreasing magnitude: flip their magnitude bits.
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _unordered(o):
    """Inverse of `_ordered` (the bit flip is an involution that keeps the sign)."""
    return (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def rank_key(score, index):
    """int64 ranking key: higher score first, ties to the lower index (0 <= index < 2^31)."""
    return (_ordered(score).to(tl.int64) << 32) + (2147483647 - index).to(tl.int64)


@triton.jit
def key_score(key):
    return _unordered((key >> 32).to(tl.int32))


@triton.jit
def key_index(key):
    return 2147483647 - (key - ((key >> 32) << 32))


def is_interpreted() -> bool:
    """Whether the kernels run on the Triton interpreter (CPU tensors allowed)."""
    # TRITON_INTERPRET is read when @triton.jit runs, i.e. when this module is imported.
    return type(rank_key).__name__ == "InterpretedFunction"


def pow2(n: int) -> int:
    """n rounded up to a power of two, at least 2: the lanes of a bitonic network over n keys (>= 2
    keeps every top-k a real merge)."""
    return max(2, triton.next_power_of_2(n))
