"""Drafter checkpoints: the DFlash (z-lab) format, its MFD extension, validation and the target fit check.

A drafter directory holds `config.json` and safetensors weights (`model.safetensors`, or shards
listed in `model.safetensors.index.json`). Accepted layouts:

- DFlash (z-lab): a Qwen3-style config with `block_size`, `dflash_config: {mask_token_id,
  target_layer_ids}` (these keys are also accepted at top level, and `block_size` inside
  `dflash_config`), optional `num_target_layers`, optional `layer_types`/`sliding_window`.
  Weights `fc`, `hidden_norm`, `norm`, `layers.{i}.*`, optionally under a `model.` prefix.
  No embeddings and no lm_head: the drafter borrows the target's.
- MFD: the same plus `mode_embed [K, H]` (K learned mode embeddings) and optionally `mode_gate.*`
  (the released drafters' training-time layer, ignored) and an `mfd_config` block in config.json:
  `{"num_modes": K, "default_mode": k | "embed", "draft_vocab_size": Vd, "mode_prior": "gate" | "uniform"}`.
  K is inferred from `mode_embed` when the config is silent. A plain DFlash drafter is an MFD drafter
  with K = 1 (no embedding is added).
- The mode gate (optional, K > 1): `mode_prior.weight [K, H]` and `mode_prior.bias [K]`, a K-way softmax
  over the drafter's final-normed state at the block's anchor (the root slot, averaged over the K
  copies): log pi_k weighs mode k in the tree (`mfd_sglang.tree.weigh_modes`). `mfd_config.mode_prior`
  says which rule a checkpoint gets: "gate" needs both tensors, "uniform" (every mode weight 1, the
  unweighted tree) refuses them; when silent, "gate" exactly when the tensors are there.
- The default (single-mode) path used by MFD_D: `mfd_config.default_mode = k` drafts with mode k's
  embedding; `"embed"` (or a `default_mode_embed [H]` tensor with the config silent) drafts with
  that separately trained embedding. Without either, mode 0 is the default path.
- Optional draft vocabulary: `draft_vocab [Vd]` int64, strictly increasing target token ids. The
  drafter scores only those ids; verification stays over the target's full vocabulary.

Config keys (`check_config_keys`): what z-lab's reference DFlashDraftModel or SGLang 0.5.23's DFlash loader
reads is honoured (HONOURED_KEYS; rope, layer types and sliding window resolved as transformers' Qwen3Config
resolves them for both) or accepted only at its neutral value (NEUTRAL_ONLY_KEYS); drafters of other DFlash-family
architectures (DFlash2, DSpark, LiLiCorr, Domino, Laguna, Muse) are refused by architecture, config key or tensor
name with the algorithm that serves them; HF bookkeeping (IGNORED_KEYS) is ignored; any other key is kept in
`DrafterConfig.unread_keys`, logged once per drafter directory and listed by `inspect`.

Every problem is a `CheckpointError` naming the field, the found and the expected value.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

# Drafter directories whose unread config keys were logged (once per process).
_WARNED_UNREAD: set[Path] = set()

# `default_mode` before the weights are seen: not set in mfd_config.
_UNSPECIFIED = -1

# Tensors that real checkpoints carry but inference does not use.
_IGNORED_PREFIXES = ("mode_gate.", "rotary_emb.")

# How the tree weighs the modes (mfd_config.mode_prior): equally, or by the mode gate's tensors.
MODE_PRIORS = ("uniform", "gate")
MODE_GATE_TENSORS = ("mode_prior.weight", "mode_prior.bias")
MFD_CONFIG_KEYS = ("num_modes", "default_mode", "draft_vocab_size", "mode_prior")


class CheckpointError(ValueError):
    """A drafter checkpoint that cannot be used as it is; the message says what and how to fix it."""


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int | None
    num_modes: int
    default_mode: int | None  # None: the separately trained `default_mode_embed`
    draft_vocab_size: int | None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    mode_prior: str = "uniform"  # "gate": the tree weighs the modes by the mode gate (mode_prior.*)
    unread_keys: tuple[str, ...] = ()  # config keys neither read nor known to be ignorable (check_config_keys)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # the raw keys not in HONOURED_KEYS

    @property
    def num_draft_positions(self) -> int:
        """Positions the drafter predicts per block (the block's first slot holds the last verified token)."""
        return self.block_size - 1

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"


@dataclass
class DrafterCheckpoint:
    path: Path | None
    config: DrafterConfig
    weights: dict[str, torch.Tensor]  # canonical names, without the optional `model.` prefix
    ignored: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return "mfd" if "mode_embed" in self.weights else "dflash"


def field_error(field_name: str, found: Any, expected: str, fix: str = "") -> CheckpointError:
    """The CheckpointError naming `field_name`, what was found, what was expected and (optionally) the fix."""
    msg = f"{field_name}: found {found!r}, expected {expected}"
    return CheckpointError(msg + (f". {fix}" if fix else ""))


def _get_int(raw: Mapping[str, Any], name: str, *, default: Any = None, where: str = "config.json") -> int:
    value = raw.get(name, default)
    if value is None:
        raise field_error(f"{where} {name}", None, "an integer", "The field is required.")
    if isinstance(value, bool) or not isinstance(value, int):
        raise field_error(f"{where} {name}", value, "an integer")
    return value


def _dflash_value(raw: Mapping[str, Any], name: str) -> Any:
    block = raw.get("dflash_config") or {}
    return block.get(name, raw.get(name))


# --- config keys: honoured, accepted at a neutral value, refused, ignored ---------------------------
# What a drafter's config.json may carry, judged against the two readers of the format: z-lab's reference
# DFlashDraftModel (z-lab/dflash, `dflash/model.py`: a Qwen3Config plus `dflash_config`, each dflash key also
# read at top level) and SGLang 0.5.23's DFlash loader (`srt/models/dflash.py`, `srt/speculative/dflash_utils.py`).
# A key that changes their drafter's numbers is honoured here or refused by name; a key neither reads for a
# DFlash drafter is ignored only when listed below; any other key is kept unread and named in a warning (and by
# `inspect`): verification keeps the output the target's whatever the drafter, so an unknown key can cost
# acceptance, never correctness, and refusing it would block a released drafter over a harmless field.

# Read by this parser and honoured by the drafter, or read to resolve such a key (use_sliding_window, ...).
HONOURED_KEYS = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings", "attention_bias",
    "rope_theta", "rope_parameters", "rope_scaling", "layer_types", "sliding_window",
    "block_size", "target_layer_ids", "mask_token_id", "num_target_layers", "dflash_config", "mfd_config",
    "use_sliding_window", "max_window_layers",
})

