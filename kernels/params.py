"""Numbers a Triton kernel shares with its torch reference or with the memory plan, in a module that imports no
Triton (the references, the memory plan and the launch must not need it): the bitonic lane count, the
vocabulary kernel's tile and split bounds, and the FP8 e4m3 format FP8 drafting quantizes to."""

import torch

# The vocabulary kernel's rows per tile (at least B) and splits at most (below 2^23 rows): its scratch holds B
# keys, a max and a sum per split of every row (`kernels/draft_vocab.py`, `serving/launch/memory.py`).
VOCAB_TILE, VOCAB_SPLITS = 128, 128

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# SGLang's per-token-group quantization floors max |x| here (an all-zero row: scale 1e-10 / 448, zeros).
SCALE_FLOOR = 1e-10


def pow2(n: int) -> int:
    """n rounded up to a power of two, at least 2: the lanes of a bitonic network over n keys (>= 2 keeps every
    top-k a real merge), e.g. the B keys a vocabulary split keeps."""
    return 1 << max(1, (n - 1).bit_length())
