"""Drafters written as the released checkpoints are laid out, by a writer of this module's own, and targets of
the released targets' depth that compute what the tiny ones compute.

The layout is written from the public facts (/work/shared/notes/released-drafters.md, z-lab's reference
`DFlashDraftModel`), never from what `mfd_sglang.checkpoint` expects:
- tensor names: z-lab's module paths (`ZLAB_GLOBAL_TENSORS`, `ZLAB_LAYER_TENSORS`), optionally under `model.`,
  in one `model.safetensors` or in shards listed by `model.safetensors.index.json`; the MFD cards add
  `mode_embed [8, H]` and the training-time `mode_gate.weight [8, H]` / `mode_gate.bias [8]`;
- config.json: transformers' own `Qwen3Config.save_pretrained` (the transformers-5 form: `rope_parameters`,
  `dtype`, `layer_types`, `use_sliding_window`) or the transformers-4.57 form z-lab's first drafters carry
  (`rope_theta`, `rope_scaling: null`, `torch_dtype`, `auto_map`), plus the DFlash keys where the notes put them
  (`dflash_config` or top level).

Speculation needs a drafter that agrees with its target, so the replicas re-lay a trained pair (make-tiny's)
instead of random weights: `deepen_target` inserts layers whose attention output projection and MLP down
projection are zero (each adds exactly 0 to the residual stream, so the deep target computes the tiny one's
function) and places the trained layers so that the card's target-layer ids read the features the trained
drafter read; `relay_drafter` gives the drafter the card's layer count the same way (zero `o_proj` /
`down_proj` layers) and its `fc` the card's context width, the trained blocks of columns at the slots of
those ids and zeros elsewhere. The K = 4 trained mode embeddings fill the card's 8 rows twice."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# z-lab's DFlashDraftModel: fc (no bias), hidden_norm, norm, and per layer a Qwen3 attention (q/k norms per
# head) and MLP with their two norms. No embeddings, no lm_head, no rotary buffers (not persistent).
ZLAB_GLOBAL_TENSORS = ("fc.weight", "hidden_norm.weight", "norm.weight")
ZLAB_LAYER_TENSORS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
)
# The tensors that write a layer's output into the residual stream: zero, the layer adds exactly 0.
DRAFTER_OUTPUT_TENSORS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


@dataclass(frozen=True)
class Card:
    """A released drafter's layout: its layers, the target layers it reads, block, modes, target depth."""

    name: str
    layers: int
    target_layer_ids: list[int]
    target_depth: int
    block_size: int
    num_modes: int
    hybrid: bool


# hhhhhhy5/MFD-Qwen3-8B: 5 layers reading [1, 9, 17, 25, 33] of Qwen3-8B's 36, block 16, mode_embed 8 x H.
MFD_QWEN3_8B = Card("MFD-Qwen3-8B", 5, [1, 9, 17, 25, 33], 36, 16, 8, hybrid=False)
# hhhhhhy5/MFD-Qwen3.5-4B: 6 layers reading 8 layers of the 32-layer hybrid Qwen3.5-4B, block 16.
MFD_QWEN35_4B = Card("MFD-Qwen3.5-4B", 6, [1, 5, 9, 13, 17, 21, 25, 29], 32, 16, 8, hybrid=True)
# z-lab/Qwen3-8B-DFlash-b16: the DFlash drafter MFD-Qwen3-8B was fine-tuned from (no modes).
ZLAB_QWEN3_8B_B16 = Card("Qwen3-8B-DFlash-b16", 5, [1, 9, 17, 25, 33], 36, 16, 1, hybrid=False)


