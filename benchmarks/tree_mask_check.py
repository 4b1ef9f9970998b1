"""GPU check section "tree_mask": does every attention backend MFD allows apply the tree mask of a
top-k 1 verify, eagerly and replayed from a CUDA graph?

    tree_mask_section(device, quick) -> list[dict]      # one row per (backend, mode[, host plan])

What runs: SGLang's own attention backend (`ATTENTION_BACKENDS[name]`) over the mock model runner of
SGLang's attention unit-test kit (`sglang.test.kits.attention_unittest`: real ReqToTokenPool,
MHATokenToKVPool, ForwardBatch), one RadixAttention layer, random q/k/v, a TARGET_VERIFY forward fed
exactly what the worker feeds it: `tree_to_verify_layout` + `full_custom_mask` (FULL_MASK) in an
`EagleVerifyInput` with topk = 1, the backend built under MFD's server settings (top-k 1, one step,
N = 6 draft tokens per request). No model: the mask acts only inside attention, so the layer's
output per node stands for the issue's "logits" (a model adds position-wise layers after it, which
cannot mix nodes).

Tree, per request: root r; siblings A and B under r; A1 under A, B1 under B; A2 under A1 (local
order r, A, B, A1, B1, A2); requests have prefixes of different lengths in scattered KV slots.
Two verifies differ only in A's q/k/v (A's token). A row is ok when
- sibling: r, B and B1 give bit-identical outputs in both verifies (`sibling_max_diff == 0`) and A's
  subtree changed (`a_subtree_changed`, so the second verify really ran on the new inputs);
- path: every node's output equals float64 attention over its request's prefix plus the node's
  root-to-node path (a plain causal forward over that path, at its last token), within `tol`
  (`path_max_err`), in both verifies. The path is walked from `PARENTS`, not read from the mask.

Modes: "eager" (`init_forward_metadata` + forward); "graph" (CUDA only): one forward captured in a
torch.cuda.CUDAGraph over static inputs with the plugin's capture input (`tree_verify_input` without
a layout, as `MFDVerifyCudaGraphRunner`), then per verify what `DecodeCudaGraphRunner` does at replay:
copy the batch into the static buffers, `init_forward_metadata_out_graph` on SGLang's
`build_replay_fb_view`, replay. On CUDA each row also reports `syncs_per_verify`: host syncs seen by
`torch.cuda.set_sync_debug_mode("warn")` around one verify (metadata + forward or replay); FlashInfer
in a graph runs twice, without and with `SGLANG_OPT_FLASHINFER_VERIFY_HOST_PLAN=1` (`host_plan`),
SGLang's opt-in sync-free plan for top-k 1 EAGLE verifies (installed at capture).

Rows: the backends MFD allows on the device (`TREE_VERIFY_ATTENTION_BACKENDS`), eager and (CUDA only)
replayed from a graph. A row that cannot run says `ok: False` and `skipped` (FlashInfer where it is not
installed: the device kit does not carry it); a failure says `error`. On CPU, Triton runs only under TRITON_INTERPRET=1 set before triton
kernels are imported (else its row is an error saying so). `mask_builder` (default
`full_custom_mask`) lets a test feed a wrong mask and watch the check fail.
"""

from __future__ import annotations

import importlib.util
import os
import time
import warnings
from types import SimpleNamespace

import torch

from mfd_sglang.tree import DraftTree
from mfd_sglang.tree_layout import full_custom_mask, tree_to_verify_layout

PARENTS = (-1, -1, 0, 1, 2)  # tree nodes A, B, A1, B1, A2 (node index; -1 = the root)
NUM_NODES = len(PARENTS) + 1  # root included
A_SUBTREE = (1, 3, 5)  # local indices of A, A1, A2
OTHERS = (0, 2, 4)  # root, B, B1: never see A
HOST_PLAN_ENV = "SGLANG_OPT_FLASHINFER_VERIFY_HOST_PLAN"