# HF bookkeeping and training-only fields that neither reader turns into drafter numbers: ignored.
IGNORED_KEYS = frozenset({
    "architectures",  # checked against REFUSED_FAMILIES; an architecture not in SERVED_ARCHITECTURES is unread
    "model_type", "auto_map", "transformers_version", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "sep_token_id", "decoder_start_token_id", "tie_word_embeddings", "use_cache",
    "initializer_range", "attention_dropout", "_name_or_path", "name_or_path", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "id2label", "label2id", "problem_type",
    "tokenizer_class", "is_encoder_decoder", "is_decoder", "add_cross_attention", "chunk_size_feed_forward",
    "pruned_heads", "tie_encoder_decoder", "task_specific_params", "finetuning_task", "prefix",
    # the mask token's string: both readers take mask_token_id when it is given (this parser requires it)
    "mask_token",
    # SGLang reads these only with hidden_act "swigluoai", which is refused below
    "swiglu_alpha", "swiglu_limit",
})


def _is_one(value: Any) -> bool:
    return value is None or (not isinstance(value, bool) and isinstance(value, (int, float)) and value == 1)


def _is_off(value: Any) -> bool:
    return value is None or value is False or (not isinstance(value, bool) and isinstance(value, (int, float))
                                               and value <= 0)


