"""`make-tiny`: a small Qwen3-shaped target and an MFD drafter that really agrees with it, built offline.

A random drafter never agrees with its target, so nothing downstream would ever see a deep
acceptance. Instead:
  1. a word-level tokenizer (with a ChatML chat template) over a small vocabulary;
  2. a target trained for a few seconds on a synthetic language of cyclic word lists (numbers,
     the NATO alphabet, days, months, colours, a phrase). Some words occur in two lists ("may",
     "march", "we"), so the continuation depends on earlier tokens: the target must attend;
  3. the MFD drafter (K modes) trained for a few seconds on the target's OWN greedy continuations;
  4. a single-mode drafter (DFlash format, K = 1) trained on the same continuations with the same steps:
     the drafter of the DFlash chain, DDTree and SGLang's DFLASH in comparisons with MFD. (The MFD drafter
     is trained from scratch, not started from it: one drafter's training less, and its bytes are those
     of make-tiny before the single-mode drafter was added.)
Everything is fp32 and deterministic for a seed. Under a minute on two CPU cores.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config,
                          Qwen3ForCausalLM)

from ..checkpoint import load_drafter, parse_drafter_config, save_drafter
from ..drafter import MFDDrafter, context_features
from .train import cosine_lr, drafter_loss, optimizer_step, sample_anchors
from .train_data import TINY_SET, TrainPrompt

WORD_LISTS = [
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split(),
    ("alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar papa "
     "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split(),
    "monday tuesday wednesday thursday friday saturday sunday".split(),
    "january february march april may june july august september october november december".split(),
    "red orange yellow green blue indigo violet".split(),
    "we may go home now and then we march on".split(),
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "[UNK]"]
EXTRA_WORDS = ["user", "assistant", "system", ".", ",", "?", "!"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = [
    "one two three four",
    "alpha bravo charlie",
    "monday tuesday",
    "january february march",
    "red orange yellow",
    "we may go home",
]

SEQ_LEN = 64
TARGET_LAYERS = 3
TARGET_LAYER_IDS = [0, 1]
BLOCK_SIZE = 8


def vocabulary() -> list[str]:
    words = sorted({w for words in WORD_LISTS for w in words})
    return SPECIAL_TOKENS + EXTRA_WORDS + words


def build_tokenizer() -> PreTrainedTokenizerFast:
    return word_level_tokenizer(vocabulary())


def word_level_tokenizer(tokens: list[str]) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over `tokens` (make-tiny's special tokens first), ChatML template."""
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="<|endoftext|>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|mask|>"], chat_template=CHAT_TEMPLATE,
    )


def corpus_stream(rng: random.Random, tokenizer: PreTrainedTokenizerFast, length: int) -> list[int]:
    """Sentences that walk a word list cyclically from a random start, each ended by '.'."""
    words: list[str] = []
    while len(words) < length:
        cycle = rng.choice(WORD_LISTS)
        start = rng.randrange(len(cycle))
        words += [cycle[(start + i) % len(cycle)] for i in range(rng.randint(6, 40))] + ["."]
    return tokenizer.convert_tokens_to_ids(words[:length])


def target_config(tokenizer: PreTrainedTokenizerFast, hybrid: bool = False) -> Qwen3Config | Qwen3_5TextConfig:
    """Qwen3-shaped, or with `hybrid` Qwen3.5-shaped: Gated DeltaNet layers (linear attention with a
    recurrent state and a short convolution) before one full-attention layer."""
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=TARGET_LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if not hybrid:
        return Qwen3Config(rope_theta=10000.0, **common)
    return Qwen3_5TextConfig(
        layer_types=["linear_attention"] * (TARGET_LAYERS - 1) + ["full_attention"],
        full_attention_interval=TARGET_LAYERS, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, **common)


def drafter_config(tokenizer: PreTrainedTokenizerFast, num_modes: int) -> dict:
    """The drafter's config.json: DFlash format, plus an `mfd_config` block when num_modes > 1."""
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": len(tokenizer), "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "attention_bias": False, "torch_dtype": "float32",
        "block_size": BLOCK_SIZE, "num_target_layers": TARGET_LAYERS,
        "dflash_config": {"mask_token_id": tokenizer.convert_tokens_to_ids("<|mask|>"),
                          "target_layer_ids": TARGET_LAYER_IDS},
    }
    if num_modes > 1:
        config["mfd_config"] = {"num_modes": num_modes, "default_mode": 0}
    return config


def new_drafter(tokenizer: PreTrainedTokenizerFast, num_modes: int,
                generator: torch.Generator) -> tuple[MFDDrafter, dict]:
    """(an untrained drafter, its config.json): normal(0, 0.05) matrices and, with K > 1, small distinct mode
    embeddings (every mode starts as the same drafter, slightly shifted)."""
    raw = drafter_config(tokenizer, num_modes)
    cfg = replace(parse_drafter_config(raw), num_modes=num_modes, default_mode=0)
    drafter = MFDDrafter(cfg, context_features=len(TARGET_LAYER_IDS) * cfg.hidden_size)
    with torch.no_grad():
        if num_modes > 1:
            drafter.mode_embed.normal_(0.0, 0.02, generator=generator)
        for name, p in drafter.named_parameters():
            if p.dim() == 2 and name != "mode_embed":
                p.normal_(0.0, 0.05, generator=generator)
    return drafter, raw


