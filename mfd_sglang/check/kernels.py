"""Each Triton kernel of the round against its torch reference, at given shapes: rows for a check's sections.

Every function yields one row per case (`run.measured_row`: labels, the measured differences, `ok`), the
Triton call under `host_syncs_raise` (on CUDA a host sync in it raises: it must replay in a CUDA graph). The
comparisons are the kernel tests' (tests/test_tree_triton.py, test_tree_walk_triton.py,
test_vocab_candidates_triton.py, test_mode_attention.py, test_drafter_kernels.py):

- tree: the mixture tree bit for bit (tokens, parents, depths, modes, valid, scores), and its walks: the verify
  layout, SGLang's custom mask and the accepted path under a target that follows each node's first child
  (deep paths), every field bit for bit (a failed row's `mismatch` names the fields that differ);
- vocab: on small-integer inputs (every logit exact whatever the GEMM's order) the candidate ids bit for bit;
  on random bf16 inputs (rounding may move near-ties) >= 97% of the candidates shared;
- attention: the mode attention within 1e-4 (float32) / 3e-2 (half) of the float32 reference;
- the drafter's fused steps (q / k norm + rope, residual add + RMSNorm and SiLU x up, the block input) within a
  few units of the dtype's rounding (`TOLERANCE`; a sum rounded once is exact), the commit's rows bit for
  bit; and a whole drafter's context keys and blocks (K modes and the single-mode path) with its fused steps
  on "triton" against the same drafter on "torch", in float32.

Under the Triton interpreter (TRITON_INTERPRET=1, a CPU run) bf16 rounds differently from torch: callers pass
float32 / float16 cases there.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator

import torch

from mfd_sglang.acceptance import accept_path
from mfd_sglang.cuda_graph import host_syncs_raise
from mfd_sglang.tree import DraftTree, build_mixture_tree
from mfd_sglang.tree_layout import full_custom_mask, tree_to_verify_layout

from .run import measured_row

# The fused kernels round once, the torch path after every step: they agree to a few units of the dtype's rounding.
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=6e-2, rtol=3e-2),
             torch.float16: dict(atol=8e-3, rtol=4e-3)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def interpreted_bf16(device: str, dtype: torch.dtype) -> bool:
    """bfloat16 under the Triton interpreter, which rounds it toward zero: a sum is then close, not equal."""
    return dtype == torch.bfloat16 and not str(device).startswith("cuda")


# --- the tree and its walks ------------------------------------------------------------------------------

def random_logprobs(shape: tuple[int, ...], device: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(shape, device=device, generator=gen) * 3.0
    return torch.log_softmax(logits, dim=-1).to(dtype)


def mismatches(want, have, prefix: str) -> list[str]:
    """The fields of two dataclasses of tensors (a tree, a layout, an accept result) that differ, as
    prefix + name (floating fields, a tree's scores, by value in float32: the builders' dtypes may differ)."""
    def same(a, b):
        return torch.equal(a.float(), b.float()) if a.is_floating_point() else torch.equal(a, b)

    return [prefix + f.name for f in dataclasses.fields(want) if not same(getattr(want, f.name), getattr(have, f.name))]


def walk_mismatches(tree: DraftTree, device: str) -> tuple[list[str], int]:
    """What of the Triton walks (`kernels.verify_layout`, `kernels.accept_path`) and custom mask
    (`kernels.verify_mask`) differs from the torch ones, run without a host sync, for a target that follows
    each node's first child (deep paths); also the longest accept."""
    bs = tree.tokens.shape[0]
    roots, seq_lens = torch.arange(bs, device=device), torch.arange(bs, device=device) + 100
    layout = tree_to_verify_layout(tree, roots, seq_lens, backend="torch")
    target = layout.draft_token.gather(1, layout.retrive_next_token.clamp(min=0))
    result = accept_path(tree, target, backend="torch")
    nodes = tree.tokens.shape[1] + 1
    total_len = nodes * int(seq_lens.sum()) + bs * nodes * nodes
    mask = full_custom_mask(layout.ancestor_mask, seq_lens, total_len, backend="torch")
    with host_syncs_raise(device):
        fast_layout = tree_to_verify_layout(tree, roots, seq_lens, backend="triton")
        fast_result = accept_path(tree, target, backend="triton")
        fast_mask = full_custom_mask(layout.ancestor_mask, seq_lens, total_len, backend="triton")
    found = mismatches(layout, fast_layout, "layout.") + mismatches(result, fast_result, "accept.")
    return found + ([] if torch.equal(mask, fast_mask) else ["custom_mask"]), int(result.accept_lens.max())


