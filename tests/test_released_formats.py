"""Released drafter formats, proven without the hub (issue 67 item 2).

Drafters are written as the released checkpoints are laid out by `released_layouts` (a writer of its own: z-lab's
tensor names, transformers' own config writer, shards, the `model.` prefix), never from what the loader expects:
- the MFD cards at small width with their real layer counts and target-layer lists, on targets of the real depth:
  hhhhhhy5/MFD-Qwen3-8B (5 layers reading [1, 9, 17, 25, 33] of a 36-layer Qwen3, block 16, mode_embed 8 x H,
  mode_gate.weight / .bias), hhhhhhy5/MFD-Qwen3.5-4B (6 layers reading [1, 5, ..., 29] of the 32-layer hybrid
  Qwen3.5 shape), and z-lab/Qwen3-8B-DFlash-b16 (K = 1) in the transformers-4.57 form with top-level keys;
  each re-lays make-tiny's trained drafter on a deepened tiny target (zero-output layers: the same function),
  so speculation is real. Each loads, passes `inspect --target`, drafts exactly what the trained drafter
  drafts, and is served exactly in a CPU server (one per layout) whose rounds are the reference engine's.
- the external oracle: for every config variant, SGLang 0.5.23's own DFlash config parsing (its `get_config`,
  `parse_dflash_draft_config`, `get_rope_config`, sliding-window and per-layer attention type) and
  `parse_drafter_config` agree on block size, mask token, target layers, rope theta, window and causality;
- keys honoured with non-neutral values (rope theta through `rope_parameters` or `rope_theta`, sliding layers,
  attention biases) give the numbers of a reference written here from z-lab's DFlashDraftModel on transformers'
  Qwen3 modules (its config read by transformers itself), on random weights;
- every other key z-lab's or SGLang's DFlash code reads is accepted at its neutral value and refused by name
  otherwise; DFlash2 / DSpark / LiLiCorr / Domino / Laguna / Muse drafters (architecture, config key or tensor)
  are refused by name with the algorithm that serves them, also at an MFD launch; unknown keys are named in a
  warning and by `inspect`.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import target_greedy
from mfd_sglang.checkpoint import (
    NEUTRAL_ONLY_KEYS, CheckpointError, load_drafter, parse_drafter_config,
)
from mfd_sglang.cli import main
from mfd_sglang.drafter import MFDDrafter, context_features
from mfd_sglang.hf import SpeculativeGenerator
from references import served_summary, verify_summary
from released_layouts import (
    MFD_QWEN3_8B, MFD_QWEN35_4B, ZLAB_QWEN3_8B_B16, deepen_target, drafter_shape, random_zlab_tensors,
    relay_drafter, transformers4_config, transformers5_config, write_layout,
)
from servers import admitted_together, generate_ids, log_tail, plugin_env, resolve, served_without_leaks, start_server

MAX_NEW = 32
BUDGET = 16


# --- the replicas ----------------------------------------------------------------------------------
def mask_token_id(pair: Path) -> int:
    return json.loads((pair / "drafter" / "config.json").read_text())["dflash_config"]["mask_token_id"]


@pytest.fixture(scope="module")
def replicas(tiny_pair, hybrid_pair, tmp_path_factory) -> dict[str, tuple[Path, Path, Path, Path]]:
    """{card name: (replica drafter, its deep target, the trained tiny drafter it re-lays, the tiny target)}:
    MFD-Qwen3-8B in the transformers-5 form (block size in dflash_config, `model.` prefix, two shards),
    MFD-Qwen3.5-4B in the transformers-5 form with a top-level block size (three shards, no prefix),
    Qwen3-8B-DFlash-b16 in the transformers-4.57 form with top-level keys (one file)."""
    root = tmp_path_factory.mktemp("released")
    deep_qwen3 = deepen_target(tiny_pair / "target", root / "qwen3-36", MFD_QWEN3_8B)
    deep_hybrid = deepen_target(hybrid_pair / "target", root / "qwen3.5-32", MFD_QWEN35_4B)
    shape = drafter_shape(tiny_pair / "drafter")
    mfd8b = write_layout(
        root / "MFD-Qwen3-8B",
        transformers5_config(MFD_QWEN3_8B, shape, mask_token_id=mask_token_id(tiny_pair), rope_theta=10000.0),
        relay_drafter(tiny_pair / "drafter", MFD_QWEN3_8B), prefix="model.", shards=2)
    mfd35 = write_layout(
        root / "MFD-Qwen3.5-4B",
        transformers5_config(MFD_QWEN35_4B, drafter_shape(hybrid_pair / "drafter"),
                             mask_token_id=mask_token_id(hybrid_pair), rope_theta=10000.0, dflash_block_size=False),
        relay_drafter(hybrid_pair / "drafter", MFD_QWEN35_4B), shards=3)
    zlab = write_layout(
        root / "Qwen3-8B-DFlash-b16",
        transformers4_config(ZLAB_QWEN3_8B_B16, shape, mask_token_id=mask_token_id(tiny_pair), rope_theta=10000.0),
        relay_drafter(tiny_pair / "drafter-dflash", ZLAB_QWEN3_8B_B16))
    return {MFD_QWEN3_8B.name: (mfd8b, deep_qwen3, tiny_pair / "drafter", tiny_pair / "target"),
            MFD_QWEN35_4B.name: (mfd35, deep_hybrid, hybrid_pair / "drafter", hybrid_pair / "target"),
            ZLAB_QWEN3_8B_B16.name: (zlab, deep_qwen3, tiny_pair / "drafter-dflash", tiny_pair / "target")}


CARDS = {card.name: card for card in (MFD_QWEN3_8B, MFD_QWEN35_4B, ZLAB_QWEN3_8B_B16)}


@pytest.mark.parametrize("name", list(CARDS))
def test_replica_loads_and_inspect_fits_its_deep_target(replicas, name, capsys):
    card, (drafter, target, _, _) = CARDS[name], replicas[name]
    assert any(drafter.glob("model-0000*-of-0000*.safetensors")) == (card.name != ZLAB_QWEN3_8B_B16.name)
    ckpt = load_drafter(drafter)
    cfg = ckpt.config
    assert (cfg.num_hidden_layers, cfg.target_layer_ids, cfg.block_size) == (
        card.layers, tuple(card.target_layer_ids), card.block_size)
    assert (cfg.num_modes, cfg.num_target_layers, cfg.unread_keys) == (card.num_modes, card.target_depth, ())
    assert ckpt.ignored == (("mode_gate.bias", "mode_gate.weight") if card.num_modes > 1 else ())
    assert cfg.mode_prior == "uniform"  # the cards' mode_gate is a training-time layer, not the tree's mode gate
    assert main(["inspect", str(drafter), "--target", str(target), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fits_target"] and info["num_modes"] == card.num_modes and info["block_size"] == card.block_size
    assert info["target_layer_ids"] == card.target_layer_ids and info["unread_config_keys"] == []


@pytest.mark.parametrize("name", list(CARDS))
def test_replica_drafts_what_the_trained_drafter_drafts(replicas, name):
    """The deep target computes the tiny one's logits, the card's target-layer ids read the features the trained
    drafter read, and the replica (read from the released layout) drafts the trained drafter's states at the
    card's block size for every mode: the layout is read as written, fc's column blocks in target-layer order."""
    from transformers import AutoModelForCausalLM

    card, (drafter_path, deep_path, trained_path, tiny_path) = CARDS[name], replicas[name]
    deep = AutoModelForCausalLM.from_pretrained(deep_path, dtype=torch.float32).eval()
    tiny = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    ids = torch.tensor([[int(i) for i in torch.randint(12, tiny.config.vocab_size, (20,),
                                                        generator=torch.Generator().manual_seed(1))]])
    with torch.no_grad():
        deep_out = deep(ids, output_hidden_states=True)
        tiny_out = tiny(ids, output_hidden_states=True)
    torch.testing.assert_close(deep_out.logits, tiny_out.logits)
    replica = MFDDrafter.from_checkpoint(load_drafter(drafter_path)).float()
    trained_ckpt = load_drafter(trained_path)
    trained_ckpt.config = replace(trained_ckpt.config, block_size=card.block_size)
    trained = MFDDrafter.from_checkpoint(trained_ckpt).float()
    positions = torch.arange(ids.shape[1])[None]
    embed = tiny.get_input_embeddings().weight
    block = torch.full((1, card.block_size), replica.cfg.mask_token_id)
    block[0, 0] = ids[0, -1]
    block_pos = ids.shape[1] + torch.arange(card.block_size)[None]
    with torch.no_grad():
        got = replica(embed[block], block_pos, replica.context_kv(
            context_features(deep_out.hidden_states, replica.cfg.target_layer_ids), positions))
        want = trained(embed[block], block_pos, trained.context_kv(
            context_features(tiny_out.hidden_states, [0, 1]), positions))
    assert replica.cfg.target_layer_ids == tuple(card.target_layer_ids)
    assert got.shape == (1, card.num_modes, card.block_size - 1, replica.cfg.hidden_size)
    for mode in range(card.num_modes):
        torch.testing.assert_close(got[:, mode], want[:, mode % want.shape[1]], atol=2e-5, rtol=2e-5)


# --- served exactly in CPU servers, one per layout ------------------------------------------------
@pytest.fixture(scope="module", params=list(CARDS))
def replica_server(request, replicas, tiny_pair, tmp_path_factory):
    """An MFD server (B = 16, fp32) on the replica's deep target with the replica as its drafter."""
    drafter, target, _, _ = replicas[request.param]
    srv = start_server(tmp_path_factory, tiny_pair, drafter, "MFD", BUDGET, max_running=6, target=target,
                       extra_env=plugin_env("hold_admission"))
    srv.card, srv.drafter, srv.deep_target = CARDS[request.param], drafter, target
    yield from served_without_leaks(srv)