# Keys the readers honour that this drafter does not implement: accepted at the value that changes nothing
# (name -> (is that value, what the key does there, the neutral value)), refused otherwise. Looked up at top
# level and inside dflash_config (z-lab reads both).
NEUTRAL_ONLY_KEYS: dict[str, tuple[Any, str, str]] = {
    "input_embedding_scale": (_is_one, "z-lab scales the block's token embeddings by it", "1"),
    "output_multiplier": (_is_one, "z-lab and SGLang scale the draft logits by it", "1"),
    "final_logit_softcapping": (_is_off, "z-lab and SGLang soft-cap the draft logits at it", "null or 0"),
    "attention_value_scale": (_is_one, "SGLang scales every layer's values by it", "null or 1"),
    "attention_sink_bias": (lambda v: v in (None, False), "SGLang adds a per-head attention sink", "false"),
    "swa_window_size": (lambda v: v is None, "SGLang's DSpark / Nemotron window", "null"),
    "use_gemma_norm": (lambda v: v in (None, False), "SGLang's norms then scale by 1 + weight", "false"),
    "rope_is_neox_style": (lambda v: v in (None, True), "SGLang's rope then rotates interleaved pairs", "true"),
    "is_neox_style": (lambda v: v in (None, True), "SGLang's rope then rotates interleaved pairs", "true"),
    "partial_rotary_factor": (_is_one, "SGLang rotates only that share of each head", "1"),
    "hidden_act": (lambda v: v in (None, "silu"), "the MLP's activation (SwiGLU with SiLU here)", '"silu"'),
    "has_embed_tokens": (lambda v: v in (None, False), "a drafter with embeddings of its own (Nemotron 3.5)",
                         "false"),
    "has_lm_head": (lambda v: v in (None, False), "a drafter with an lm_head of its own", "false"),
    "sample_from_anchor": (lambda v: v in (None, True), "Nemotron 3.5 / DSpark's query layout", "true"),
    "eagle_aux_hidden_state_layer_ids": (lambda v: v is None, "Nemotron 3.5's capture layers", "null"),
}

# Drafters of other architectures in the DFlash family: refused by name, with the algorithm that serves them.
_DFLASH = "serve it with --speculative-algorithm DFLASH"
REFUSED_FAMILIES: tuple[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...], str], ...] = (
    # (family, architectures, config keys (non-neutral: present and not 0 / null / false), tensor name parts, fix)
    ("DFlash2 (grouped convolutions and a candidate selector)",
     ("DFlash2DraftModel", "DFlash2BeamDraftModel", "MiniMaxDFlash2DraftModel"),
     ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
     (".attention_conv.", ".mlp_conv.", "candidate_selector."), _DFLASH),
    ("DSpark", ("DSparkDraftModel", "Qwen3DSparkModel", "LingDSparkModel", "DSparkMiniMaxDraftModel"),
     ("dspark_config", "markov_rank", "markov_head_type", "dspark_block_size", "dspark_markov_rank",
      "dspark_noise_token_id", "dspark_target_layer_ids"), (),
     "serve it with --speculative-algorithm DSPARK"),
    ("LiLiCorr", ("LiLiCorrDraftModel",), ("lilicorr_hidden_size", "lilicorr_num_layers", "lilicorr_factor_dim"),
     ("lilicorr.",), _DFLASH),
    ("Domino (a GRU projector)", (), ("projector_type", "gru_hidden_dim", "emb_dim", "shift_label",
                                      "pure_draft_prefix_len"), ("prefix_gru.", "embed_proj."), _DFLASH),
    ("Laguna", ("DFlashLagunaForCausalLM",), ("gating",), ("aux_hidden_norms.", ".g_proj."), _DFLASH),
    ("Muse Glimmer", ("MuseGlimmerAssistantModel",), (), (), _DFLASH),
)
SERVED_ARCHITECTURES = ("DFlashDraftModel",)
# Files next to the weights that SGLang's DFLASH reads: mask_embedding.pt overwrites the target's mask-token
# embedding row with a trained one.
REFUSED_FILES = {"mask_embedding.pt": "SGLang's DFLASH writes this trained mask embedding into the target's "
                                      "embedding table; MFD drafts with the target's own row"}


def _family_error(family: str, found: str, fix: str) -> CheckpointError:
    return CheckpointError(f"{found}: a {family} drafter, not a DFlash / MFD one: MFD cannot draft with it; {fix}.")


def _set(value: Any) -> bool:
    """A key's value that turns a feature on (not absent, null, 0, false or empty)."""
    return value not in (None, 0, False, "", [], {})


