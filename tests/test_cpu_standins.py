"""The pure-torch `sgl_kernel` stand-in (mfd_sglang/cpu/sgl_kernel_standin) against the Triton
twins inside SGLang 0.5.23, run under TRITON_INTERPRET=1 on random inputs of several shapes.

TRITON_INTERPRET must be set before triton is imported, and other test modules import triton
earlier in the same pytest process, so the comparisons run in one fresh subprocess (this file run
as a script: `python tests/test_cpu_standins.py`), and each test reads its own verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STANDIN_DIR = REPO / "mfd_sglang" / "cpu" / "sgl_kernel_standin"

CHECKS = [
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
    "build_tree_kernel_efficient_cpu",
    "reconstruct_indices_from_tree_mask",
]
HOOK_CHECKS = ["_full_mask_hooks"]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("standins") / "verdicts.json"
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN_DIR), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, __file__, str(out)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"comparison subprocess failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", CHECKS)
def test_standin_matches_triton_twin(verdicts, name):
    v = verdicts.get(name)
    assert v is not None, f"{name}: not checked"
    assert v["ok"], f"{name}: {v['detail']}"
    assert v["cases"] >= 3, f"{name}: only {v['cases']} cases ran"


def test_full_mask_hooks(verdicts):
    """patches/full_mask.py: install() is idempotent, gated by MFD_SGLANG_CPU in
    install_if_requested, forces FULL_MASK (also in modules that imported the function by name),
    and the NGRAM QLEN_ONLY -> FULL_MASK conversion gives the GPU layout."""
    v = verdicts["_full_mask_hooks"]
    assert v["ok"], v["detail"]


def test_no_torch_ops_registered(verdicts):
    assert verdicts["_torch_ops"]["ok"], verdicts["_torch_ops"]["detail"]


# ------------------------------------------------------------------------------------------------
# The comparisons (run in the subprocess)
# ------------------------------------------------------------------------------------------------


def _random_req_to_token(g, num_rows, pool_len, dtype):
    import torch

    return torch.randint(0, 10_000, (num_rows, pool_len), generator=g, dtype=torch.int64).to(dtype)


def _case_assign(g, bs, pool_len, num_rows, max_len, reverse: bool):
    """(reverse False) assign_req_to_token_pool; (reverse True) assign_extend_cache_locs."""
    import torch

    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool
    from sglang.srt.utils import next_power_of_2

    import sgl_kernel

    rpi = torch.randperm(num_rows, generator=g)[:bs].to(torch.int64)
    start = torch.randint(0, pool_len - max_len, (bs,), generator=g, dtype=torch.int64)
    lens = torch.randint(0, max_len + 1, (bs,), generator=g, dtype=torch.int64)
    end = start + lens
    total = int(lens.sum())
    if not reverse:
        r2t_a = _random_req_to_token(g, num_rows, pool_len, torch.int32)
        r2t_b = r2t_a.clone()
        loc = torch.randint(0, 10_000, (total + 3,), generator=g, dtype=torch.int64)
        assign_req_to_token_pool[(bs,)](rpi, r2t_a, start, end, loc, pool_len, next_power_of_2(bs))
        sgl_kernel.assign_req_to_token_pool_cpu(rpi, r2t_b, start, end, loc, pool_len)
        return torch.equal(r2t_a, r2t_b)
    r2t = _random_req_to_token(g, num_rows, pool_len, torch.int32)
    out_a = torch.full((total + 3,), -7, dtype=torch.int64)
    out_b = out_a.clone()
    assign_extend_cache_locs[(bs,)](rpi, r2t, start, end, out_a, pool_len, next_power_of_2(bs))
    sgl_kernel.assign_extend_cache_locs_cpu(rpi, r2t, start, end, out_b, pool_len)
    return torch.equal(out_a, out_b)


def _case_draft_locs(g, bs, topk, steps, pool_len, num_rows):
    import torch

    from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous

    import sgl_kernel

    rpi = torch.randperm(num_rows, generator=g)[:bs].to(torch.int64)
    r2t = _random_req_to_token(g, num_rows, pool_len, torch.int32)
    seq = torch.randint(1, pool_len - topk * steps, (bs,), generator=g, dtype=torch.int64)
    out_a = torch.full((bs * topk * steps + 2,), -7, dtype=torch.int64)
    out_b = out_a.clone()
    assign_draft_cache_locs_contiguous[(bs,)](rpi, r2t, seq, out_a, pool_len, topk, steps, BS=bs)
    sgl_kernel.assign_draft_cache_locs_contiguous_cpu(rpi, r2t, seq, out_b, pool_len, topk, steps)
    return torch.equal(out_a, out_b)


def _case_copy_kv(g, num_layers, num_slots, row_shape, dtype, num_locs):
    import torch

    from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_tiled

    import sgl_kernel

    state = torch.randint(0, 2**31 - 1, (1,), generator=g)
    src = torch.randperm(num_slots, generator=g)[:num_locs].to(torch.int64)
    tgt = torch.randperm(num_slots, generator=g)[:num_locs].to(torch.int64)
    results = []
    for impl in ("triton", "standin"):
        torch.manual_seed(int(state))
        bufs = [torch.randn((num_slots, *row_shape)).to(dtype) for _ in range(2 * num_layers)]
        ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
        strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in bufs])
        if impl == "triton":
            upper = 1
            while upper < num_locs:
                upper *= 2
            stride_bytes = int(strides[0])
            bytes_per_tile = 512
            copy_all_layer_kv_cache_tiled[(len(bufs), (stride_bytes + bytes_per_tile - 1) // bytes_per_tile)](
                ptrs, strides, tgt, src, num_locs, upper, BYTES_PER_TILE=bytes_per_tile
            )
        else:
            sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
        results.append([b.clone() for b in bufs])
    # and the semantics themselves: every target row holds its source row's old value
    torch.manual_seed(int(state))
    ref = [torch.randn((num_slots, *row_shape)).to(dtype) for _ in range(2 * num_layers)]
    for b in ref:
        b[tgt] = b[src].clone()
    return all(torch.equal(x, y) and torch.equal(x, r) for x, y, r in zip(*results, ref))


def _case_bonus(g, bs, stride):
    import torch

    from sglang.kernels.ops.speculative.eagle import fill_bonus_tokens

    import sgl_kernel

    tokens = torch.randint(0, 5000, (bs, stride), generator=g, dtype=torch.int64)
    lens = torch.randint(1, stride + 1, (bs,), generator=g, dtype=torch.int32)
    a = torch.full((bs,), -1, dtype=torch.int32)
    b = a.clone()
    fill_bonus_tokens[(bs,)](tokens, lens, a, stride)
    sgl_kernel.fill_bonus_tokens_cpu(tokens, lens, b, stride)
    return torch.equal(a, b)


def _case_accept_loc(g, bs, width, num_out):
    import torch

    from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc
    from sglang.srt.utils import next_power_of_2

    import sgl_kernel

    idx = torch.full((bs, width), -1, dtype=torch.int32)
    for b in range(bs):
        k = int(torch.randint(1, width + 1, (1,), generator=g))
        idx[b, :k] = torch.randperm(num_out, generator=g)[:k].to(torch.int32)
    loc = torch.randint(0, 10_000, (num_out,), generator=g, dtype=torch.int64)
    size = bs * width
    a = torch.zeros(size, dtype=torch.int64)
    b_ = a.clone()
    fill_accept_out_cache_loc[(size,)](idx, loc, a, next_power_of_2(size))
    sgl_kernel.fill_accept_out_cache_loc_cpu(idx, loc, b_)
    return torch.equal(a, b_)


def _case_rotate(g, bs, max_len, with_select):
    import torch

    from sglang.kernels.ops.speculative.multi_layer_eagle import rotate_input_ids_kernel

    import sgl_kernel

    lens = torch.randint(0, max_len + 1, (bs,), generator=g, dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    total = int(lens.sum()) + 2
    ids = torch.randint(0, 5000, (total,), generator=g, dtype=torch.int64)
    new = torch.randint(0, 5000, (bs,), generator=g, dtype=torch.int64)
    select = None
    if with_select:
        select = starts + torch.clamp(lens - 1, min=0)
        select = torch.where(lens > 1, starts + lens - 2, select)  # not always the last slot
    a, b = ids.clone(), ids.clone()
    rotate_input_ids_kernel[(bs,)](a, starts, lens, new, select, BLOCK_SIZE=4096 if with_select else 8)
    sgl_kernel.rotate_input_ids_cpu(b, starts, lens, new, select)
    return torch.equal(a, b)


def _random_eagle_selection(g, topk, depth, num_draft):
    """A valid EAGLE draft selection: parent_list [topk*(depth-1)+1] and selected_index
    [num_draft-1] as eagle_utils.organize_draft_results builds them (scores indexed over
    topk + (depth-1)*topk*topk candidates; a candidate at depth d>0 is child of a selected token
    from depth d-1, parent_list[1 + (d-1)*topk + j] naming that step's j-th kept token)."""
    import torch

    # candidates: depth 0 has topk (parent: root); depth d has topk*topk: (parent beam j, child c)
    # flat candidate id: d=0 -> c (0..topk-1); d>=1 -> topk + (d-1)*topk*topk + j*topk + c
    # kept beam at step d (the tokens parent_list refers to): top-k of that depth, here random.
    kept = [torch.randperm(topk, generator=g).tolist()]  # depth 0 beam = candidate ids
    for d in range(1, depth):
        ids = torch.randperm(topk * topk, generator=g)[:topk].tolist()
        kept.append([topk + (d - 1) * topk * topk + i for i in ids])
    parent_list = [-1]
    for d in range(depth - 1):
        parent_list += kept[d]
    # choose num_draft-1 candidates closed under parents
    chosen: set[int] = set()

    def parent_of(cand):
        if cand < topk:
            return None
        d = (cand - topk) // (topk * topk) + 1
        j = ((cand - topk) % (topk * topk)) // topk
        return kept[d - 1][j]

    pool = list(range(topk)) + [topk + (d - 1) * topk * topk + i for d in range(1, depth) for i in range(topk * topk)]
    order = torch.randperm(len(pool), generator=g).tolist()
    while len(chosen) < num_draft - 1:
        progressed = False
        for k in order:
            c = pool[k]
            if c in chosen:
                continue
            p = parent_of(c)
            if p is None or p in chosen:
                chosen.add(c)
                progressed = True
                break
        if not progressed:
            break
    selected = sorted(chosen)
    return parent_list, selected


def _case_build_tree(g, bs, topk, depth, num_draft, mode):
    import torch

    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton, TreeMaskMode

    import sgl_kernel

    parents, selected = [], []
    for _ in range(bs):
        p, s = _random_eagle_selection(g, topk, depth, num_draft)
        if len(s) < num_draft - 1:
            return None
        parents.append(p)
        selected.append(s)
    parent_list = torch.tensor(parents, dtype=torch.int64)
    sel = torch.tensor(selected, dtype=torch.int64).reshape(bs, num_draft - 1)
    seq = torch.randint(1, 20, (bs,), generator=g, dtype=torch.int64)
    if mode == TreeMaskMode.FULL_MASK:
        numel = int(seq.sum()) * num_draft + bs * num_draft * num_draft
    else:
        numel = bs * num_draft * num_draft
    outs = []
    for impl in ("triton", "standin"):
        mask = torch.ones(numel, dtype=torch.bool)
        pos = torch.full((bs * num_draft,), -5, dtype=torch.int64)
        ridx = torch.full((bs, num_draft), -5, dtype=torch.int64)
        rnext = torch.full((bs, num_draft), -1, dtype=torch.int64)
        rsib = torch.full((bs, num_draft), -1, dtype=torch.int64)
        args = (parent_list, sel, seq, mask, pos, ridx, rnext, rsib, topk, depth, num_draft, mode)
        if impl == "triton":
            sgl_build_tree_kernel_triton(*args)
        else:
            sgl_kernel.build_tree_kernel_efficient_cpu(*args[:-1], int(mode))
        outs.append((mask, pos, ridx, rnext, rsib))
    return all(torch.equal(x, y) for x, y in zip(*outs))


def _random_tree(g, n):
    """parents of nodes 1..n-1 (parents precede children) -> per node its parent index."""
    import torch

    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


def _case_verify(g, bs, num_draft, spec_tokens, vocab):
    import torch

    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton

    import sgl_kernel

    cand = torch.randint(0, vocab, (bs, num_draft), generator=g, dtype=torch.int64)
    ridx = torch.arange(bs * num_draft, dtype=torch.int64).reshape(bs, num_draft)
    rnext = torch.full((bs, num_draft), -1, dtype=torch.int64)
    rsib = torch.full((bs, num_draft), -1, dtype=torch.int64)
    for b in range(bs):
        par = _random_tree(g, num_draft)
        for i in range(num_draft - 1, 0, -1):  # same insertion order as the tree builder
            p = par[i]
            if rnext[b, p] != -1:
                rsib[b, i] = rnext[b, p]
            rnext[b, p] = i
    # targets agree with the tree often: copy a random child's token
    target = torch.randint(0, vocab, (bs, num_draft), generator=g, dtype=torch.int64)
    for b in range(bs):
        for i in range(num_draft):
            c = int(rnext[b, i])
            if c != -1 and torch.rand(1, generator=g) < 0.7:
                target[b, i] = cand[b, c]
    outs = []
    for impl in ("triton", "standin"):
        pred = torch.full((bs * num_draft,), -3, dtype=torch.int32)
        acc = torch.full((bs, spec_tokens), -1, dtype=torch.int32)
        num = torch.full((bs,), -1, dtype=torch.int32)
        if impl == "triton":
            verify_tree_greedy_triton(pred, acc, num, cand, ridx, rnext, rsib, target)
        else:
            sgl_kernel.verify_tree_greedy_cpu(
                predicts=pred, accept_index=acc, accept_token_num=num, candidates=cand,
                retrive_index=ridx, retrive_next_token=rnext, retrive_next_sibling=rsib, target_predict=target,
            )
        outs.append((pred, acc, num))
    return all(torch.equal(x, y) for x, y in zip(*outs)), int(outs[1][2].max())


def _case_reconstruct(g, bs, n):
    import torch

    from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_triton

    from sgl_kernel.speculative import reconstruct_indices_from_tree_mask

    mask = torch.zeros((bs, n, n), dtype=torch.bool)
    for b in range(bs):
        par = _random_tree(g, n)
        for i in range(n):
            j = i
            while j != -1:
                mask[b, i, j] = True
                j = par[j]
    seq = torch.randint(1, 50, (bs,), generator=g, dtype=torch.int64)
    outs = []
    for impl in ("triton", "standin"):
        pos = torch.full((bs * n,), -9, dtype=torch.int64)
        ridx, rnext, rsib = (torch.full((bs, n), -9, dtype=torch.int64) for _ in range(3))
        fn = reconstruct_indices_from_tree_mask_triton if impl == "triton" else reconstruct_indices_from_tree_mask
        fn(mask.reshape(-1), seq, pos, ridx, rnext, rsib, bs, n)
        outs.append((pos, ridx, rnext, rsib))
    return all(torch.equal(x, y) for x, y in zip(*outs))


def _check_hooks() -> dict:
    import torch

    import mfd_sglang.cpu as cpu
    from mfd_sglang.patches import full_mask
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.speculative import eagle_utils
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    problems = []
    if eagle_utils.default_tree_mask_mode() != TreeMaskMode.QLEN_ONLY:
        problems.append("precondition: stock default_tree_mask_mode() on the CPU engine is no longer QLEN_ONLY "
                        "(SGLang changed: re-check whether patches/full_mask.py is still needed)")
    os.environ.pop(cpu.ENV_FLAG, None)
    if cpu.install_if_requested() or full_mask.is_installed():
        problems.append("install_if_requested() installed without MFD_SGLANG_CPU=1")
    os.environ[cpu.ENV_FLAG] = "1"
    if not cpu.install_if_requested():
        problems.append("install_if_requested() did not install with MFD_SGLANG_CPU=1")
    cpu.install()  # idempotent
    n_hooks = {t: len(HookRegistry._hooks[t]) for t in (full_mask.DEFAULT_TREE_MASK_MODE, full_mask.NGRAM_PREPARE)}
    if any(v != 1 for v in n_hooks.values()):
        problems.append(f"hooks registered more than once: {n_hooks}")
    full_mask.install(apply=True)
    if eagle_utils.default_tree_mask_mode() != TreeMaskMode.FULL_MASK:
        problems.append("default_tree_mask_mode() is not FULL_MASK after install(apply=True)")
    from sglang.srt.layers.attention import verify_mask

    if verify_mask.default_tree_mask_mode() != TreeMaskMode.FULL_MASK:
        problems.append("verify_mask's by-name import of default_tree_mask_mode was not rebound")
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    if not hasattr(NGRAMWorker._prepare_for_speculative_decoding, "__wrapped__"):
        problems.append("NGRAMWorker._prepare_for_speculative_decoding is not wrapped")

    # QLEN_ONLY -> FULL_MASK, against the NGRAM worker's own GPU construction
    n, seq = 3, [2, 4]
    qlen = torch.rand(len(seq) * n * n) > 0.5
    blocks = qlen.reshape(len(seq), n, n)
    want = torch.cat([torch.cat((torch.ones(n, s, dtype=torch.bool), blocks[i]), 1).flatten() for i, s in enumerate(seq)])
    got = full_mask.qlen_to_full_mask(qlen, torch.tensor(seq), n)
    if not torch.equal(got, want):
        problems.append("qlen_to_full_mask layout differs")
    return {"ok": not problems, "cases": 1, "detail": "; ".join(problems)}


def _run_all() -> dict:
    import functools
    import traceback

    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1"
    import sgl_kernel

    assert getattr(sgl_kernel, "MFD_SGLANG_CPU_STANDIN", False), f"wrong sgl_kernel: {sgl_kernel.__file__}"
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode

    g = torch.Generator().manual_seed(1234)
    P = functools.partial
    cases = {
        "assign_req_to_token_pool_cpu": [
            P(_case_assign, g, bs, 64, 12, ml, False) for bs, ml in [(1, 5), (3, 33), (8, 17), (12, 1)]
        ],
        "assign_extend_cache_locs_cpu": [
            P(_case_assign, g, bs, 64, 12, ml, True) for bs, ml in [(1, 5), (3, 33), (8, 17), (12, 1)]
        ],
        "assign_draft_cache_locs_contiguous_cpu": [
            P(_case_draft_locs, g, bs, k, s, 40, 10) for bs, k, s in [(1, 1, 3), (4, 2, 3), (7, 4, 5)]
        ],
        "copy_all_layer_kv_cache_cpu": [
            P(_case_copy_kv, g, nl, 30, shape, dt, nlocs)
            for nl, shape, dt, nlocs in [
                (1, (2, 8), torch.float32, 1),
                (3, (4, 16), torch.float32, 7),
                (2, (1, 64), torch.bfloat16, 12),
            ]
        ],
        "fill_bonus_tokens_cpu": [P(_case_bonus, g, bs, st) for bs, st in [(1, 1), (3, 4), (9, 7)]],
        "fill_accept_out_cache_loc_cpu": [
            P(_case_accept_loc, g, bs, w, no) for bs, w, no in [(1, 3, 8), (4, 4, 32), (6, 8, 64)]
        ],
        "rotate_input_ids_cpu": [
            P(_case_rotate, g, bs, ml, sel) for bs, ml, sel in [(1, 5, False), (4, 20, False), (5, 9, True), (3, 1, True)]
        ],
        "verify_tree_greedy_cpu": [
            P(_case_verify, g, bs, nd, st, v) for bs, nd, st, v in [(1, 4, 4, 3), (3, 8, 5, 2), (5, 16, 8, 3), (2, 32, 12, 2)]
        ],
        "build_tree_kernel_efficient_cpu": [
            P(_case_build_tree, g, bs, k, d, nd, m)
            for bs, k, d, nd in [(1, 1, 3, 4), (2, 2, 3, 6), (3, 4, 4, 12), (2, 8, 2, 9)]
            for m in (TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY)
        ],
        "reconstruct_indices_from_tree_mask": [
            P(_case_reconstruct, g, bs, n) for bs, n in [(1, 1), (2, 4), (3, 8), (4, 19)]
        ],
    }
    verdicts: dict = {}
    for name, fns in cases.items():
        ok, ran, detail, extra = True, 0, "", []
        for k, fn in enumerate(fns):
            try:
                res = fn()
            except Exception:
                ok, detail = False, f"case {k} raised:\n{traceback.format_exc()}"
                break
            if res is None:
                continue
            if isinstance(res, tuple):
                res, info = res
                extra.append(info)
            ran += 1
            if not res:
                ok, detail = False, f"case {k}: outputs differ from the Triton twin"
                break
        if name == "verify_tree_greedy_cpu" and ok and max(extra, default=0) < 2:
            ok, detail = False, f"no case accepted 2+ tokens ({extra}); the test lost its teeth"
        verdicts[name] = {"ok": ok, "cases": ran, "detail": detail}

    try:
        verdicts["_full_mask_hooks"] = _check_hooks()
    except Exception:
        verdicts["_full_mask_hooks"] = {"ok": False, "cases": 0, "detail": traceback.format_exc()}
    registered = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("sgl_kernel::")]
    verdicts["_torch_ops"] = {"ok": not registered, "cases": 1, "detail": f"torch.ops.sgl_kernel ops registered: {registered}"}
    return verdicts


if __name__ == "__main__":
    result = _run_all()
    Path(sys.argv[1]).write_text(json.dumps(result, indent=1))