def tree_rows(device: str, shapes, dtypes=(torch.float32, torch.bfloat16)) -> Iterator[dict]:
    """shapes: (bs, K, D, V, B) each, in every dtype of the drafter's log-probabilities; a row that fails names
    what differs (`mismatch`)."""
    for (bs, k, d, v, budget), dtype in itertools.product(shapes, dtypes):
        def compare(row):
            logprobs = random_logprobs((bs, k, d, v), device, dtype, seed=bs * 1000 + v)
            reference = build_mixture_tree(logprobs, budget, backend="torch")
            with host_syncs_raise(device):
                fast = build_mixture_tree(logprobs, budget, backend="triton")
            walks, row["walk_accept_len"] = walk_mismatches(reference, device)
            found = mismatches(reference, fast, "tree.") + walks
            if found:
                row["mismatch"] = ", ".join(found)
            row["ok"] = not found

        yield measured_row({"bs": bs, "K": k, "D": d, "V": v, "B": budget, "dtype": dtype_name(dtype)}, compare)


# --- the drafter's vocabulary top-B and its attention ------------------------------------------------------

def vocab_rows(device: str, shapes, grids=("integers", "random")) -> Iterator[dict]:
    """The fused lm_head + top-B kernels (`kernels/draft_vocab.py`) against the torch `vocab_candidates`;
    shapes: (bs, K, D, H, V, B) each; grids: "integers" (exact logits) and / or "random" (bf16)."""
    from mfd_sglang.drafter import vocab_candidates

    for (bs, k, d, h, v, budget), grid in itertools.product(shapes, grids):
        def compare(row):
            gen = torch.Generator(device=device).manual_seed(bs * 7 + h)
            if grid == "integers":
                hidden = torch.randint(-3, 4, (bs, k, d, h), device=device, generator=gen).to(torch.bfloat16)
                head = torch.randint(-3, 4, (v, h), device=device, generator=gen).to(torch.bfloat16)
            else:
                hidden = torch.randn(bs, k, d, h, device=device, generator=gen).to(torch.bfloat16)
                head = (0.05 * torch.randn(v, h, device=device, generator=gen)).to(torch.bfloat16)
            with host_syncs_raise(device):
                fast = vocab_candidates(hidden, head, budget, backend="triton")
            reference = vocab_candidates(hidden, head, budget)
            shared = float((fast.tokens[..., :, None] == reference.tokens[..., None, :]).any(-1).float().mean())
            row["shared"] = round(shared, 4)
            row["max_logprob_diff"] = float((fast.logprobs - reference.logprobs).abs().max())
            row["ok"] = torch.equal(fast.tokens, reference.tokens) if grid == "integers" else shared >= 0.97

        yield measured_row({"bs": bs, "K": k, "D": d, "H": h, "V": v, "B": budget, "inputs": grid}, compare)


def mode_attention_rows(device: str, shapes, dtypes) -> Iterator[dict]:
    """The fused mode attention (`kernels/draft_mode_attention.py`) against the float32 reference; shapes:
    (bs, K, T, Hq, Hkv, d, context lengths) each."""
    from mfd_sglang.mode_attention import mode_attention, random_inputs

    for (bs, k, t, hq, hkv, d, lens), dtype in itertools.product(shapes, dtypes):
        def compare(row):
            case = random_inputs(bs, bs, k, t, hq, hkv, d, lens, dtype, device)
            reference = mode_attention(**{n: (x.float() if x.is_floating_point() else x) for n, x in case.items()},
                                       num_modes=k)
            fast = mode_attention(**case, num_modes=k, backend="triton")
            row["max_abs_error"] = float((fast.float() - reference).abs().max())
            row["ok"] = row["max_abs_error"] <= (1e-4 if dtype == torch.float32 else 3e-2)

        yield measured_row({"bs": bs, "K": k, "T": t, "Hq": hq, "Hkv": hkv, "d": d, "dtype": dtype_name(dtype)},
                           compare)


# --- the drafter's fused steps and the commit's rows ---------------------------------------------------------