def check_config_keys(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """Refuse, by name, a config of another DFlash-family architecture or with a key this drafter cannot
    honour (see NEUTRAL_ONLY_KEYS, REFUSED_FAMILIES); return the keys it does not read (unread: neither
    honoured, neutral-checked nor IGNORED_KEYS), dflash_config's as `dflash_config.<key>`."""
    block = raw.get("dflash_config") or {}
    if not isinstance(block, Mapping):
        raise field_error("dflash_config", block, "a JSON object")
    places = (("", raw), ("dflash_config.", block))
    architectures = raw.get("architectures") or []
    for family, archs, keys, _, fix in REFUSED_FAMILIES:
        for arch in architectures:
            if arch in archs:
                raise _family_error(family, f"config.json architectures {arch!r}", fix)
        for where, source in places:
            for key in keys:
                if _set(source.get(key)):
                    raise _family_error(family, f"config.json {where}{key} = {source[key]!r}", fix)
    for where, source in places:
        for key, (neutral, meaning, value) in NEUTRAL_ONLY_KEYS.items():
            if key in source and not neutral(source[key]):
                raise field_error(f"config.json {where}{key}", source[key], value,
                                  f"{meaning}; the MFD drafter does not implement that, so it cannot draft as "
                                  "this checkpoint was trained to")
    if raw.get("quantization_config") is not None:
        raise field_error("config.json quantization_config", raw["quantization_config"], "none (float weights)",
                          "MFD reads the drafter's weights unquantized; serve a bf16 checkpoint, with "
                          "--speculative-draft-model-quantization fp8 for FP8 drafting")
    if raw.get("text_config") is not None:
        raise field_error("config.json text_config", "a nested config", "a flat DFlash drafter config",
                          "Both readers would read the drafter's fields from text_config; this parser does not.")
    family_keys = {key for _, _, keys, _, _ in REFUSED_FAMILIES for key in keys}
    read = HONOURED_KEYS | IGNORED_KEYS | set(NEUTRAL_ONLY_KEYS) | family_keys | {"quantization_config",
                                                                                   "text_config", "is_causal"}
    mfd = raw.get("mfd_config") if isinstance(raw.get("mfd_config"), Mapping) else {}
    unknown_architecture = any(arch not in SERVED_ARCHITECTURES for arch in architectures)
    return tuple(sorted(k for k in raw if k not in read or (k == "architectures" and unknown_architecture)) +
                 sorted(f"dflash_config.{k}" for k in block if k not in read) +
                 sorted(f"mfd_config.{k}" for k in mfd if k not in MFD_CONFIG_KEYS))


def parse_drafter_config(raw: Mapping[str, Any]) -> DrafterConfig:
    """Read a drafter's config.json (DFlash or MFD) into a DrafterConfig, checking every field."""
    if not isinstance(raw, Mapping):
        raise field_error("config.json", type(raw).__name__, "a JSON object")
    unread = check_config_keys(raw)
    hidden = _get_int(raw, "hidden_size")
    heads = _get_int(raw, "num_attention_heads")
    head_dim = raw.get("head_dim") or (hidden // heads)
    layer_ids = _dflash_value(raw, "target_layer_ids")
    if not isinstance(layer_ids, list) or not layer_ids or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_ids
    ):
        raise field_error(
            "dflash_config.target_layer_ids", layer_ids, "a non-empty list of layer indices >= 0",
            "A DFlash drafter names the target layers whose hidden states it reads.",
        )
    if any(a >= b for a, b in zip(layer_ids, layer_ids[1:])):
        raise field_error("dflash_config.target_layer_ids", layer_ids, "strictly increasing layer indices",
                          "SGLang captures the target's layers in depth order, once each, while z-lab's "
                          "DFlashDraftModel concatenates them in the listed order: they agree only on increasing ids.")
    mask_token_id = _dflash_value(raw, "mask_token_id")
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or mask_token_id < 0:
        raise field_error("dflash_config.mask_token_id", mask_token_id, "a token id >= 0")
    block_size = _dflash_value(raw, "block_size")
    block_size = 16 if block_size is None else block_size
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise field_error("block_size", block_size, "an integer >= 2 (last verified token + drafted positions)")

    rope_theta = _rope_theta(raw, int(head_dim))
    layers = _get_int(raw, "num_hidden_layers")
    layer_types, sliding_window = _attention_layers(raw, layers)

    mfd = raw.get("mfd_config") or {}
    if not isinstance(mfd, Mapping):
        raise field_error("mfd_config", mfd, "a JSON object")
    num_modes = mfd.get("num_modes")
    if num_modes is not None and (isinstance(num_modes, bool) or not isinstance(num_modes, int) or num_modes < 1):
        raise field_error("mfd_config.num_modes", num_modes, "an integer >= 1")
    default_mode = mfd.get("default_mode", _UNSPECIFIED)
    if default_mode == "embed":
        default_mode = None
    elif "default_mode" in mfd and (isinstance(default_mode, bool) or not isinstance(default_mode, int) or default_mode < 0):
        raise field_error("mfd_config.default_mode", default_mode, "a mode index >= 0 or \"embed\"")
    draft_vocab_size = mfd.get("draft_vocab_size")
    mode_prior = mfd.get("mode_prior")
    if mode_prior is not None and mode_prior not in MODE_PRIORS:
        raise field_error("mfd_config.mode_prior", mode_prior, " or ".join(f'"{p}"' for p in MODE_PRIORS))

    return DrafterConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=_get_int(raw, "num_key_value_heads", default=heads),
        head_dim=int(head_dim),
        intermediate_size=_get_int(raw, "intermediate_size"),
        vocab_size=_get_int(raw, "vocab_size"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        attention_bias=bool(raw.get("attention_bias", False)),
        block_size=block_size,
        target_layer_ids=tuple(layer_ids),
        mask_token_id=mask_token_id,
        num_target_layers=_dflash_value(raw, "num_target_layers"),
        num_modes=num_modes or 0,  # 0 until the weights say (see _resolve_modes)
        default_mode=default_mode,
        draft_vocab_size=draft_vocab_size,
        sliding_window=sliding_window,
        layer_types=layer_types,
        mode_prior=mode_prior or "",  # "" until the weights say (see _resolve_modes)
        unread_keys=unread,
        extra={k: v for k, v in raw.items() if k not in HONOURED_KEYS},
    )


def _rope_theta(raw: Mapping[str, Any], head_dim: int) -> float:
    """The rope base as transformers 5 resolves it (what both readers see): `rope_parameters` (the
    transformers-5 form) over a top-level `rope_theta` (the 4.x form, with `rope_scaling`); default 10000.
    Only plain rope over whole heads is served: any other rope_type or parameter is refused by name."""
    params = raw.get("rope_parameters")
    where = "rope_parameters"
    if params is None:
        params, where = raw.get("rope_scaling") or {}, "rope_scaling"
    if not isinstance(params, Mapping):
        raise field_error(where, params, "a JSON object or null")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise field_error(f"{where}.rope_type", rope_type, "'default'", "Only plain RoPE drafters are supported.")
    plain = {"rope_type": lambda v: True, "type": lambda v: True, "rope_theta": lambda v: True,
             "partial_rotary_factor": _is_one, "rope_dim": lambda v: v in (None, head_dim)}
    for key, value in params.items():
        if key not in plain or not plain[key](value):
            raise field_error(f"{where}.{key}", value, "plain rope over whole heads (rope_type 'default', "
                              f"partial_rotary_factor 1, rope_dim {head_dim})", "Only plain RoPE drafters are supported.")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise field_error(f"{where}.rope_theta", theta, "a positive number")
    return float(theta)


def _attention_layers(raw: Mapping[str, Any], layers: int) -> tuple[tuple[str, ...] | None, int | None]:
    """(layer_types, sliding_window) as transformers' Qwen3Config resolves them for both readers:
    `sliding_window` counts only with `use_sliding_window` true; without `layer_types` the layers from
    `max_window_layers` (default 28) on slide when it does. A sliding layer is causal within its window
    (z-lab's default and SGLang's); `is_causal` may only say so again."""
    use_sliding = bool(raw.get("use_sliding_window", False))
    sliding_window = raw.get("sliding_window") if use_sliding else None
    layer_types = raw.get("layer_types")
    if layer_types is None and sliding_window is not None:
        first = raw.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if layer_types is not None:
        if (not isinstance(layer_types, (list, tuple)) or len(layer_types) != layers
                or any(t not in ("full_attention", "sliding_attention") for t in layer_types)):
            raise field_error("layer_types", layer_types, f"{layers} entries of 'full_attention'/'sliding_attention'")
        layer_types = tuple(layer_types)
    sliding = layer_types is not None and "sliding_attention" in layer_types
    if sliding and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1):
        raise field_error("sliding_window", raw.get("sliding_window") if use_sliding else None,
                          "an integer when layer_types has sliding_attention",
                          "transformers' Qwen3Config (which z-lab's and SGLang's DFlash read) keeps sliding_window "
                          "only with use_sliding_window true" if not use_sliding else "")
    is_causal = raw.get("is_causal")
    if is_causal is not None:
        changed = [i for i, t in enumerate(layer_types or ("full_attention",) * layers)
                   if bool(is_causal) != (t == "sliding_attention")]
        if changed:
            raise field_error("config.json is_causal", is_causal,
                              "null, or the value every layer has anyway (full attention bidirectional inside "
                              "the block, sliding attention causal)",
                              f"It would change layers {changed}, which the MFD drafter does not implement.")
    return layer_types, sliding_window if sliding else None