def test_replica_is_served_exactly_with_the_reference_engines_rounds(replica_server, capsys):
    """Six prompts at once give the deep target's greedy decoding; each request's verify rounds are the
    reference engine's on the same drafter and budget (rounds, accepted-draft histogram, tokens), and the
    trees accept: the accept length is printed (pytest -s) and must beat one token per round by far."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = replica_server.deep_target
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target)
    texts = ["one two three four", "alpha bravo charlie", "monday tuesday", "january february march",
             "red orange yellow", "we may go home"]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    with admitted_together(replica_server, len(prompts)), concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        served = list(pool.map(lambda ids: generate_ids(replica_server, ids, MAX_NEW), prompts))
    # The reference engine verifies dense targets only: the hybrid replica's drafts are held to the trained
    # drafter's above, its rounds here to exactness and the accept length.
    hybrid = replica_server.card.hybrid
    engine = None if hybrid else SpeculativeGenerator.from_paths(target, replica_server.drafter, budget=BUDGET)
    for ids, (got, meta) in zip(prompts, served):
        assert got == target_greedy(model, ids, MAX_NEW), log_tail(replica_server.log_path)
        if engine is not None:
            assert served_summary(meta) == verify_summary(engine.generate(ids, MAX_NEW)), ids
    tau = sum(m["completion_tokens"] for _, m in served) / sum(m["spec_verify_ct"] for _, m in served)
    with capsys.disabled():
        print(f"\n{replica_server.card.name}: accept length {tau:.2f} over {len(prompts)} concurrent requests")
    assert tau > 2.5, tau


# --- the external oracle: SGLang's own DFlash config parsing -------------------------------------
SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "vocab_size": 100}


def _without_block_sizes(raw: dict) -> dict:
    raw.pop("block_size", None)
    raw["dflash_config"].pop("block_size", None)
    return raw


def config_variants() -> dict[str, tuple[dict, int]]:
    """{name: (config.json, the target's depth)}: the forms the released drafters come in and the corners of
    the format's rules."""
    t5 = lambda card=MFD_QWEN3_8B, **kw: transformers5_config(card, SHAPE, mask_token_id=97, **kw)  # noqa: E731
    t4 = lambda card=ZLAB_QWEN3_8B_B16: transformers4_config(card, SHAPE, mask_token_id=97,  # noqa: E731
                                                             rope_theta=1000000.0)
    sliding = t5(rope_theta=5e5) | {"use_sliding_window": True, "sliding_window": 4,
                                    "layer_types": ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]}
    derived = t5(rope_theta=5e5) | {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 3}
    del derived["layer_types"]
    nested_depth = t5(rope_theta=1e6)
    nested_depth["dflash_config"]["num_target_layers"] = nested_depth.pop("num_target_layers")
    both = t4()
    both["dflash_config"] = {"mask_token_id": 3, "target_layer_ids": [0, 2, 4], "block_size": 8}
    neutral = t5(rope_theta=1e6) | {"is_causal": False, "input_embedding_scale": 1.0, "hidden_act": "silu",
                                    "use_gemma_norm": False, "rope_is_neox_style": True}
    neutral["dflash_config"] |= {"output_multiplier": 1.0, "final_logit_softcapping": None,
                                 "attention_value_scale": None, "attention_sink_bias": False,
                                 "conv_kernel_size": 0, "conv_group_size": 0, "selector_rank": 0, "selector_top_k": 0}
    causal_sliding = t5(rope_theta=1e6) | {"use_sliding_window": True, "sliding_window": 16, "is_causal": True,
                                           "layer_types": ["sliding_attention"] * 5}
    return {
        "MFD-Qwen3-8B, transformers 5": (t5(rope_theta=1e6), 36),
        "MFD-Qwen3.5-4B, block size at top level": (t5(MFD_QWEN35_4B, rope_theta=1e7, dflash_block_size=False), 32),
        "z-lab transformers 4.57, keys at top level": (t4(), 36),
        "dflash_config wins over top level": (both, 36),
        "rope_parameters wins over rope_theta": (t5(rope_theta=1e6) | {"rope_theta": 5.0}, 36),
        "no block size (16)": (_without_block_sizes(t5(rope_theta=1e6)), 36),
        "num_target_layers in dflash_config": (nested_depth, 36),
        "sliding layers": (sliding, 36),
        "sliding layers from max_window_layers": (derived, 36),
        "sliding_window without use_sliding_window": (t5(rope_theta=1e6) | {"sliding_window": 4096}, 36),
        "neutral values of unimplemented keys": (neutral, 36),
        "is_causal true on sliding layers": (causal_sliding, 36),
    }


def sglang_reading(path: Path, target_depth: int) -> dict:
    """What SGLang 0.5.23's DFLASH makes of the drafter config at `path`: its config loader, its DFlash config
    parser, its rope reader, and per layer the window (HF convention: SGLang's window_left + 1) and causality
    its DFlash attention layer is built with."""
    from sglang.srt.models.dflash import _get_dflash_layer_attention_params
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers.common import get_rope_config
    from sglang.srt.utils.hf_transformers_utils import get_config

    config = get_config(str(path), trust_remote_code=False)
    parsed = parse_dflash_draft_config(draft_hf_config=config)
    layers = [_get_dflash_layer_attention_params(config, i) for i in range(config.num_hidden_layers)]
    return {
        "block_size": parsed.resolve_block_size(default=16),
        "mask_token_id": parsed.mask_token_id,
        "target_layer_ids": tuple(parsed.resolve_target_layer_ids(target_num_layers=target_depth,
                                                                   draft_num_layers=config.num_hidden_layers)),
        "num_target_layers": parsed.num_target_layers,
        "rope_theta": float(get_rope_config(config)[0]),
        "windows": tuple(None if window < 0 else window + 1 for window, _ in layers),
        "causal": tuple(kind == AttentionType.DECODER for _, kind in layers),
    }


def our_reading(raw: dict) -> dict:
    cfg = parse_drafter_config(raw)
    return {
        "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.target_layer_ids,
        "num_target_layers": cfg.num_target_layers, "rope_theta": cfg.rope_theta,
        "windows": tuple(cfg.sliding_window if cfg.is_sliding(i) else None for i in range(cfg.num_hidden_layers)),
        # the drafter: full attention bidirectional inside the block, sliding attention causal in its window
        "causal": tuple(cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)),
    }