# --- targets of the real depth ----------------------------------------------------------------------
def qwen35_layer_types(depth: int, interval: int = 4) -> list[str]:
    """Qwen3.5's hybrid pattern: three Gated DeltaNet layers, then one full-attention layer."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(depth)]


def trained_layer_slots(card: Card, source_depth: int) -> dict[int, int]:
    """{deep layer: tiny layer}: the tiny target's layers read by its drafter (ids 0 and 1: make-tiny's) at the
    card's first two target-layer ids, its last layer at the deep target's last (of the same kind on a hybrid:
    Qwen3.5's last layer is full attention, as the tiny hybrid's is)."""
    first, second = card.target_layer_ids[:2]
    slots = {first: 0, second: 1, card.target_depth - 1: source_depth - 1}
    assert len(slots) == 3 and source_depth == 3
    return slots


def deepen_target(source: Path, out: Path, card: Card) -> Path:
    """The tiny target (3 layers) at the card's target depth: its layers at `trained_layer_slots`, zero-output
    copies elsewhere (attention / linear-attention output projection and MLP down projection zero), the same
    embeddings, final norm, lm_head and tokenizer."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source)
    text = getattr(config, "text_config", config)
    depth = card.target_depth
    slots = trained_layer_slots(card, text.num_hidden_layers)
    source_types = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    deep_types = qwen35_layer_types(depth) if card.hybrid else ["full_attention"] * depth
    for deep, tiny in slots.items():
        assert deep_types[deep] == source_types[tiny], (deep, tiny)
    weights = load_file(str(source / "model.safetensors"))
    tiny_layer = {i: {n.split(f"model.layers.{i}.", 1)[1]: t for n, t in weights.items()
                      if n.startswith(f"model.layers.{i}.")} for i in range(text.num_hidden_layers)}
    deep_weights = {n: t for n, t in weights.items() if not n.startswith("model.layers.")}
    for layer in range(depth):
        if layer in slots:
            tensors = dict(tiny_layer[slots[layer]])
        else:  # a zero-output copy of a trained layer of the same kind
            tensors = {n: t.clone() for n, t in tiny_layer[source_types.index(deep_types[layer])].items()}
            for name in ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight"):
                if name in tensors:
                    tensors[name] = torch.zeros_like(tensors[name])
        deep_weights |= {f"model.layers.{layer}.{n}": t for n, t in tensors.items()}
    raw = json.loads((source / "config.json").read_text())
    fields = raw.get("text_config", raw)
    fields["num_hidden_layers"] = depth
    if card.hybrid:
        fields["layer_types"] = deep_types
        fields["full_attention_interval"] = 4
    elif "layer_types" in fields:
        fields["layer_types"] = deep_types
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    save_file({n: t.contiguous() for n, t in deep_weights.items()}, str(out / "model.safetensors"))
    for item in source.iterdir():
        if item.name not in ("config.json", "model.safetensors", "model.safetensors.index.json"):
            shutil.copy(item, out / item.name)
    return out


