"""What the Triton top-k kernels (`tree_mixture`, `draft_vocab`) share: the int64 rank key
they sort (and its int32 twin for 16-bit scores).

A rank key holds a float32 score's order-preserving int32 bits in its high half (negative floats
flip their magnitude bits; -0.0 maps as +0.0) and 2^31 - 1 - index in its low half (0 <= index <
2^31). Keys are distinct, so a descending top-k over them is a stable descending sort of the scores:
higher score first, ties to the lower index. `MIN_KEY` ranks below every real key (padding lanes).
The torch twin (`mfd_sglang.drafter.rank_keys` / `from_rank_keys`) builds and decodes the same keys.
A short rank key is the int32 twin for 16-bit scores at an index local to a range of 2^16 rows
(`short_rank_key`), turned into the rank key of its global index once ranked.
"""

import triton
import triton.language as tl

MIN_KEY = tl.constexpr(-(2**63))
MIN_SHORT_KEY = tl.constexpr(-(2**31))


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
def _flip16(bits):
    """The 16-bit twin of `_ordered`'s flip: negative values' magnitude bits inverted (an involution)."""
    return bits ^ ((bits >> 15) & 0x7FFF)


@triton.jit
def _ordered16(x, IS_BF16: tl.constexpr):
    """float32 holding a bfloat16 (IS_BF16) or float16 value -> int32 in [-2^15, 2^15) with the same
    order (-0.0 and +0.0 map alike)."""
    x = tl.where(x == 0.0, 0.0, x)
    if IS_BF16:
        bits = x.to(tl.int32, bitcast=True) >> 16  # a bfloat16 is the high half of its float32
    else:
        bits = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return _flip16(bits)


@triton.jit
def short_rank_key(score, local, IS_BF16: tl.constexpr):
    """int32 ranking key of a 16-bit score (held in float32) at a local index 0 <= local < 2^16: the
    score's order in the high half, 2^16 - 1 - local in the low half. Half the width of `rank_key`,
    so a network over these keys runs on 32-bit compares; `MIN_SHORT_KEY` ranks below every real
    one (it would be a NaN's)."""
    return (_ordered16(score, IS_BF16) << 16) | (65535 - local)


@triton.jit
def short_key_to_rank_key(key, first, IS_BF16: tl.constexpr):
    """The int64 `rank_key` of the score and index `first + local` a `short_rank_key` holds;
    `MIN_SHORT_KEY` -> `MIN_KEY`."""
    bits = _flip16(key >> 16)
    if IS_BF16:
        score = (bits << 16).to(tl.float32, bitcast=True)
    else:
        score = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    index = first + (65535 - (key & 0xFFFF)).to(tl.int64)
    return tl.where(key == MIN_SHORT_KEY, MIN_KEY, rank_key(score, index))


@triton.jit
def key_score(key):
    return _unordered((key >> 32).to(tl.int32))


@triton.jit
def key_index(key):
    return 2147483647 - (key - ((key >> 32) << 32))