@pytest.mark.parametrize("variant", list(config_variants()))
def test_sglang_parses_every_config_variant_as_we_do(tmp_path, variant):
    raw, depth = config_variants()[variant]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours, theirs = our_reading(raw), sglang_reading(tmp_path, depth)
    assert ours == theirs
    if "sliding" in variant and "without" not in variant:
        assert any(ours["windows"]), "the variant must have sliding layers"


def test_sliding_layers_without_their_window_are_refused_as_sglang_refuses_them(tmp_path):
    """Qwen3Config keeps sliding_window only with use_sliding_window: SGLang's DFLASH cannot build such a
    drafter (z-lab's would slide without a window); MFD refuses it by name too."""
    from sglang.srt.speculative.dflash_utils import get_dflash_attention_sliding_window_size
    from sglang.srt.utils.hf_transformers_utils import get_config

    raw = transformers5_config(MFD_QWEN3_8B, SHAPE, mask_token_id=97, rope_theta=1e6)
    raw |= {"sliding_window": 4, "layer_types": ["sliding_attention"] + ["full_attention"] * 4}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="sliding_attention layers require config.sliding_window"):
        get_dflash_attention_sliding_window_size(get_config(str(tmp_path), trust_remote_code=False))
    with pytest.raises(CheckpointError, match="sliding_window: found None.*use_sliding_window"):
        parse_drafter_config(raw)