def shapes(device: str, quick: bool) -> dict:
    cuda = device.startswith("cuda")
    return dict(prefix_lens=(3, 9) if quick else (5, 40, 150),
                heads=(8, 2, 128) if cuda else (4, 2, 16),  # q heads, kv heads, head dim
                dtype=torch.bfloat16 if cuda else torch.float32,
                tol=2e-2 if cuda else 1e-4, max_context_len=256)


def root_paths() -> list[list[int]]:
    """Local indices of each local node's root-to-node path (local 0 is the root, node i is i + 1)."""
    paths = [[0]]
    for node, parent in enumerate(PARENTS):
        paths.append(paths[parent + 1] + [node + 1])
    return paths


def sibling_tree(bs: int, device: str) -> DraftTree:
    """The tree as the drafter would hand it to the worker (batched [bs, B] fields, tokens arbitrary)."""
    rows = lambda values, **kw: torch.tensor(values, device=device, **kw).expand(bs, -1).clone()  # noqa: E731
    depths = [len(path) - 1 for path in root_paths()[1:]]
    return DraftTree(tokens=rows(range(1, len(PARENTS) + 1)), parents=rows(PARENTS), depths=rows(depths),
                     scores=torch.zeros(bs, len(PARENTS), device=device), modes=rows([0] * len(PARENTS)),
                     valid=rows([True] * len(PARENTS)))


def reference(prefix_k, prefix_v, q, k, v, scaling: float) -> torch.Tensor:
    """[bs * N, Hq * D] float64 attention of each node over its prefix + root-to-node path."""
    bs = len(prefix_k)
    hq, d = q.shape[-2], q.shape[-1]
    group = hq // k.shape[-2]
    q, k, v = (x.double().view(bs, NUM_NODES, -1, d) for x in (q, k, v))
    out = torch.empty(bs, NUM_NODES, hq, d, dtype=torch.float64, device=q.device)
    for b in range(bs):
        for i, path in enumerate(root_paths()):
            keys = torch.cat([prefix_k[b].double(), k[b, path]]).repeat_interleave(group, dim=1)
            values = torch.cat([prefix_v[b].double(), v[b, path]]).repeat_interleave(group, dim=1)
            probs = torch.softmax(torch.einsum("hd,khd->hk", q[b, i], keys) * scaling, dim=-1)
            out[b, i] = torch.einsum("hk,khd->hd", probs, values)
    return out.view(bs * NUM_NODES, -1)


