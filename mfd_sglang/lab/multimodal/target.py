"""The universe's word tokenizer and its target: a small Qwen3 trained on universe samples, sampled for the
drafters' training data, and the single-layer sliding-window seed drafter the drafters start from."""

from __future__ import annotations

import json
import random

import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from ...checkpoint import parse_drafter_config, save_drafter
from ...drafter import MFDDrafter
from ..tiny import SPECIAL_TOKENS, word_level_tokenizer
from ..train import cosine_lr, new_drafter_config, optimizer_step
from .universe import (
    BLOCK_SIZE,
    CYCLE,
    DRAFTER_WINDOW,
    HEADERS,
    Universe,
    words,
)


SEQ_LEN = 1 + 10 * CYCLE  # training sequences: the header and 10 cycles
TARGET_LAYERS = 4


def build_tokenizer():
    """A word-level tokenizer over the universe's words (make-tiny's special tokens first)."""
    return word_level_tokenizer(SPECIAL_TOKENS + words())


def universe_for(tokenizer) -> Universe:
    return Universe({w: tokenizer.convert_tokens_to_ids(w) for w in words()})


def target_config(tokenizer, hidden: int = 64):

    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def corpus(universe: Universe, rng: random.Random, count: int, length: int = SEQ_LEN) -> list[list[int]]:
    """`count` universe samples, alternately random and cued."""
    return [universe.sample(rng, HEADERS[i % 2], length) for i in range(count)]


TARGET_LR = 1e-2  # with grad clipping: at make-tiny's 3e-3 the target stays ~0.6% unsure of every certain token
TARGET_BATCH = 32


def train_universe_target(tokenizer, universe: Universe, rng: random.Random, generator, *, steps: int,
                          sequences: int, log=print):
    """A Qwen3 target trained from scratch on `sequences` universe samples (next-token cross-entropy,
    AdamW, warmup + cosine, grad clip 1). Its T = 1 samples must stay on the universe: a token it
    should be sure of but is not makes a T = 1 sample leave the known answer."""
    data = torch.tensor(corpus(universe, rng, sequences))
    target = Qwen3ForCausalLM(target_config(tokenizer))
    optimizer = torch.optim.AdamW(target.parameters(), lr=TARGET_LR, weight_decay=0.0)
    target.train()
    for step in range(steps):
        rows = torch.randint(0, data.shape[0], (TARGET_BATCH,), generator=generator)
        loss = target(data[rows], labels=data[rows]).loss
        optimizer_step(optimizer, loss, cosine_lr(step, steps, TARGET_LR, max(steps // 10, 1)),
                       clip_params=target.parameters())
        if step % 50 == 0 or step == steps - 1:
            log(f"  target step {step:4d}/{steps}  loss {loss.item():.3f}")
    return target.eval()


def sample_target(target, prompts: list[list[int]], length: int, generator, temperature: float = 1.0) -> list[list[int]]:
    """The target's own samples: each prompt (all of one length) continued to `length` tokens at T."""
    ids = torch.tensor(prompts)
    out = ids
    cache = DynamicCache(config=target.config)
    with torch.inference_mode():
        while out.shape[1] < length:
            logits = target(ids, past_key_values=cache, use_cache=True).logits[:, -1].float()
            ids = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)
            out = torch.cat([out, ids], dim=1)
    return out.tolist()


def write_training_data(path, sequences: list[list[int]], prompt_len: int = 1) -> None:
    """The `train` data format: one record per sequence, the first `prompt_len` tokens as the prompt."""
    with open(path, "w") as fh:
        for i, seq in enumerate(sequences):
            fh.write(json.dumps({"id": f"multimodal/{i}", "set": "multimodal", "input_ids": seq[:prompt_len],
                                 "response_ids": seq[prompt_len:]}) + "\n")


def write_seed_drafter(path, target, tokenizer, generator) -> None:
    """A randomly initialised single-mode drafter with one sliding-attention layer (window
    DRAFTER_WINDOW), block BLOCK_SIZE, reading every target layer: `train --init-from` starts here,
    so the drafter has the sliding window that `train` alone would not give it."""
    raw = new_drafter_config(target.config, tokenizer, layers=1, block_size=BLOCK_SIZE)
    raw["layer_types"] = ["sliding_attention"]
    raw["sliding_window"] = DRAFTER_WINDOW
    raw["use_sliding_window"] = True  # transformers' Qwen3Config (z-lab's and SGLang's reader) drops it otherwise
    raw["mfd_config"] = {"num_modes": 1, "default_mode": 0}
    cfg = parse_drafter_config(raw)
    drafter = MFDDrafter(cfg, context_features=len(cfg.target_layer_ids) * target.config.hidden_size)
    with torch.no_grad():  # as `train` initialises a drafter from scratch
        for name, p in drafter.named_parameters():
            if p.dim() == 2 and name != "mode_embed":
                p.normal_(0.0, 0.02, generator=generator)
    save_drafter(path, raw, drafter.checkpoint_weights())