# --- drafters ---------------------------------------------------------------------------------------
def relay_drafter(source: Path, card: Card, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of a trained make-tiny drafter (`source`: reading target layers [0, 1] of a 3-layer target)
    laid out as `card`, under z-lab's names: its layers first and zero-output copies of them after, its fc
    columns for target layer 0 / 1 at the slots of the card's first two target-layer ids (zeros for the other
    ids), and with card.num_modes > 1 the trained mode embeddings repeated to the card's K rows and a random
    mode gate."""
    trained = load_file(str(source / "model.safetensors"))
    hidden = trained["norm.weight"].shape[0]
    source_layers = 1 + max(int(n.split(".")[1]) for n in trained if n.startswith("layers."))
    out = {name: trained[name] for name in ("hidden_norm.weight", "norm.weight")}
    fc = torch.zeros(hidden, len(card.target_layer_ids) * hidden, dtype=trained["fc.weight"].dtype)
    for slot in range(2):  # the tiny drafter's context features: target layers 0 and 1, in that order
        fc[:, slot * hidden:(slot + 1) * hidden] = trained["fc.weight"][:, slot * hidden:(slot + 1) * hidden]
    out["fc.weight"] = fc
    for layer in range(card.layers):
        src = layer if layer < source_layers else layer % source_layers
        for name in ZLAB_LAYER_TENSORS:
            tensor = trained[f"layers.{src}.{name}"].clone()
            if layer >= source_layers and name in DRAFTER_OUTPUT_TENSORS:
                tensor.zero_()
            out[f"layers.{layer}.{name}"] = tensor
    if card.num_modes > 1:
        modes = trained["mode_embed"]
        out["mode_embed"] = modes[torch.arange(card.num_modes) % modes.shape[0]].clone()
        gen = torch.Generator().manual_seed(seed)
        out["mode_gate.weight"] = torch.randn(card.num_modes, hidden, generator=gen)
        out["mode_gate.bias"] = torch.randn(card.num_modes, generator=gen)
    expected = set(ZLAB_GLOBAL_TENSORS) | {f"layers.{i}.{n}" for i in range(card.layers) for n in ZLAB_LAYER_TENSORS}
    assert expected <= set(out), sorted(expected - set(out))
    return out


def transformers5_config(card: Card, shape: dict, *, mask_token_id: int, rope_theta: float,
                         dflash_block_size: bool = True) -> dict:
    """config.json as transformers 5 saves a Qwen3Config (`rope_parameters`, `dtype`, `layer_types`, ...) plus
    z-lab's DFlash keys: `dflash_config` with the mask token and target layers (and the block size when
    `dflash_block_size`, else at top level), `num_target_layers` and `architectures`."""
    import tempfile

    from transformers import Qwen3Config

    with tempfile.TemporaryDirectory() as tmp:
        Qwen3Config(num_hidden_layers=card.layers, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                    dtype="float32", **shape).save_pretrained(tmp)
        raw = json.loads((Path(tmp) / "config.json").read_text())
    raw["architectures"] = ["DFlashDraftModel"]
    raw["num_target_layers"] = card.target_depth
    raw["dflash_config"] = {"mask_token_id": mask_token_id, "target_layer_ids": list(card.target_layer_ids)}
    if dflash_block_size:
        raw["dflash_config"]["block_size"] = card.block_size
    else:
        raw["block_size"] = card.block_size
    return raw


def transformers4_config(card: Card, shape: dict, *, mask_token_id: int, rope_theta: float) -> dict:
    """config.json in the transformers-4.57 form of z-lab's first drafters (`rope_theta`, `rope_scaling: null`,
    `torch_dtype`, `sliding_window: null`, `auto_map` to their remote code), with the block size, mask token and
    target layers at top level."""
    return {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None,
        "block_size": card.block_size, "hidden_act": "silu", "initializer_range": 0.02,
        "layer_types": ["full_attention"] * card.layers, "max_position_embeddings": 4096,
        "max_window_layers": card.layers, "model_type": "qwen3", "num_hidden_layers": card.layers,
        "num_target_layers": card.target_depth, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": rope_theta, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "float32",
        "transformers_version": "4.57.1", "use_cache": True, "use_sliding_window": False,
        "mask_token_id": mask_token_id, "target_layer_ids": list(card.target_layer_ids), **shape,
    }


def drafter_shape(source: Path) -> dict:
    """The widths of a make-tiny drafter (hidden, heads, MLP, vocabulary), from its config.json."""
    raw = json.loads((source / "config.json").read_text())
    return {k: raw[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "vocab_size")}


def write_layout(path: Path, raw: dict, tensors: dict[str, torch.Tensor], *, prefix: str = "",
                 shards: int = 0) -> Path:
    """A drafter directory: config.json and the tensors under `prefix`, in one model.safetensors or in `shards`
    files named as the hub names them, listed by model.safetensors.index.json (metadata.total_size, weight_map)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    named = {prefix + name: t.contiguous() for name, t in tensors.items()}
    if not shards:
        save_file(named, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = sorted(named)[s::shards]
        save_file({n: named[n] for n in part}, str(path / shard), metadata={"format": "pt"})
        weight_map |= {n: shard for n in part}
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in named.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path


def random_zlab_tensors(raw: dict, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors for a drafter config, shaped as z-lab's DFlashDraftModel builds its modules: q/k/v/o as
    nn.Linear(hidden, heads x head_dim) etc. (with biases under attention_bias), per-head q/k norms, the MLP's
    gate/up/down, fc over len(target_layer_ids) x hidden. Norm weights near 1, matrices small."""
    block = raw.get("dflash_config") or {}
    h, hd, inter = raw["hidden_size"], raw["head_dim"], raw["intermediate_size"]
    q, kv = raw["num_attention_heads"] * hd, raw["num_key_value_heads"] * hd
    n_ctx = len(block.get("target_layer_ids", raw.get("target_layer_ids")))
    linear = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    norms = {"self_attn.q_norm": hd, "self_attn.k_norm": hd, "input_layernorm": h, "post_attention_layernorm": h}
    gen = torch.Generator().manual_seed(seed)
    out = {"fc.weight": torch.randn(h, n_ctx * h, generator=gen) * 0.1,
           "hidden_norm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
           "norm.weight": 1 + 0.1 * torch.randn(h, generator=gen)}
    for layer in range(raw["num_hidden_layers"]):
        for name, shape in linear.items():
            out[f"layers.{layer}.{name}.weight"] = torch.randn(*shape, generator=gen) * 0.2
            if raw.get("attention_bias") and name.startswith("self_attn."):
                out[f"layers.{layer}.{name}.bias"] = torch.randn(shape[0], generator=gen) * 0.1
        for name, size in norms.items():
            out[f"layers.{layer}.{name}.weight"] = 1 + 0.1 * torch.randn(size, generator=gen)
    return out
