"""The plain-torch CPU attention backend (``mfd_sglang.cpu.attention``, ``mfd_cpu``).

Real SGLang objects throughout: ``ReqToTokenPool``, ``MHATokenToKVPool`` (on CPU), ``RadixAttention``
layers, ``ForwardBatch``, ``DFlashVerifyInput``. Requests get scattered (non-contiguous) KV slots.

- EXTEND (with and without cached prefixes, causal and ENCODER_ONLY) and DECODE are held to
  SGLang's own ``torch_native`` backend, fp32 tight and bf16 loose.
- TARGET_VERIFY (random trees in EAGLE's FULL_MASK layout, the chain without a mask, and
  ENCODER_ONLY with and without a mask) is held to SGLang's Triton extend kernel
  (``extend_attention_fwd``, the kernel ``TritonAttnBackend.forward_extend`` runs for
  TARGET_VERIFY) under ``TRITON_INTERPRET=1`` in a subprocess, fed the metadata
  ``TritonAttnBackend.init_forward_metadata`` builds for TARGET_VERIFY (qo_indptr = arange * N,
  kv_indptr = cumsum(seq_lens), kv_indices = req_to_token rows, custom_mask = spec_info's,
  mask_indptr = cumsum(N * (seq_lens + N)), max_extend_len = N). The full TritonAttnBackend needs a
  published ServerArgs context and a ModelRunner, so its metadata step is restated here.
- The MFD drafter block forward (ENCODER_ONLY, K mode copies of a block per request, a per-mode
  custom mask) is held to an explicit masked softmax written here in float64.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from mfd_sglang.cpu.attention import (
    BACKEND_NAME,
    CpuSdpaAttnBackend,
    extract_full_mask_blocks,
    register_cpu_attention_backend,
)
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.speculative.dflash_info import DFlashVerifyInput

POOL_SIZE = 4096
MAX_CTX = 512

# (Hq, Hkv, D): GQA 4:2 and 6:2, plain MHA
SHAPES = [(4, 2, 16), (6, 2, 32), (3, 3, 8)]


# ---------------------------------------------------------------------------------------------
# fixtures: a stub model runner with real pools, requests with scattered slots
# ---------------------------------------------------------------------------------------------


class Env:
    def __init__(self, dtype, hq, hkv, d, seed):
        self.dtype, self.hq, self.hkv, self.d = dtype, hq, hkv, d
        self.gen = torch.Generator().manual_seed(seed)
        self.req_pool = ReqToTokenPool(
            size=16, max_context_len=MAX_CTX, device="cpu", enable_memory_saver=False
        )
        self.kv_pool = MHATokenToKVPool(
            size=POOL_SIZE,
            page_size=1,
            dtype=dtype,
            head_num=hkv,
            head_dim=d,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
        )
        self.runner = types.SimpleNamespace(
            device="cpu",
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
            page_size=1,
            kv_index_translator=None,
        )
        # slot 0 is SGLang's padding slot; hand out the rest in random order
        self.free = (torch.randperm(POOL_SIZE, generator=self.gen) + 1).tolist()
        self.next_req = 1
        self.layers = {
            AttentionType.DECODER: RadixAttention(hq, d, d**-0.5, hkv, layer_id=0),
            AttentionType.ENCODER_ONLY: RadixAttention(
                hq, d, d**-0.5, hkv, layer_id=1, attn_type=AttentionType.ENCODER_ONLY
            ),
        }

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def new_request(self, cached: int, total: int):
        """A request row whose first `total` tokens have slots; the first `cached` have K/V."""
        r = self.next_req
        self.next_req += 1
        slots = torch.tensor([self.free.pop() for _ in range(total)], dtype=torch.int64)
        self.req_pool.req_to_token[r, :total] = slots.to(torch.int32)
        for layer_id in (0, 1):
            self.kv_pool.get_key_buffer(layer_id)[slots[:cached]] = self.randn(cached, self.hkv, self.d)
            self.kv_pool.get_value_buffer(layer_id)[slots[:cached]] = self.randn(cached, self.hkv, self.d)
        return r, slots

    def qkv(self, t):
        return (
            self.randn(t, self.hq * self.d),
            self.randn(t, self.hkv * self.d),
            self.randn(t, self.hkv * self.d),
        )


def _fb(mode, rows, seq_lens, out_cache_loc, n_tokens, **kw):
    seq_lens = torch.tensor(seq_lens, dtype=torch.int64)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(rows),
        input_ids=torch.zeros(n_tokens, dtype=torch.int64),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64),
        seq_lens=seq_lens,
        out_cache_loc=out_cache_loc,
        seq_lens_sum=int(seq_lens.sum()),
        seq_lens_cpu=seq_lens.clone(),
        **kw,
    )


def _extend_batch(env, prefix_lens, ext_lens):
    rows, locs = [], []
    for p, n in zip(prefix_lens, ext_lens):
        r, slots = env.new_request(p, p + n)
        rows.append(r)
        locs.append(slots[p : p + n])
    t = sum(ext_lens)
    fb = _fb(
        ForwardMode.EXTEND,
        rows,
        [p + n for p, n in zip(prefix_lens, ext_lens)],
        torch.cat(locs),
        t,
        extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64),
        extend_seq_lens=torch.tensor(ext_lens, dtype=torch.int64),
        extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens_cpu=list(ext_lens),
    )
    return fb, env.qkv(t)


def _decode_batch(env, seq_lens):
    rows, locs = [], []
    for s in seq_lens:
        r, slots = env.new_request(s - 1, s)
        rows.append(r)
        locs.append(slots[s - 1 :])
    fb = _fb(ForwardMode.DECODE, rows, seq_lens, torch.cat(locs), len(seq_lens))
    return fb, env.qkv(len(seq_lens))


def _verify_batch(env, prefix_lens, n, custom_mask=None):
    """TARGET_VERIFY as EAGLE / DFlash build it: seq_lens = committed prefix, the N draft
    tokens' slots in req_to_token right after it and in out_cache_loc."""
    rows, locs, kv_indices = [], [], []
    for s in prefix_lens:
        r, slots = env.new_request(s, s + n)
        rows.append(r)
        locs.append(slots[s:])
        kv_indices.append(slots[:s])
    spec = DFlashVerifyInput(
        draft_token=torch.zeros(len(rows) * n, dtype=torch.int64),
        positions=torch.zeros(len(rows) * n, dtype=torch.int64),
        draft_token_num=n,
        custom_mask=custom_mask,
    )
    fb = _fb(
        ForwardMode.TARGET_VERIFY,
        rows,
        prefix_lens,
        torch.cat(locs),
        len(rows) * n,
        spec_info=spec,
    )
    return fb, env.qkv(len(rows) * n), torch.cat(kv_indices)