# --- honoured keys: the numbers of a reference written from z-lab's DFlashDraftModel --------------
def zlab_reference_hidden(path: Path, features: torch.Tensor, block_embeds: torch.Tensor) -> torch.Tensor:
    """z-lab's DFlashDraftModel forward for one request (context at positions 0..L-1, the block after it), on
    transformers' Qwen3 modules and transformers' own reading of config.json (rope, layer types, window,
    is_causal): the block attends to the projected context and to itself; a layer is causal iff it slides
    (or as is_causal says), a sliding layer sees keys less than sliding_window positions away. Returns the
    final-normed states of block slots 1.. [1, T-1, H]."""
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

    config = AutoConfig.from_pretrained(path)
    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        weights |= {n.removeprefix("model."): t.float() for n, t in load_file(str(file)).items()}

    def norm(name: str, size: int) -> Qwen3RMSNorm:
        module = Qwen3RMSNorm(size, eps=config.rms_norm_eps)
        module.weight.data.copy_(weights[name])
        return module

    def linear(prefix: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weights[prefix + ".weight"], weights.get(prefix + ".bias"))

    hd, ctx_len, block = config.head_dim, features.shape[1], block_embeds.shape[1]
    ctx = norm("hidden_norm.weight", config.hidden_size)(F.linear(features, weights["fc.weight"]))
    x = block_embeds
    cos, sin = Qwen3RotaryEmbedding(config)(x, torch.arange(ctx_len + block)[None])
    cos, sin = cos[:, None], sin[:, None]
    query_pos = ctx_len + torch.arange(block)[:, None]
    key_pos = torch.arange(ctx_len + block)[None]
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        h = norm(p + "input_layernorm.weight", config.hidden_size)(x)
        q = norm(p + "self_attn.q_norm.weight", hd)(linear(p + "self_attn.q_proj", h).view(1, block, -1, hd))
        k = torch.cat([linear(p + "self_attn.k_proj", ctx), linear(p + "self_attn.k_proj", h)], 1)
        v = torch.cat([linear(p + "self_attn.v_proj", ctx), linear(p + "self_attn.v_proj", h)], 1)
        k = norm(p + "self_attn.k_norm.weight", hd)(k.view(1, ctx_len + block, -1, hd)).transpose(1, 2)
        v = v.view(1, ctx_len + block, -1, hd).transpose(1, 2)
        q = q.transpose(1, 2)
        q = q * cos[..., -block:, :] + rotate_half(q) * sin[..., -block:, :]
        k = k * cos + rotate_half(k) * sin
        kind = (config.layer_types or ["full_attention"] * config.num_hidden_layers)[i]
        is_causal = getattr(config, "is_causal", None)
        causal = kind == "sliding_attention" if is_causal is None else bool(is_causal)
        window = config.sliding_window if kind == "sliding_attention" else None
        visible = torch.ones(block, ctx_len + block, dtype=torch.bool)
        if causal:
            visible &= key_pos <= query_pos
        if window is not None:
            visible &= (query_pos - key_pos < window) & (causal | (key_pos - query_pos < window))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=hd ** -0.5, enable_gqa=True)
        x = x + linear(p + "self_attn.o_proj", attn.transpose(1, 2).reshape(1, block, -1))
        mlp = Qwen3MLP(config)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, name).weight.data.copy_(weights[f"{p}mlp.{name}.weight"])
        x = x + mlp(norm(p + "post_attention_layernorm.weight", config.hidden_size)(x))
    return norm("norm.weight", config.hidden_size)(x)[:, 1:]