class Setup:
    """One backend over the kit's mock runner: pools with a random prefix, the verify batch."""

    def __init__(self, backend: str, device: str, cfg: dict, mask_builder, graph: bool, seed: int = 0):
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.runtime_context import get_spec
        from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (
            DenseAttentionCase, MockModelRunner, TinyModelConfig)

        if backend == "mfd_cpu":
            from mfd_sglang.cpu.attention import register_cpu_attention_backend
            register_cpu_attention_backend()
        hq, hkv, d = cfg["heads"]
        self.prefix_lens, self.dtype, self.device = cfg["prefix_lens"], cfg["dtype"], device
        bs, n, ctx = len(self.prefix_lens), NUM_NODES, cfg["max_context_len"]
        case = DenseAttentionCase(name="tree_mask", backend=backend, forward_mode=ForwardMode.TARGET_VERIFY,
                                  num_heads=hq, num_kv_heads=hkv, page_size=1, prefix_lens=self.prefix_lens,
                                  extend_lens=(n,) * bs)
        model_config = TinyModelConfig(num_heads=hq, num_kv_heads=hkv, head_dim=d, hidden_size=hq * d,
                                       context_len=ctx)
        # The mock runner publishes a ServerArgs override for the backend; undone in close().
        self.runner = MockModelRunner(case=case, model_config=model_config, dtype=self.dtype, device=device,
                                      max_context_len=ctx, head_dim=d, disable_cuda_graph=not graph)
        # MFD's own speculative settings (launch.resolve_server_args): backends choose kernels by
        # them, e.g. Triton's split-KV verify on gfx95 runs at top-k 1 and never reads the mask.
        self.spec_override = get_spec().override(speculative_eagle_topk=1, speculative_num_steps=1)
        self.spec_override.__enter__()
        try:
            self.backend = ATTENTION_BACKENDS[backend](self.runner)
        except Exception:
            self.close()
            raise
        self.layer = RadixAttention(num_heads=hq, head_dim=d, scaling=d**-0.5, num_kv_heads=hkv, layer_id=0)
        gen = torch.Generator().manual_seed(seed)
        rand = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=self.dtype)  # noqa: E731
        # Scattered slots (never slot 0, SGLang's padding slot): index bugs cannot hide.
        slots = (torch.randperm(bs * ctx, generator=gen)[: sum(p + n for p in self.prefix_lens)] + 1).tolist()
        self.prefix_k, self.prefix_v, out_loc = [], [], []
        for b, p in enumerate(self.prefix_lens):
            row, slots = torch.tensor(slots[: p + n]), slots[p + n:]
            self.runner.req_to_token_pool.req_to_token[b, : p + n] = row.to(device)
            self.prefix_k.append(rand(p, hkv, d))
            self.prefix_v.append(rand(p, hkv, d))
            self.runner.token_to_kv_pool.set_kv_buffer(self.layer, row[:p].to(device), self.prefix_k[b],
                                                       self.prefix_v[b])
            out_loc.append(row[p:])
        self.out_cache_loc = torch.cat(out_loc).to(device)
        self.qkv = [rand(bs * n, hq, d), rand(bs * n, hkv, d), rand(bs * n, hkv, d)]
        self.mask_builder = mask_builder

    def verify_batch(self):
        """The TARGET_VERIFY ForwardBatch the worker's verify builds for the sibling tree."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.speculative.eagle_info import EagleVerifyInput

        bs, dev = len(self.prefix_lens), self.device
        seq_lens = torch.tensor(self.prefix_lens, dtype=torch.int64, device=dev)
        layout = tree_to_verify_layout(sibling_tree(bs, dev), torch.zeros(bs, dtype=torch.int64, device=dev), seq_lens)
        total = NUM_NODES * sum(self.prefix_lens) + bs * NUM_NODES**2
        mask = self.mask_builder(layout.ancestor_mask, seq_lens, total)
        spec = EagleVerifyInput(
            draft_token=layout.draft_token.flatten(), custom_mask=mask, positions=layout.positions.flatten(),
            retrieve_index=layout.retrive_index, retrieve_next_token=layout.retrive_next_token,
            retrieve_next_sibling=layout.retrive_next_sibling, retrieve_cum_len=None,
            spec_steps=max(map(len, root_paths())) - 1, topk=1, draft_token_num=NUM_NODES,
            capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=None, seq_lens_cpu=None)
        fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=spec.draft_token,
                          req_pool_indices=torch.arange(bs, device=dev), seq_lens=seq_lens,
                          seq_lens_cpu=seq_lens.cpu(), out_cache_loc=self.out_cache_loc,
                          seq_lens_sum=sum(self.prefix_lens), positions=spec.positions, spec_info=spec)
        self.runner.kv_index_translator.bind_own_plan(fb)
        return fb

    def changed_a(self) -> list[torch.Tensor]:
        """q/k/v with A's rows (local 1 of every request) redrawn: A's token changed."""
        gen = torch.Generator().manual_seed(99)
        new = [x.clone() for x in self.qkv]
        for x in new:
            rows = x.view(len(self.prefix_lens), NUM_NODES, *x.shape[1:])[:, A_SUBTREE[0]]
            rows.copy_(torch.randn(rows.shape, generator=gen).to(rows))
        return new

    def close(self) -> None:
        self.spec_override.__exit__(None, None, None)
        self.runner._server_args_override.restore()  # the kit's runner never undoes its override


def count_syncs(fn, cuda: bool):
    """(fn(), host syncs torch reports in sync debug mode "warn"); None on CPU."""
    if not cuda:
        return fn(), None
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    return result, sum("synchroniz" in str(w.message) for w in seen)


def run_eager(s: Setup, inputs: list[list[torch.Tensor]]):
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    outs, syncs = [], []
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=s.backend)):
        for q, k, v in inputs:
            fb = s.verify_batch()

            def verify():
                s.backend.init_forward_metadata(fb)
                return s.layer(q, k, v, fb).clone()

            out, n = count_syncs(verify, s.device.startswith("cuda"))
            outs.append(out)
            syncs.append(n)
    return outs, syncs


def run_graph(s: Setup, inputs: list[list[torch.Tensor]], capture: bool = True):
    """Capture one verify at SGLang's fill length, replay it for each input (DecodeCudaGraphRunner's
    steps). `capture=False` runs the captured forward eagerly instead of replaying it: the same
    static buffers and replay metadata, without CUDA (how the CPU tests reach this code)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view

    from mfd_sglang.serving.verify import tree_verify_input

    bs, n, dev = len(s.prefix_lens), NUM_NODES, s.device
    tokens, fill = bs * n, s.backend.get_cuda_graph_seq_len_fill_value()
    s.backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=tokens)
    zeros = lambda m: torch.zeros(m, dtype=torch.int64, device=dev)  # noqa: E731
    buf = SimpleNamespace(input_ids=zeros(tokens), positions=zeros(tokens), out_cache_loc=zeros(tokens),
                          req_pool_indices=zeros(bs), seq_lens=torch.full((bs,), fill, device=dev),
                          seq_lens_cpu=torch.full((bs,), fill), encoder_lens=None, mamba_track_indices=None)
    static_qkv = [torch.zeros_like(x) for x in s.qkv]
    # The runner's custom-mask buffer size (DecodeInputBuffers); the backend repacks it at replay.
    mask = torch.ones((bs * fill + tokens) * n, dtype=torch.bool, device=dev)
    capture_fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=buf.input_ids,
                              req_pool_indices=buf.req_pool_indices, seq_lens=buf.seq_lens,
                              seq_lens_cpu=buf.seq_lens_cpu, out_cache_loc=buf.out_cache_loc, seq_lens_sum=bs * fill,
                              positions=buf.positions, spec_info=tree_verify_input(mask, n))
    s.runner.kv_index_translator.bind_runner_slots(capture_fb)
    outs, syncs = [], []
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=s.backend)):
        s.backend.init_forward_metadata_out_graph(capture_fb, in_capture=True)

        def forward():
            s.backend.init_forward_metadata_in_graph(capture_fb)
            return s.layer(*static_qkv, capture_fb)

        play = forward
        if capture:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up (JIT, lazy buffers) off the graph, as SGLang does
                forward()
                forward()
            torch.cuda.current_stream().wait_stream(stream)
            if hasattr(s.backend, "on_after_cuda_graph_warmup"):
                s.backend.on_after_cuda_graph_warmup()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = forward()
            play = lambda: graph.replay() or static_out  # noqa: E731
        for qkv in inputs:
            fb = s.verify_batch()

            def replay():
                for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens"):
                    getattr(buf, name).copy_(getattr(fb, name))
                buf.seq_lens_cpu.copy_(fb.seq_lens_cpu)
                for dst, src in zip(static_qkv, qkv):
                    dst.copy_(src)
                view = build_replay_fb_view(fb, buf, bs, bs, tokens, None, fill, ForwardMode.TARGET_VERIFY, False)
                s.backend.init_forward_metadata_out_graph(view)
                return play().clone()

            out, count = count_syncs(replay, capture)
            outs.append(out)
            syncs.append(count)
    return outs, syncs