def _run(backend_cls, env, fb, q, k, v, layer):
    """As RadixAttention.forward calls a backend: k and v as [T, H_kv, D]."""
    be = backend_cls(env.runner)
    be.init_forward_metadata(fb)
    k = k.clone().view(-1, layer.tp_k_head_num, layer.qk_head_dim)
    v = v.clone().view(-1, layer.tp_v_head_num, layer.v_head_dim)
    return be.forward(q.clone(), k, v, layer, fb)


def _close(a, b, dtype):
    a, b = a.float(), b.float()
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    else:
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


def _random_tree_mask(gen, prefix_lens, n, garbage_prefix=False):
    """EAGLE FULL_MASK: per request N rows of (prefix columns, ancestor-or-self columns)."""
    blocks, trees = [], []
    for s in prefix_lens:
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            anc[i, i] = True
            if i > 0:
                parent = int(torch.randint(0, i, (1,), generator=gen))
                anc[i] |= anc[parent]
        pre = (
            torch.rand(n, s, generator=gen) < 0.5
            if garbage_prefix
            else torch.ones(n, s, dtype=torch.bool)
        )
        blocks.append(torch.cat([pre, anc], 1).reshape(-1))
        trees.append(anc)
    return torch.cat(blocks), torch.stack(trees)


# ---------------------------------------------------------------------------------------------
# EXTEND / DECODE against torch_native
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_extend_matches_torch_native(dtype, seed):
    hq, hkv, d = SHAPES[seed % len(SHAPES)]
    env = Env(dtype, hq, hkv, d, seed)
    # fresh prompt, prefix-cached request, single-token extend, chunked continuation
    prefix_lens = [0, 13 + seed, 5, 40]
    ext_lens = [9, 6, 1, 17 + 3 * seed]
    for attn_type, layer in env.layers.items():
        fb, (q, k, v) = _extend_batch(env, prefix_lens, ext_lens)
        ref = _run(TorchNativeAttnBackend, env, fb, q, k, v, layer)
        out = _run(CpuSdpaAttnBackend, env, fb, q, k, v, layer)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        _close(out, ref, dtype)
        # the new tokens' K/V landed in the pool
        kb = env.kv_pool.get_key_buffer(layer.layer_id)
        torch.testing.assert_close(kb[fb.out_cache_loc], k.view(-1, hkv, d))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_matches_torch_native(dtype, seed):
    hq, hkv, d = SHAPES[seed % len(SHAPES)]
    env = Env(dtype, hq, hkv, d, seed)
    seq_lens = [1, 7 + seed, 33, 64 + 5 * seed]
    layer = env.layers[AttentionType.DECODER]
    fb, (q, k, v) = _decode_batch(env, seq_lens)
    ref = _run(TorchNativeAttnBackend, env, fb, q, k, v, layer)
    out = _run(CpuSdpaAttnBackend, env, fb, q, k, v, layer)
    _close(out, ref, dtype)
    # equal lengths: the unpadded path
    fb, (q, k, v) = _decode_batch(env, [20, 20])
    _close(
        _run(CpuSdpaAttnBackend, env, fb, q, k, v, layer),
        _run(TorchNativeAttnBackend, env, fb, q, k, v, layer),
        dtype,
    )