def honoured_variants() -> dict[str, tuple[dict, str, int]]:
    """{name: (config.json, tensor prefix, shards)} with non-default values of the keys the drafter honours."""
    t5 = transformers5_config(MFD_QWEN3_8B, SHAPE, mask_token_id=97, rope_theta=1e6)
    sliding = t5 | {"use_sliding_window": True, "sliding_window": 3, "is_causal": None,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention",
                                    "full_attention"]}
    t4 = transformers4_config(ZLAB_QWEN3_8B_B16, SHAPE, mask_token_id=97, rope_theta=500.0)
    return {"rope_parameters theta 1e6, model. prefix, shards": (t5, "model.", 2),
            "sliding layers (window 3, causal)": (sliding, "", 0),
            "rope_theta 500 at top level, attention biases, rms_norm_eps 1e-5": (
                t4 | {"attention_bias": True, "rms_norm_eps": 1e-5}, "", 0)}


@pytest.mark.parametrize("variant", list(honoured_variants()))
def test_honoured_keys_give_the_reference_numbers_on_random_weights(tmp_path, variant):
    raw, prefix, shards = honoured_variants()[variant]
    path = write_layout(tmp_path / "d", raw, random_zlab_tensors(raw, seed=3), prefix=prefix, shards=shards)
    drafter = MFDDrafter.from_checkpoint(load_drafter(path)).float()
    gen = torch.Generator().manual_seed(4)
    ctx_len, block = 7, drafter.cfg.block_size
    features = torch.randn(1, ctx_len, len(drafter.cfg.target_layer_ids) * SHAPE["hidden_size"], generator=gen)
    block_embeds = torch.randn(1, block, SHAPE["hidden_size"], generator=gen)
    with torch.no_grad():
        ours = drafter(block_embeds, ctx_len + torch.arange(block)[None],
                       drafter.context_kv(features, torch.arange(ctx_len)[None]))[:, 0]
        reference = zlab_reference_hidden(path, features, block_embeds)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