def train_target(model: Qwen3ForCausalLM, data: torch.Tensor, steps: int, generator: torch.Generator,
                 log=print) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(steps):
        rows = torch.randint(0, data.shape[0], (32,), generator=generator)
        loss = model(data[rows], labels=data[rows]).loss
        optimizer_step(optimizer, loss, cosine_lr(step, steps, 3e-3, steps // 10))
        if step % 100 == 0 or step == steps - 1:
            log(f"  target step {step:4d}  loss {loss.item():.3f}")
    model.eval()


@torch.inference_mode()
def greedy_continuations(model: Qwen3ForCausalLM, prompts: torch.Tensor, total_len: int) -> torch.Tensor:
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=total_len - prompts.shape[1],
                         min_new_tokens=total_len - prompts.shape[1], do_sample=False, pad_token_id=0)
    return out[:, :total_len]


def train_drafter(drafter: MFDDrafter, target: Qwen3ForCausalLM, sequences: torch.Tensor, steps: int,
                  generator: torch.Generator, log=print) -> None:
    with torch.no_grad():
        features = context_features(target(sequences, output_hidden_states=True).hidden_states, TARGET_LAYER_IDS)
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    drafter.train()
    for step in range(steps):
        rows = torch.randint(0, sequences.shape[0], (16,), generator=generator)
        anchors = sample_anchors(generator, 16, 8, sequences.shape[1], BLOCK_SIZE)
        loss = drafter_loss(drafter, embed, lm_head, sequences[rows], features[rows], anchors)
        optimizer_step(optimizer, loss, cosine_lr(step, steps, 3e-3, steps // 10), clip_params=drafter.parameters())
        if step % 100 == 0 or step == steps - 1:
            log(f"  drafter step {step:4d}  loss {loss.item():.3f}")
    drafter.eval()


def make_tiny(outdir: str | Path, *, seed: int = 0, num_modes: int = 4, target_steps: int = 400,
              drafter_steps: int = 300, hybrid: bool = False, log=print) -> Path:
    """Write OUTDIR/target (HF Qwen3, or with `hybrid` Qwen3.5, + tokenizer), OUTDIR/drafter (MFD checkpoint,
    K = num_modes >= 2) and OUTDIR/drafter-dflash (the single-mode drafter, a DFlash checkpoint), each drafter
    trained `drafter_steps` on the same continuations."""
    if num_modes < 2:
        raise ValueError(f"--num-modes must be >= 2 for the MFD drafter, got {num_modes} (the single-mode "
                         "drafter is OUTDIR/drafter-dflash)")
    start = time.perf_counter()
    outdir = Path(outdir)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    tokenizer = build_tokenizer()

    log(f"[make-tiny] training the target ({target_steps} steps)")
    data = torch.tensor(corpus_stream(rng, tokenizer, 512 * SEQ_LEN)).view(512, SEQ_LEN)
    target = (Qwen3_5ForCausalLM if hybrid else Qwen3ForCausalLM)(target_config(tokenizer, hybrid))
    train_target(target, data, target_steps, generator, log)

    prompts = data[torch.randperm(data.shape[0], generator=generator)[:96], :16]
    sequences = greedy_continuations(target, prompts, SEQ_LEN)
    drafters = {}
    for name, k in (("drafter", num_modes), ("drafter-dflash", 1)):  # the MFD drafter's draws first, as always
        log(f"[make-tiny] {name}: trained on the target's greedy continuations ({drafter_steps} steps, K = {k})")
        drafter, raw = new_drafter(tokenizer, k, generator)
        train_drafter(drafter, target, sequences, drafter_steps, generator, log)
        drafters[name] = drafter, raw

    target.save_pretrained(outdir / "target", safe_serialization=True)
    tokenizer.save_pretrained(outdir / "target")
    for name, (drafter, raw) in drafters.items():
        save_drafter(outdir / name, raw, drafter.checkpoint_weights())
        load_drafter(outdir / name)  # what we wrote must load
    (outdir / "prompts.json").write_text(json.dumps(PROMPTS, indent=2) + "\n")
    log(f"[make-tiny] wrote {outdir}/target, {outdir}/drafter and {outdir}/drafter-dflash in "
        f"{time.perf_counter() - start:.1f} s")
    return outdir


def tiny_prompts(pair_dir: str | Path, count: int = 64, seed: int = 0) -> list[TrainPrompt]:
    """For the make-tiny pair: its prompts.json, then corpus snippets (3-12 words) up to `count` prompts."""
    texts = json.loads((Path(pair_dir) / "prompts.json").read_text())
    out = [TrainPrompt(f"tiny/prompts/{i}", TINY_SET, t) for i, t in enumerate(texts)][:count]
    rng = random.Random(seed)
    tokenizer = build_tokenizer()
    i = 0
    while len(out) < count:
        ids = corpus_stream(rng, tokenizer, rng.randint(3, 12))
        out.append(TrainPrompt(f"tiny/corpus/s{seed}/{i}", TINY_SET, " ".join(tokenizer.convert_ids_to_tokens(ids))))
        i += 1
    return out