# ---------------------------------------------------------------------------------------------
# TARGET_VERIFY against the Triton extend kernel (interpreter, subprocess)
# ---------------------------------------------------------------------------------------------

_TRITON_SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    cases = torch.load(sys.argv[1])
    outs = []
    for c in cases:
        bs, n = c["seq_lens"].shape[0], c["n"]
        seq_lens = c["seq_lens"]
        qo_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32)
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(seq_lens, 0)
        mask_indptr = torch.zeros(bs + 1, dtype=torch.int64)
        mask_indptr[1:] = torch.cumsum(n * (seq_lens + n), 0)
        q, k, v = c["q"], c["k"], c["v"]
        o = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
        extend_attention_fwd(
            q, k.contiguous(), v.contiguous(), o, c["k_buffer"], c["v_buffer"],
            qo_indptr, kv_indptr, c["kv_indices"], c["custom_mask"], c["causal"],
            mask_indptr if c["custom_mask"] is not None else None, n, 1.0, 1.0,
            sm_scale=c["scale"],
        )
        outs.append(o)
    torch.save(outs, sys.argv[2])
    """
)


def _triton_reference(cases, tmp_path):
    src, dst = tmp_path / "cases.pt", tmp_path / "outs.pt"
    torch.save(cases, src)
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_SCRIPT, str(src), str(dst)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(dst)


def test_target_verify_matches_triton(tmp_path):
    cases, ours = [], []
    dtype = torch.float32  # the Triton interpreter computes bf16 tl.dot wrongly
    for seed in range(3):
        hq, hkv, d = SHAPES[seed % len(SHAPES)]
        gen = torch.Generator().manual_seed(100 + seed)
        for variant in ("tree", "tree_garbage_prefix", "chain", "enc_mask", "enc_nomask"):
            env = Env(dtype, hq, hkv, d, 1000 * seed + len(cases))
            n = [5, 8, 6][seed]
            prefix_lens = [[3, 11, 1], [20, 4], [9, 30, 2, 15]][seed]
            mask = None
            if variant != "chain" and variant != "enc_nomask":
                mask, _ = _random_tree_mask(
                    gen, prefix_lens, n, garbage_prefix=variant == "tree_garbage_prefix"
                )
            if variant == "enc_mask":  # arbitrary (non-tree) masks, diagonal kept
                mask, _ = _random_tree_mask(gen, prefix_lens, n)
                off = 0
                for s in prefix_lens:
                    blk = mask[off : off + n * (s + n)].view(n, s + n)
                    rnd = torch.rand(n, n, generator=gen) < 0.5
                    blk[:, s:] = rnd | torch.eye(n, dtype=torch.bool)
                    off += n * (s + n)
            layer_type = AttentionType.ENCODER_ONLY if variant.startswith("enc") else AttentionType.DECODER
            layer = env.layers[layer_type]
            fb, (q, k, v), kv_indices = _verify_batch(env, prefix_lens, n, mask)
            ours.append(_run(CpuSdpaAttnBackend, env, fb, q, k, v, layer))
            cases.append(
                dict(
                    seq_lens=torch.tensor(prefix_lens, dtype=torch.int64),
                    n=n,
                    q=q.view(-1, hq, d),
                    k=k.view(-1, hkv, d),
                    v=v.view(-1, hkv, d),
                    k_buffer=env.kv_pool.get_key_buffer(layer.layer_id).clone(),
                    v_buffer=env.kv_pool.get_value_buffer(layer.layer_id).clone(),
                    kv_indices=kv_indices,
                    custom_mask=mask,
                    causal=layer_type == AttentionType.DECODER,
                    scale=layer.scaling,
                    name=f"seed{seed}-{variant}",
                )
            )
            # the draft tokens' K/V were written to out_cache_loc
            torch.testing.assert_close(
                env.kv_pool.get_key_buffer(layer.layer_id)[fb.out_cache_loc], k.view(-1, hkv, d)
            )
    refs = _triton_reference(cases, tmp_path)
    for case, out, ref in zip(cases, ours, refs):
        torch.testing.assert_close(
            out.view(ref.shape), ref, atol=2e-5, rtol=1e-4, msg=lambda m: f"{case['name']}: {m}"
        )


# ---------------------------------------------------------------------------------------------
# explicit reference: TARGET_VERIFY semantics, the MFD drafter block forward
# ---------------------------------------------------------------------------------------------


def _explicit(env, layer, fb, q, k, v, ext_allow):
    """float64 masked softmax: every query sees its request's whole prefix plus the draft
    columns ext_allow[b] ([N, N] bool) allows."""
    hq, hkv, d = env.hq, env.hkv, env.d
    bs = fb.req_pool_indices.shape[0]
    n = q.shape[0] // bs
    kb = env.kv_pool.get_key_buffer(layer.layer_id).double()
    vb = env.kv_pool.get_value_buffer(layer.layer_id).double()
    q = q.double().view(bs, n, hq, d)
    k = k.double().view(bs, n, hkv, d)
    v = v.double().view(bs, n, hkv, d)
    out = torch.empty(bs, n, hq, d, dtype=torch.float64)
    for b in range(bs):
        s = int(fb.seq_lens[b])
        slots = env.req_pool.req_to_token[int(fb.req_pool_indices[b]), :s].long()
        keys = torch.cat([kb[slots], k[b]], 0).repeat_interleave(hq // hkv, 1)  # [s+n, hq, d]
        vals = torch.cat([vb[slots], v[b]], 0).repeat_interleave(hq // hkv, 1)
        allow = torch.cat([torch.ones(n, s, dtype=torch.bool), ext_allow[b]], 1)  # [n, s+n]
        scores = torch.einsum("ihd,jhd->hij", q[b], keys) * layer.scaling
        scores = scores.masked_fill(~allow[None], float("-inf"))
        out[b] = torch.einsum("hij,jhd->ihd", scores.softmax(-1), vals)
    return out.view(bs * n, hq * d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mfd_block_forward_encoder_only(dtype, seed):
    """K mode copies of a B-token block per request in one TARGET_VERIFY forward on the draft
    runner; ENCODER_ONLY layers; the mask lets each copy see only its own mode's block
    (bidirectionally) on top of the whole context. Also DFlash's plain block (no mask)."""
    hq, hkv, d = SHAPES[seed % len(SHAPES)]
    env = Env(dtype, hq, hkv, d, 50 + seed)
    gen = torch.Generator().manual_seed(seed)
    num_modes, block = [(4, 8), (2, 5), (3, 4)][seed]
    n = num_modes * block
    prefix_lens = [[7, 25], [1, 12, 40], [16, 3, 9, 30]][seed]
    layer = env.layers[AttentionType.ENCODER_ONLY]
    own_mode = torch.block_diag(*[torch.ones(block, block, dtype=torch.bool)] * num_modes)
    rows = []
    for s in prefix_lens:
        pre = torch.rand(n, s, generator=gen) < 0.5  # prefix columns are not read
        rows.append(torch.cat([pre, own_mode], 1).reshape(-1))
    mask = torch.cat(rows)
    fb, (q, k, v), _ = _verify_batch(env, prefix_lens, n, mask)
    out = _run(CpuSdpaAttnBackend, env, fb, q, k, v, layer)
    ref = _explicit(env, layer, fb, q, k, v, own_mode[None].expand(len(prefix_lens), n, n))
    _close(out, ref, dtype)

    # the same block forward with the mode copies split apart: identical per copy
    fb1, (q1, k1, v1), _ = _verify_batch(env, prefix_lens, block, None)
    # reuse the first mode's inputs and the same context K/V for the single-mode run
    for b in range(len(prefix_lens)):
        r_full, r_one = int(fb.req_pool_indices[b]), int(fb1.req_pool_indices[b])
        s = prefix_lens[b]
        for lid in (0, 1):
            kb = env.kv_pool.get_key_buffer(lid)
            vb = env.kv_pool.get_value_buffer(lid)
            src = env.req_pool.req_to_token[r_full, :s].long()
            dst = env.req_pool.req_to_token[r_one, :s].long()
            kb[dst], vb[dst] = kb[src], vb[src]
    sel = torch.arange(len(prefix_lens))[:, None] * n + torch.arange(block)[None, :]
    sel = sel.reshape(-1)
    out1 = _run(CpuSdpaAttnBackend, env, fb1, q[sel], k[sel], v[sel], layer)
    _close(out1, out[sel], dtype)

    # DFlash: no mask, every block query sees every block key
    fb2, (q2, k2, v2), _ = _verify_batch(env, prefix_lens, block, None)
    out2 = _run(CpuSdpaAttnBackend, env, fb2, q2, k2, v2, layer)
    ref2 = _explicit(
        env, layer, fb2, q2, k2, v2, torch.ones(len(prefix_lens), block, block, dtype=torch.bool)
    )
    _close(out2, ref2, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_verify_tree_explicit(dtype):
    """The tree verify in bf16 too (the Triton interpreter is fp32-only), against float64."""
    env = Env(dtype, 6, 2, 32, 7)
    gen = torch.Generator().manual_seed(7)
    prefix_lens, n = [12, 1, 31], 9
    mask, trees = _random_tree_mask(gen, prefix_lens, n)
    layer = env.layers[AttentionType.DECODER]
    fb, (q, k, v), _ = _verify_batch(env, prefix_lens, n, mask)
    out = _run(CpuSdpaAttnBackend, env, fb, q, k, v, layer)
    _close(out, _explicit(env, layer, fb, q, k, v, trees), dtype)
    # a chain (no mask) is the causal tree
    fb, (q, k, v), _ = _verify_batch(env, prefix_lens, n, None)
    out = _run(CpuSdpaAttnBackend, env, fb, q, k, v, layer)
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None].expand(3, n, n)
    _close(out, _explicit(env, layer, fb, q, k, v, causal), dtype)