def measure(s: Setup, inputs: list[list[torch.Tensor]], outs: list[torch.Tensor]) -> dict:
    """The two verifies' outputs against each other (sibling) and against the reference (path)."""
    bs = len(s.prefix_lens)
    outs = [o.reshape(bs * NUM_NODES, -1) for o in outs]  # Triton keeps the heads axis
    per_node = [o.view(bs, NUM_NODES, -1).float() for o in outs]
    errs = [(o.double() - reference(s.prefix_k, s.prefix_v, *qkv, s.layer.scaling)).abs().max()
            for o, qkv in zip(outs, inputs)]
    return {"sibling_max_diff": float((per_node[0][:, OTHERS] - per_node[1][:, OTHERS]).abs().max()),
            "a_subtree_changed": bool((per_node[0][:, A_SUBTREE] != per_node[1][:, A_SUBTREE]).any(-1).all()),
            "path_max_err": float(max(errs))}


def check(backend: str, mode: str, device: str, quick: bool, mask_builder, host_plan: bool = False) -> dict:
    cfg = shapes(device, quick)
    row = {"backend": backend, "mode": mode, "host_plan": host_plan, "device": device,
           "dtype": str(cfg["dtype"]).removeprefix("torch."), "prefix_lens": list(cfg["prefix_lens"]),
           "nodes": NUM_NODES, "tol": cfg["tol"], "ok": False}
    start = time.perf_counter()
    setup = None
    try:
        if not device.startswith("cuda") and backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("Triton on CPU needs TRITON_INTERPRET=1 set before triton kernels are imported")
        setup = Setup(backend, device, cfg, mask_builder, graph=mode == "graph")
        inputs = [setup.qkv, setup.changed_a()]
        previous = os.environ.get(HOST_PLAN_ENV)
        os.environ[HOST_PLAN_ENV] = "1" if host_plan else "0"  # FlashInfer reads it at capture
        try:
            outs, syncs = (run_graph if mode == "graph" else run_eager)(setup, inputs)
        finally:
            if previous is None:
                os.environ.pop(HOST_PLAN_ENV)
            else:
                os.environ[HOST_PLAN_ENV] = previous
        row.update(measure(setup, inputs, outs))
        if device.startswith("cuda"):
            row["syncs_per_verify"] = syncs
        row["ok"] = row["sibling_max_diff"] == 0 and row["a_subtree_changed"] and row["path_max_err"] <= cfg["tol"]
    except Exception as exc:  # one row per failure: the other backends still run
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if setup is not None:
            setup.close()
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def skip_reason(backend: str) -> str | None:
    """Why a backend this device should run cannot run here (FlashInfer is not in the device kit)."""
    if backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed here (the device kit does not carry it): untested"
    return None