# --- keys refused by name, unknown keys named ------------------------------------------------------
def _refusals() -> dict[str, tuple[Callable[[dict], None], str]]:
    """{case: (edit of a valid config.json, what the CheckpointError must say)}."""
    def top(**kw):
        return lambda raw: raw.update(kw)

    def nested(**kw):
        return lambda raw: raw["dflash_config"].update(kw)

    dflash2, dspark = "DFlash2 .*--speculative-algorithm DFLASH", "DSpark .*--speculative-algorithm DSPARK"
    cases = {
        "architecture DFlash2DraftModel": (top(architectures=["DFlash2DraftModel"]), "architectures.*" + dflash2),
        "conv_kernel_size": (nested(conv_kernel_size=2, conv_group_size=16), "dflash_config.conv_kernel_size.*" + dflash2),
        "selector_rank": (nested(selector_rank=256, selector_top_k=16), "selector_rank = 256.*" + dflash2),
        "architecture Qwen3DSparkModel": (top(architectures=["Qwen3DSparkModel"]), dspark),
        "markov_rank": (top(markov_rank=64), "markov_rank = 64.*" + dspark),
        "LiLiCorr": (top(architectures=["LiLiCorrDraftModel"]), "LiLiCorr.*DFLASH"),
        "Domino projector": (nested(projector_type="domino"), "dflash_config.projector_type.*Domino.*DFLASH"),
        "Domino emb_dim": (top(emb_dim=256), "emb_dim = 256.*Domino"),
        "Laguna gating": (top(gating="per-head"), "gating.*Laguna"),
        "is_causal true on full layers": (top(is_causal=True), r"is_causal: found True.*layers \[0, 1, 2, 3, 4\]"),
        "is_causal false on a sliding layer": (
            top(is_causal=False, use_sliding_window=True, sliding_window=8,
                layer_types=["sliding_attention"] + ["full_attention"] * 4), r"is_causal: found False.*layers \[0\]"),
        "rope scaling": (top(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
                         "rope_parameters.rope_type: found 'yarn'"),
        "partial rope": (top(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
                         "rope_parameters.partial_rotary_factor: found 0.5"),
        "quantization_config": (top(quantization_config={"quant_method": "fp8"}), "quantization_config.*fp8"),
        "text_config": (top(text_config={"hidden_size": 32}), "text_config"),
        "target layers out of order": (nested(target_layer_ids=[9, 1, 17, 25, 33]),
                                       r"target_layer_ids: found \[9, 1, 17, 25, 33\], expected strictly increasing"),
    }
    non_neutral = {"input_embedding_scale": 2.0, "output_multiplier": 0.2, "final_logit_softcapping": 20.0,
                   "attention_value_scale": 0.5, "attention_sink_bias": True, "swa_window_size": 128,
                   "use_gemma_norm": True, "rope_is_neox_style": False, "is_neox_style": False,
                   "partial_rotary_factor": 0.5, "hidden_act": "swigluoai", "has_embed_tokens": True,
                   "has_lm_head": True, "sample_from_anchor": False, "eagle_aux_hidden_state_layer_ids": [2, 10]}
    assert set(non_neutral) == set(NEUTRAL_ONLY_KEYS), "every neutral-only key is tried at a non-neutral value"
    for key, value in non_neutral.items():
        # SGLang reads output_multiplier, final_logit_softcapping and the attention extras inside dflash_config
        edit = nested if key in ("output_multiplier", "final_logit_softcapping", "attention_value_scale",
                                 "attention_sink_bias", "swa_window_size") else top
        where = "dflash_config." if edit is nested else ""
        cases[f"{key} {value!r}"] = (edit(**{key: value}), rf"config\.json {where}{key}: found {re.escape(repr(value))}")
    return cases


REFUSALS = _refusals()


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_key_the_drafter_cannot_honour_is_refused_by_name(case):
    edit, message = REFUSALS[case]
    raw = transformers5_config(MFD_QWEN3_8B, SHAPE, mask_token_id=97, rope_theta=1e6)
    parse_drafter_config(raw)  # valid before the edit
    edit(raw)
    with pytest.raises(CheckpointError, match=message):
        parse_drafter_config(raw)


@pytest.mark.parametrize("tensor", ["layers.0.attention_conv.base_kernel", "layers.3.mlp_conv.kernel_projection.weight",
                                    "candidate_selector.successor_codebook", "lilicorr.slot_embedding",
                                    "prefix_gru.weight_ih_l0"])
def test_another_familys_tensors_are_refused_by_name(tmp_path, tensor):
    raw = transformers5_config(MFD_QWEN3_8B, SHAPE, mask_token_id=97, rope_theta=1e6)
    tensors = random_zlab_tensors(raw) | {tensor: torch.zeros(2, 2)}
    with pytest.raises(CheckpointError, match=rf"weights \['{tensor}'\]: a .* drafter, not a DFlash / MFD one.*"
                                              "--speculative-algorithm DFLASH"):
        load_drafter(write_layout(tmp_path / "d", raw, tensors, prefix="model."))


def test_a_trained_mask_embedding_file_is_refused(tmp_path):
    raw = transformers5_config(MFD_QWEN3_8B, SHAPE, mask_token_id=97, rope_theta=1e6)
    path = write_layout(tmp_path / "d", raw, random_zlab_tensors(raw))
    load_drafter(path)
    torch.save({"embedding": torch.zeros(SHAPE["hidden_size"]), "mask_token_id": 97}, path / "mask_embedding.pt")
    with pytest.raises(CheckpointError, match="mask_embedding.pt: found .*SGLang's DFLASH"):
        load_drafter(path)


def test_unknown_keys_load_with_a_warning_naming_them_and_inspect_lists_them(tmp_path, caplog, capsys):
    raw = transformers5_config(MFD_QWEN3_8B, SHAPE, mask_token_id=97, rope_theta=1e6)
    raw |= {"architectures": ["MFDDraftModel"], "my_scale": 3.0, "mfd_config": {"num_modes": 1, "spare": 1}}
    raw["dflash_config"]["new_knob"] = True
    path = write_layout(tmp_path / "d", raw, random_zlab_tensors(raw))
    with caplog.at_level(logging.WARNING, logger="mfd_sglang.checkpoint"):
        ckpt = load_drafter(path)
    unread = ["architectures", "my_scale", "dflash_config.new_knob", "mfd_config.spare"]
    assert list(ckpt.config.unread_keys) == unread
    assert any(all(k in r.getMessage() for k in unread) for r in caplog.records), caplog.text
    assert main(["inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unread_config_keys"] == unread
    # the released forms carry none: every key of theirs is honoured, checked or listed as ignorable
    for raw, _ in config_variants().values():
        assert parse_drafter_config(raw).unread_keys == ()


def test_an_mfd_launch_refuses_a_dflash2_drafter_by_name(tiny_pair, tmp_path):
    """Through SGLang's own argument resolution of an MFD launch (where the plugin validates the drafter)."""
    raw = json.loads((tiny_pair / "drafter-dflash" / "config.json").read_text())
    raw["dflash_config"] |= {"conv_kernel_size": 2, "conv_group_size": 16}
    path = tmp_path / "dflash2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    (path / "model.safetensors").symlink_to(tiny_pair / "drafter-dflash" / "model.safetensors")
    [result] = resolve(tiny_pair, ["--speculative-draft-model-path", str(path)])
    assert "dflash_config.conv_kernel_size = 2: a DFlash2" in result.get("error", ""), result
    assert "--speculative-algorithm DFLASH" in result["error"]