def expected_shapes(cfg: DrafterConfig, *, num_context_features: int | None = None) -> dict[str, tuple[int, ...]]:
    """The shape of every required tensor of a drafter with this config."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    n_ctx = num_context_features or len(cfg.target_layer_ids) * h
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, n_ctx),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if cfg.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.bias": (h,),
            }
    return shapes


def _read_json(path: Path, field_name: str) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise field_error(field_name, f"invalid JSON ({exc})", "a JSON object") from exc


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    single, index = path / WEIGHTS_FILE, path / WEIGHTS_INDEX_FILE
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        weight_map = _read_json(index, WEIGHTS_INDEX_FILE)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise field_error(f"{WEIGHTS_INDEX_FILE} weight_map", weight_map, "an object of tensor name -> shard file")
        shards = sorted(set(weight_map.values()))
        weights: dict[str, torch.Tensor] = {}
        for shard in shards:
            if not (path / shard).is_file():
                raise field_error(f"{WEIGHTS_INDEX_FILE} shard", shard, "an existing file next to the index")
            weights |= load_file(str(path / shard))
        return weights
    found = sorted(p.name for p in path.iterdir())
    raise field_error("weights", found, f"{WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} in {path}",
                      "Save the drafter with safetensors (save_pretrained(..., safe_serialization=True)).")


def _canonical_names(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """Strip the optional `model.` prefix; set aside tensors that inference ignores."""
    kept, ignored = {}, []
    for name, tensor in weights.items():
        name = name.removeprefix("model.")
        if name.startswith(_IGNORED_PREFIXES):
            ignored.append(name)
        else:
            kept[name] = tensor
    return kept, tuple(sorted(ignored))


def _resolve_modes(cfg: DrafterConfig, weights: Mapping[str, torch.Tensor]) -> DrafterConfig:
    """Fix K and the default path from the weights, checking them against mfd_config."""
    h = cfg.hidden_size
    mode_embed = weights.get("mode_embed")
    if mode_embed is None:
        if cfg.num_modes > 1:
            raise field_error("mode_embed", None,
                              f"a [{cfg.num_modes}, {h}] tensor (mfd_config.num_modes = {cfg.num_modes})",
                              "Either add the mode embeddings or drop mfd_config.num_modes.")
        num_modes = 1
    else:
        if mode_embed.dim() != 2 or mode_embed.shape[1] != h:
            raise field_error("mode_embed shape", tuple(mode_embed.shape), f"[K, {h}] (K modes x hidden_size)")
        num_modes = mode_embed.shape[0]
        if cfg.num_modes and cfg.num_modes != num_modes:
            raise field_error("mfd_config.num_modes", cfg.num_modes, f"{num_modes} (rows of mode_embed)")
    default_mode = cfg.default_mode
    default_embed = weights.get("default_mode_embed")
    if default_embed is not None and tuple(default_embed.shape) != (h,):
        raise field_error("default_mode_embed shape", tuple(default_embed.shape), f"[{h}]")
    if default_mode is None and default_embed is None:
        raise field_error("default_mode_embed", None, f"a [{h}] tensor (mfd_config.default_mode = \"embed\")")
    if default_mode == _UNSPECIFIED:
        default_mode = None if default_embed is not None else 0
    elif default_mode is not None and default_embed is not None:
        raise field_error("default_mode_embed", f"a [{h}] tensor",
                          f"none with mfd_config.default_mode = {default_mode}",
                          "Set mfd_config.default_mode to \"embed\" to draft with it, or remove the tensor.")
    if default_mode is not None and default_mode >= num_modes:
        raise field_error("mfd_config.default_mode", default_mode, f"a mode index below K = {num_modes}")
    draft_vocab = weights.get("draft_vocab")
    draft_vocab_size = None
    if draft_vocab is not None:
        if draft_vocab.dim() != 1 or draft_vocab.dtype not in (torch.int32, torch.int64):
            raise field_error("draft_vocab", f"{draft_vocab.dtype} {tuple(draft_vocab.shape)}",
                              "a 1-D int64 tensor of target ids")
        if draft_vocab.numel() > 1 and not bool((draft_vocab[1:] > draft_vocab[:-1]).all()):
            raise field_error("draft_vocab", "unsorted or repeated ids", "strictly increasing target token ids")
        if draft_vocab.numel() and (int(draft_vocab[0]) < 0 or int(draft_vocab[-1]) >= cfg.vocab_size):
            raise field_error("draft_vocab ids", (int(draft_vocab[0]), int(draft_vocab[-1])),
                              f"ids in [0, {cfg.vocab_size})")
        draft_vocab_size = draft_vocab.numel()
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size != draft_vocab_size:
        raise field_error("mfd_config.draft_vocab_size", cfg.draft_vocab_size,
                          f"{draft_vocab_size} (length of draft_vocab)")
    return replace(cfg, num_modes=num_modes, default_mode=default_mode, draft_vocab_size=draft_vocab_size,
                   mode_prior=_resolve_mode_prior(cfg, weights, num_modes))


def _resolve_mode_prior(cfg: DrafterConfig, weights: Mapping[str, torch.Tensor], num_modes: int) -> str:
    """The tree's mode weighting: "gate" with a well-formed gate, else "uniform"; see the module docstring."""
    present = [name for name in MODE_GATE_TENSORS if name in weights]
    rule = cfg.mode_prior or ("gate" if present else "uniform")
    if rule == "uniform":
        if present:
            raise field_error(present[0], f"a {tuple(weights[present[0]].shape)} tensor",
                              'none with mfd_config.mode_prior = "uniform"',
                              'Set mfd_config.mode_prior to "gate" to weigh the modes by it, or remove the mode gate.')
        return rule
    h = cfg.hidden_size
    if num_modes < 2:
        raise field_error("mfd_config.mode_prior" if cfg.mode_prior else present[0], "a mode gate",
                          f"none for a drafter with K = {num_modes} mode (a gate weighs K >= 2 modes)")
    for name, shape in zip(MODE_GATE_TENSORS, ((num_modes, h), (num_modes,))):
        tensor = weights.get(name)
        if tensor is None:
            raise field_error(name, None, f"a {list(shape)} tensor (the mode gate, mfd_config.mode_prior = \"gate\")",
                              "A gate needs both mode_prior.weight and mode_prior.bias.")
        if tuple(tensor.shape) != shape or not tensor.is_floating_point():
            raise field_error(f"{name} shape", f"{tensor.dtype} {tuple(tensor.shape)}",
                              f"a floating {list(shape)} tensor (K = {num_modes} modes x hidden_size {h})")
    return rule