def tree_mask_section(device: str, quick: bool, *, mask_builder=full_custom_mask) -> list[dict]:
    """Rows for every backend MFD allows on this device x (eager, and on CUDA graph), plus FlashInfer's
    host plan on CUDA. Backends MFD does not allow on this device and graphs off CUDA have no row."""
    from mfd_sglang.serving.launch.resolve import TREE_VERIFY_ATTENTION_BACKENDS

    cuda = device.startswith("cuda")
    backends = TREE_VERIFY_ATTENTION_BACKENDS["cuda" if cuda else "cpu"]
    modes = ("eager", "graph") if cuda else ("eager",)
    runs = [(b, m, False) for b in backends for m in modes] + ([("flashinfer", "graph", True)] if cuda else [])
    rows = []
    for backend, mode, host_plan in runs:
        reason = skip_reason(backend)
        if reason is not None:
            rows.append({"backend": backend, "mode": mode, "host_plan": host_plan, "device": device,
                         "ok": False, "skipped": reason})
        else:
            rows.append(check(backend, mode, device, quick, mask_builder, host_plan))
    return rows


def print_tree_mask_rows(rows: list[dict]) -> None:
    print(f"\n{'backend':<11} {'mode':<6} {'host plan':<9} {'ok':<5} {'sibling diff':>12} {'path err':>9} syncs/verify")
    for r in rows:
        if "skipped" in r or "error" in r:
            print(f"{r['backend']:<11} {r['mode']:<6} {str(r['host_plan']):<9} {str(r['ok']):<5} "
                  f"{'SKIPPED: ' + r['skipped'] if 'skipped' in r else 'ERROR: ' + r['error']}")
            continue
        print(f"{r['backend']:<11} {r['mode']:<6} {str(r['host_plan']):<9} {str(r['ok']):<5} "
              f"{r['sibling_max_diff']:>12.3g} {r['path_max_err']:>9.3g} {r.get('syncs_per_verify', '-')}")


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    result = tree_mask_section(args.device, args.quick)
    print(json.dumps(result, indent=1))
    print_tree_mask_rows(result)