def close(row: dict, name: str, have: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether have is within TOLERANCE[dtype] of want; the largest difference goes to row[name]."""
    row[name] = float((have.float() - want.float()).abs().max()) if have.numel() else 0.0
    return have.shape == want.shape and torch.allclose(have.float(), want.float(), **TOLERANCE[dtype])


def random_tensor(gen: torch.Generator, device: str, dtype: torch.dtype, *shape, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=gen) * scale + shift).to(device=device, dtype=dtype)


def norm_rope_rows(device: str, cases) -> Iterator[dict]:
    """q / k RMSNorm + rope in one launch (`kernels/draft_norm_rope.py`) against `rms_norm` then `apply_rope`; cases:
    (dtype, bs, T, q heads, kv heads, head dim, layers, rope theta, eps) each: queries and keys (a layer's
    attention), and keys alone under the layers' stacked weights (the context keys of every layer at once)."""
    from mfd_sglang.drafter import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq
    from mfd_sglang.kernels.draft_norm_rope import norm_rope_

    for dtype, bs, t, q_heads, kv_heads, dim, layers, theta, eps in cases:
        def compare(row):
            gen = torch.Generator().manual_seed(dim + layers)
            q = random_tensor(gen, device, dtype, bs, t, q_heads, dim, scale=3.0)
            k = random_tensor(gen, device, dtype, bs, t, layers * kv_heads, dim, scale=3.0)
            q_weight = random_tensor(gen, device, dtype, dim, scale=0.2, shift=1.0)
            k_weight = random_tensor(gen, device, dtype, layers, dim, scale=0.2, shift=1.0)
            positions = torch.randint(0, 32768, (bs, t), generator=gen).to(device)
            cos, sin = rope_cos_sin(positions, dim, theta, dtype)
            cos, sin = cos[:, :, None], sin[:, :, None]
            want_q = apply_rope(rms_norm(q, q_weight, eps), cos, sin)
            per_layer = k.view(bs, t, layers, kv_heads, dim)
            want_k = apply_rope(rms_norm(per_layer, None, eps) * k_weight[:, None], cos[:, :, None], sin[:, :, None])
            inv_freq = rope_inv_freq(dim, theta, device)
            ok = True
            for with_q in (True, False):
                got_q, got_k = q.clone(), k.clone()
                with host_syncs_raise(device):
                    norm_rope_(got_q if with_q else None, q_weight, got_k, k_weight, positions, inv_freq, eps)
                tag = "q_and_k" if with_q else "k_only"
                ok &= close(row, f"{tag}_k_max_diff", got_k.view_as(want_k), want_k, dtype)
                ok &= close(row, f"{tag}_q_max_diff", got_q, want_q if with_q else q, dtype)
            row["ok"] = ok

        yield measured_row({"step": "norm_rope", "dtype": dtype_name(dtype), "bs": bs, "T": t, "Hq": q_heads,
                            "Hkv": kv_heads, "d": dim, "layers": layers}, compare)


def residual_mlp_rows(device: str, cases) -> Iterator[dict]:
    """Residual add + RMSNorm and SiLU x up (`kernels/draft_residual_mlp.py`); cases: (dtype, rows, width,
    intermediate) each."""
    from mfd_sglang.drafter import rms_norm
    from mfd_sglang.kernels.draft_residual_mlp import add_rms_norm, silu_mul

    for dtype, rows, width, intermediate in cases:
        def compare(row):
            gen = torch.Generator().manual_seed(width)
            x = random_tensor(gen, device, dtype, rows, width)
            delta = random_tensor(gen, device, dtype, rows, width, scale=0.5)
            weight = random_tensor(gen, device, dtype, width, scale=0.2, shift=1.0)
            gate_up = random_tensor(gen, device, dtype, rows, 2 * intermediate, scale=2.0)
            with host_syncs_raise(device):
                total, normed = add_rms_norm(x, delta, weight, 1e-6)
                product = silu_mul(gate_up)
            sum_ok = (close(row, "sum_max_diff", total, x + delta, dtype) if interpreted_bf16(device, dtype)
                      else torch.equal(total, x + delta))  # one rounding of the same sum
            gate, up = gate_up.chunk(2, dim=-1)
            row["ok"] = (sum_ok & close(row, "norm_max_diff", normed, rms_norm(x + delta, weight, 1e-6), dtype)
                         & close(row, "silu_mul_max_diff", product, torch.nn.functional.silu(gate) * up, dtype))

        yield measured_row({"step": "residual_mlp", "dtype": dtype_name(dtype), "rows": rows, "H": width,
                            "intermediate": intermediate}, compare)


def block_input_rows(device: str, cases) -> Iterator[dict]:
    """The block's embeddings, mode vectors, positions and first RMSNorm in one launch (`kernels/draft_block_input.py`);
    cases: (dtype, bs, K, block, width, vocab, mask id) each, with mode vectors shared by the batch and per
    request."""
    from mfd_sglang.drafter import rms_norm
    from mfd_sglang.kernels.draft_block_input import block_input

    for (dtype, bs, num_modes, block, width, vocab, mask_id), per_request in itertools.product(cases, (False, True)):
        def compare(row):
            gen = torch.Generator().manual_seed(width + num_modes)
            embed = random_tensor(gen, device, dtype, vocab, width)
            weight = random_tensor(gen, device, dtype, width, scale=0.2, shift=1.0)
            modes = random_tensor(gen, device, dtype, bs if per_request else 1, num_modes, width, scale=0.5)
            roots = torch.randint(0, vocab, (bs,), generator=gen).to(device)
            starts = torch.randint(0, 32768, (bs,), generator=gen, dtype=torch.int32).to(device)
            with host_syncs_raise(device):
                x, normed, positions = block_input(roots, starts, embed, modes, mask_id, weight, 1e-6, block)
            tokens = torch.full((bs, block), mask_id, device=device)
            tokens[:, 0] = roots
            want_x = (embed[tokens][:, None] + modes[:, :, None]).reshape(bs, num_modes * block, width)
            x_ok = (close(row, "x_max_diff", x, want_x, dtype) if interpreted_bf16(device, dtype)
                    else torch.equal(x, want_x))  # one rounding of the same sum
            want_positions = (starts[:, None].long() + torch.arange(block, device=device)).repeat(1, num_modes)
            row["ok"] = (x_ok & close(row, "norm_max_diff", normed, rms_norm(want_x, weight, 1e-6), dtype)
                         & torch.equal(positions, want_positions))

        yield measured_row({"step": "block_input", "dtype": dtype_name(dtype), "bs": bs, "K": num_modes,
                            "block": block, "H": width, "V": vocab, "modes_per_request": per_request}, compare)


def commit_rows_rows(device: str, cases) -> Iterator[dict]:
    """The commit's path, feature rows and positions in one launch (`kernels/commit_rows.py`) against the torch
    `serving.commit.commit_rows`, bit for bit; cases: (dtype, bs, window, features, width) each: the first
    request with the longest accepted path (width - 1 nodes), the others of random lengths from none."""
    from mfd_sglang.kernels.commit_rows import commit_rows
    from mfd_sglang.serving.commit import commit_rows as commit_rows_torch

    for dtype, bs, window, features, width in cases:
        def compare(row):
            gen = torch.Generator().manual_seed(features + width)
            hidden = torch.randn(bs, window, features, generator=gen).to(device, dtype)
            accepted = torch.randint(1, window, (bs, window - 1), generator=gen)
            lengths = [width - 1] + torch.randint(0, width - 1, (bs - 1,), generator=gen).tolist()
            for r, length in enumerate(lengths):  # -1 past each request's path: the longest one, then any
                accepted[r, length:] = -1
            seq_lens = torch.randint(0, 32768, (bs,), generator=gen, dtype=torch.int32).to(device)
            accepted = accepted.to(device)
            with host_syncs_raise(device):
                got = commit_rows(accepted, hidden, seq_lens, width)
            row["ok"] = all(have.dtype == want.dtype and torch.equal(have, want)
                            for have, want in zip(got, commit_rows_torch(accepted, hidden, seq_lens, width)))

        yield measured_row({"step": "commit_rows", "dtype": dtype_name(dtype), "bs": bs, "window": window,
                            "F": features, "width": width}, compare)


def drafter_rows(device: str, drafter, vocab: int, batch_sizes, context_len: int) -> Iterator[dict]:
    """A drafter (`MFDDrafter`, float32 on `device`) with its fused steps on "triton" against itself on "torch":
    the context keys and values of `context_len` tokens of random target features, and the blocks of random
    roots over that context with K modes and the single-mode path (final hidden states), per batch size."""
    cfg = drafter.cfg
    features = drafter.fc.weight.shape[1]
    for bs in batch_sizes:
        def compare(row):
            gen = torch.Generator().manual_seed(bs)
            target_hidden = torch.randn(bs, context_len, features, generator=gen).to(device)
            positions = torch.arange(context_len, device=device).expand(bs, -1)
            embed = (0.02 * torch.randn(vocab, cfg.hidden_size, generator=gen)).to(device)
            roots = torch.randint(0, vocab, (bs,), generator=gen).to(device)
            starts = torch.full((bs,), context_len, device=device)
            outputs = {}
            for backend in ("torch", "triton"):
                drafter.join_projections(backend)
                with torch.no_grad(), host_syncs_raise(device if backend == "triton" else "cpu"):
                    context = drafter.context_kv(target_hidden, positions)
                    blocks = [drafter.block_hidden(roots, starts, context, embed, single_mode=single)[0]
                              for single in (False, True)]
                outputs[backend] = {"context_keys": torch.stack(context.keys),
                                    "context_values": torch.stack(context.values),
                                    "block_k_modes": blocks[0], "block_single_mode": blocks[1]}
            row["ok"] = all([close(row, f"{name}_max_diff", outputs["triton"][name], want, torch.float32)
                             for name, want in outputs["torch"].items()])

        yield measured_row({"step": "drafter", "dtype": "float32", "bs": bs, "K": cfg.num_modes,
                            "layers": cfg.num_hidden_layers, "H": cfg.hidden_size, "context": context_len}, compare)