def validate_weights(cfg: DrafterConfig, weights: Mapping[str, torch.Tensor]) -> None:
    """Every required tensor present with its shape; nothing unknown left over (another DFlash-family
    drafter's tensors refused by name)."""
    for family, _, _, parts, fix in REFUSED_FAMILIES:
        named = sorted(n for n in weights if any(part in f".{n}" for part in parts))
        if named:
            raise _family_error(family, f"weights {named[:3]}", fix)
    shapes = expected_shapes(cfg, num_context_features=None)
    fc = weights.get("fc.weight")
    if fc is not None and fc.dim() == 2 and fc.shape[0] == cfg.hidden_size:
        n_ctx = len(cfg.target_layer_ids)
        if fc.shape[1] % n_ctx:
            raise field_error("fc.weight shape", tuple(fc.shape),
                              f"[{cfg.hidden_size}, {n_ctx} x target hidden size] ({n_ctx} target_layer_ids)")
        shapes["fc.weight"] = (cfg.hidden_size, fc.shape[1])
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise field_error("weights", f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}",
                          f"all {len(shapes)} DFlash tensors", "Is this a DFlash/MFD drafter checkpoint?")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise field_error(f"{name} shape", tuple(weights[name].shape), str(list(shape)))
    optional = {"mode_embed", "default_mode_embed", "draft_vocab", *MODE_GATE_TENSORS}
    unknown = sorted(n for n in weights if n not in shapes and n not in optional)
    if unknown:
        raise field_error("weights", f"unknown tensors {unknown[:5]}", "only DFlash/MFD drafter tensors",
                          "Remove them or convert the checkpoint; nothing is dropped silently.")