def test_extract_full_mask_blocks():
    gen = torch.Generator().manual_seed(3)
    prefix_lens, n = [4, 0, 9], 5
    mask, trees = _random_tree_mask(gen, prefix_lens, n, garbage_prefix=True)
    got = extract_full_mask_blocks(mask, torch.tensor(prefix_lens), n)
    assert torch.equal(got, trees)
    got8 = extract_full_mask_blocks(mask.to(torch.int8), torch.tensor(prefix_lens), n)
    assert torch.equal(got8, trees)
    with pytest.raises(ValueError, match="custom_mask"):
        extract_full_mask_blocks(mask[:-1], torch.tensor(prefix_lens), n)


# ---------------------------------------------------------------------------------------------
# registration and refusals
# ---------------------------------------------------------------------------------------------


def test_registration_is_idempotent_and_parses():
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    assert register_cpu_attention_backend() == BACKEND_NAME
    assert register_cpu_attention_backend() == BACKEND_NAME
    assert choices.ATTENTION_BACKEND_CHOICES.count(BACKEND_NAME) == 1
    assert choices.DRAFT_ATTENTION_BACKEND_CHOICES.count(BACKEND_NAME) == 1
    env = Env(torch.float32, 4, 2, 16, 0)
    assert isinstance(ATTENTION_BACKENDS[BACKEND_NAME](env.runner), CpuSdpaAttnBackend)

    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(
        ["--model-path", "x", "--attention-backend", BACKEND_NAME,
         "--speculative-draft-attention-backend", BACKEND_NAME]
    )
    assert ns.attention_backend == BACKEND_NAME
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "x", "--attention-backend", "no_such_backend"])


def test_refusals():
    env = Env(torch.float32, 4, 2, 16, 0)
    be = CpuSdpaAttnBackend(env.runner)
    with pytest.raises(NotImplementedError, match="graph"):
        be.init_cuda_graph_state(4, 64)
    fb, (q, k, v) = _decode_batch(env, [3, 4])
    with pytest.raises(NotImplementedError, match="graph"):
        be.init_forward_metadata_out_graph(fb, in_capture=True)
    be.init_forward_metadata(fb)
    capped = RadixAttention(4, 16, 0.25, 2, layer_id=0, logit_cap=30.0)
    with pytest.raises(NotImplementedError, match="soft-capping"):
        be.forward(q, k, v, capped, fb)
    # IDLE gives an empty output
    idle = _fb(ForwardMode.IDLE, [], [], torch.zeros(0, dtype=torch.int64), 0)
    be.init_forward_metadata(idle)
    layer = env.layers[AttentionType.DECODER]
    out = be.forward(q[:0], k[:0], v[:0], layer, idle)
    assert out.shape == (0, 4 * 16)