def load_drafter(path: str | Path, *, device: str | torch.device = "cpu") -> DrafterCheckpoint:
    """Load and validate a DFlash or MFD drafter directory."""
    path = Path(path)
    if not path.is_dir():
        raise field_error("drafter path", str(path), "a directory with config.json and safetensors weights")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise field_error("config.json", None, f"a file at {config_path}")
    raw = _read_json(config_path, "config.json")
    cfg = parse_drafter_config(raw)
    for name, why in REFUSED_FILES.items():
        if (path / name).exists():
            raise field_error(name, f"a file in {path}", "none", f"{why}; remove it to serve this drafter with MFD")
    if cfg.unread_keys and path.resolve() not in _WARNED_UNREAD:
        _WARNED_UNREAD.add(path.resolve())
        logger.warning("drafter %s: config.json keys %s are not read by MFD (neither z-lab's DFlashDraftModel nor "
                       "SGLang's DFlash loader reads them for a DFlash drafter, as far as this plugin knows); if "
                       "they change how the drafter drafts, acceptance suffers, never the output",
                       path, ", ".join(cfg.unread_keys))
    weights, ignored = _canonical_names(_read_weights(path))
    cfg = _resolve_modes(cfg, weights)
    validate_weights(cfg, weights)
    weights = {name: t.to(device) for name, t in weights.items()}
    return DrafterCheckpoint(path=path, config=cfg, weights=weights, ignored=ignored)


def save_drafter(path: str | Path, raw_config: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> None:
    """Write a drafter directory in the format load_drafter reads (config.json + model.safetensors)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(dict(raw_config), indent=2) + "\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(path / WEIGHTS_FILE))


# --- the fit check against a target -------------------------------------------------------------

def target_text_config(target: Any) -> dict[str, Any]:
    """The target's text config as a dict: from a model directory, a mapping or a transformers config
    (a multimodal config's `text_config`)."""
    if isinstance(target, (str, Path)):
        config_path = Path(target) / CONFIG_FILE
        if not config_path.is_file():
            raise field_error("target config.json", None, f"a file at {config_path}")
        target = _read_json(config_path, "target config.json")
    if not isinstance(target, Mapping):
        target = target.to_dict()
    return dict(target.get("text_config") or target)


def check_fits_target(ckpt: DrafterCheckpoint, target: Any) -> None:
    """Raise CheckpointError unless the drafter can run on this target (a config dict, HF config or dir)."""
    cfg, tgt = ckpt.config, target_text_config(target)
    t_hidden, t_vocab, t_layers = tgt.get("hidden_size"), tgt.get("vocab_size"), tgt.get("num_hidden_layers")
    if cfg.hidden_size != t_hidden:
        raise field_error("hidden_size", cfg.hidden_size,
                          f"{t_hidden} (the target's; the drafter borrows its embeddings)")
    fc_in = ckpt.weights["fc.weight"].shape[1]
    if fc_in != len(cfg.target_layer_ids) * t_hidden:
        raise field_error("fc.weight input size", fc_in, f"{len(cfg.target_layer_ids)} x {t_hidden} = "
                          f"{len(cfg.target_layer_ids) * t_hidden} (target_layer_ids x target hidden_size)")
    if cfg.vocab_size != t_vocab:
        raise field_error("vocab_size", cfg.vocab_size, f"{t_vocab} (the target's)")
    bad = [i for i in cfg.target_layer_ids if i >= t_layers]
    if bad:
        raise field_error("dflash_config.target_layer_ids", list(cfg.target_layer_ids),
                          f"layer indices below the target's depth {t_layers} (out of range: {bad})")
    if cfg.num_target_layers is not None and cfg.num_target_layers != t_layers:
        raise field_error("num_target_layers", cfg.num_target_layers, f"{t_layers} (the target's num_hidden_layers)",
                          "The drafter was trained for a target of another depth.")
    if cfg.mask_token_id >= t_vocab:
        raise field_error("dflash_config.mask_token_id", cfg.mask_token_id,
                          f"a token id below the target's vocab_size {t_vocab}")
