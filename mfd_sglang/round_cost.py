"""Round cost: one speculative round (draft + tree + verify + commit) in plain decode steps.

    bash scripts/gpu_check.sh (--part 2)     # on a GPU: Qwen3-4B shapes, bf16, CUDA graphs (part 1: bs 1; part 2: 4, 16)
    round_cost_rows("cpu", quick=True)      # tiny shapes, fp32, eager, same buffers (tests/test_round_cost.py)

A Qwen3-shaped target with random weights and static buffers (KV cache [layers, bs, kv_heads,
max_len, head_dim], bool masks over the whole static length), so every step has fixed shapes and
is captured as a CUDA graph. Random weights accept ~nothing, but the cost of a round does not
depend on what it accepts: every shape is fixed. Configs (B = 64 tree nodes): MFD (K = 8 modes),
MFD_D (the single-mode path of the same drafter, K' = 1) and DDTree (a K = 1 drafter).
Stages are captured as separate graphs, replayed back to back for a round and one by one for the
per-stage breakdown. Target (issue): MFD at bs = 1 costs at most 1.45 decode steps per round.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from mfd_sglang.acceptance import verify_tree_greedy
from mfd_sglang.checkpoint import parse_drafter_config
from mfd_sglang.cuda_graph import capture
from mfd_sglang.drafter import MFDDrafter, rope_cos_sin
from mfd_sglang.handoffs import DraftCandidates, DraftTree, TreeVerifyResult, VerifyLayout
from mfd_sglang.serving.budget.rule import Arm
from mfd_sglang.serving.commit import commit_round
from mfd_sglang.serving.draft_context_pool import DraftContextPool
from mfd_sglang.serving.draft_stage import DraftStage
from mfd_sglang.timing import mean_ms

BUDGET = 64
STAGES = ("draft", "tree", "verify", "commit")
CONFIGS = {"mfd": (8, False), "mfd_d": (8, True), "ddtree": (1, False)}  # name: (drafter modes, single_mode)


@dataclass(frozen=True)
class TargetConfig:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float
    rms_eps: float
    draft_layers: int  # the drafter built for this target: its layer count = target layers it reads
    block_size: int

    @classmethod
    def qwen3_4b(cls) -> "TargetConfig":
        return cls(2560, 36, 32, 8, 128, 9728, 151936, 1e6, 1e-6, draft_layers=5, block_size=16)

    @classmethod
    def qwen3_8b(cls) -> "TargetConfig":
        return cls(4096, 36, 32, 8, 128, 12288, 151936, 1e6, 1e-6, draft_layers=5, block_size=16)

    @classmethod
    def tiny(cls) -> "TargetConfig":
        return cls(64, 6, 4, 2, 16, 128, 128, 1e4, 1e-6, draft_layers=2, block_size=8)


def spread_layer_ids(num_layers: int, count: int) -> list[int]:
    """DFlash's choice of target layers: evenly from 1 to num_layers - 3 (Qwen3-4B: 1, 9, 17, 25, 33)."""
    return [round(1 + i * (num_layers - 4) / (count - 1)) for i in range(count)]


def measured_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's RMSNorm as the committed H200 log measured it (float32 statistics in six kernels): the GPU
    cost ledger fits its launch floor to that log's decode steps of this target, so the target stays as it ran."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def grouped_attention(q, k_cache, v_cache, visible):
    """q [bs, T, heads, hd] over a whole static cache [bs, kv_heads, L, hd] under visible [bs, T, L].
    Each kv head's query group is folded into the query length, so SDPA needs no GQA support and can
    take its masked memory-efficient kernel."""
    bs, t, heads, hd = q.shape
    kv_heads, length = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    q = q.view(bs, t, kv_heads, group, hd).permute(0, 2, 3, 1, 4).reshape(bs, kv_heads, group * t, hd)
    mask = visible[:, None, None].expand(bs, 1, group, t, length).reshape(bs, 1, group * t, length)
    out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)
    return out.reshape(bs, kv_heads, group, t, hd).permute(0, 3, 1, 2, 4).reshape(bs, t, heads * hd)


class StaticTarget:
    """A Qwen3 decoder in plain torch: random weights from a seed, a static KV cache (`allocate`)."""

    def __init__(self, cfg: TargetConfig, device: str, dtype: torch.dtype, seed: int = 0):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        gen = torch.Generator(device).manual_seed(seed)

        def weight(*shape, std):  # made on the device: a 4B model would take minutes on the host
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * std

        def linear(out_features, in_features):
            return weight(out_features, in_features, std=in_features ** -0.5)

        c, ones = cfg, lambda n: torch.ones(n, device=device, dtype=dtype)
        self.embed = weight(c.vocab, c.hidden, std=0.02)  # logits of std ~1 through the tied lm_head
        self.lm_head = self.embed  # Qwen3-4B ties its embeddings
        self.layers = [dict(
            attn_norm=ones(c.hidden), mlp_norm=ones(c.hidden), q_norm=ones(c.head_dim), k_norm=ones(c.head_dim),
            qkv=linear((c.heads + 2 * c.kv_heads) * c.head_dim, c.hidden), o=linear(c.hidden, c.heads * c.head_dim),
            gate_up=linear(2 * c.intermediate, c.hidden), down=linear(c.hidden, c.intermediate),
        ) for _ in range(c.layers)]
        self.norm = ones(c.hidden)
        self.feature_layers = spread_layer_ids(c.layers, c.draft_layers)

    def allocate(self, bs: int, max_len: int) -> None:
        max_len = -(-max_len // 16) * 16  # SDPA's masked kernels want the key length aligned
        shape = (self.cfg.layers, bs, self.cfg.kv_heads, max_len, self.cfg.head_dim)
        self.k_cache = self.v_cache = None  # free the old cache first
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.slots = torch.arange(max_len, device=self.device)

    def forward(self, tokens, positions, visible, write_slots):
        """tokens, positions, write_slots [bs, T]; visible [bs, T, max_len] over cache slots (after this
        step's K/V are written). Returns the final-normed hidden states [bs, T, H] and the drafter's
        features [bs, T, n * H]: outputs of the feature layers (HF hidden_states[i + 1])."""
        c, (bs, t) = self.cfg, tokens.shape
        # The target's rope as transformers writes it (the form the H200 log measured: the ledger's launch floor is
        # fitted to this step); the drafter folds rotate_half's sign into its sin table instead.
        cos, signed_sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, self.dtype)
        sin = signed_sin[..., c.head_dim // 2:].repeat(1, 1, 2)
        index = write_slots[:, None, :, None].expand(bs, c.kv_heads, t, c.head_dim)
        x, features = self.embed[tokens], []
        for i, w in enumerate(self.layers):
            h = measured_rms_norm(x, w["attn_norm"], c.rms_eps)
            q, k, v = F.linear(h, w["qkv"]).split([c.heads * c.head_dim, c.kv_heads * c.head_dim,
                                                   c.kv_heads * c.head_dim], dim=-1)
            q = measured_rms_norm(q.view(bs, t, c.heads, c.head_dim), w["q_norm"], c.rms_eps)
            k = measured_rms_norm(k.view(bs, t, c.kv_heads, c.head_dim), w["k_norm"], c.rms_eps)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
            self.k_cache[i].scatter_(2, index, k.transpose(1, 2))
            self.v_cache[i].scatter_(2, index, v.view(bs, t, c.kv_heads, c.head_dim).transpose(1, 2))
            x = x + F.linear(grouped_attention(q, self.k_cache[i], self.v_cache[i], visible), w["o"])
            gate, up = F.linear(measured_rms_norm(x, w["mlp_norm"], c.rms_eps), w["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w["down"])
            if i in self.feature_layers:
                features.append(x)
        return measured_rms_norm(x, self.norm, c.rms_eps), torch.cat(features, dim=-1)

    def prefill(self, tokens):
        """Prompts [bs, P] into cache slots 0..P-1; returns the last logits [bs, V] and features [bs, P, n*H]."""
        bs, p = tokens.shape
        positions = self.slots[:p].expand(bs, p)
        visible = (self.slots[None, None, :] <= self.slots[:p, None]).expand(bs, p, -1)
        hidden, features = self.forward(tokens, positions, visible, positions)
        return hidden[:, -1] @ self.lm_head.T, features

    def decode(self, tokens, cache_lens):
        """One token per request at slot (and position) cache_lens; returns logits [bs, V]."""
        ones = torch.ones(tokens.shape[0], 1, 1, dtype=torch.bool, device=tokens.device)
        return self.verify(tokens[:, None], cache_lens[:, None], ones, cache_lens)[0][:, 0]

    def verify(self, tokens, positions, ancestor_mask, cache_lens):
        """N tree tokens per request into slots cache_lens..cache_lens+N-1; each sees the committed
        prefix and its tree ancestors. Returns logits [bs, N, V] and features [bs, N, n*H]."""
        n = tokens.shape[1]
        offset = self.slots[None, :] - cache_lens[:, None]  # [bs, max_len] slot - start of the window
        in_tree = ancestor_mask.gather(2, offset.clamp(0, n - 1)[:, None, :].expand(-1, n, -1))
        visible = (offset < 0)[:, None, :] | (in_tree & (offset < n)[:, None, :])
        hidden, features = self.forward(tokens, positions, visible, cache_lens[:, None] + self.slots[:n])
        return hidden @ self.lm_head.T, features

    def commit(self, path, cache_lens) -> None:
        """path [bs, W]: window indices of the kept tokens (root first); their K/V move to the window's
        front, rows cache_lens + 0..W-1 (rows past a request's accepted length are junk, masked)."""
        _, bs, kv_heads, _, hd = self.k_cache.shape
        expand = lambda slots: slots[None, :, None, :, None].expand(self.cfg.layers, bs, kv_heads, -1, hd)
        source, dest = expand(cache_lens[:, None] + path), expand(cache_lens[:, None] + self.slots[:path.shape[1]])
        for cache in (self.k_cache, self.v_cache):
            cache.scatter_(3, dest, cache.gather(3, source))  # gather copies first: windows may overlap


def drafter_raw_config(c: TargetConfig, target_layer_ids: list[int], num_modes: int) -> dict:
    """config.json of a DFlash/MFD drafter shaped like the target's layers (Qwen3-4B: 5 x 2560, block 16)."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": c.hidden, "num_hidden_layers": c.draft_layers, "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim, "intermediate_size": c.intermediate,
        "vocab_size": c.vocab, "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_eps, "block_size": c.block_size,
        "dflash_config": {"mask_token_id": c.vocab - 1, "target_layer_ids": list(target_layer_ids)},
        "mfd_config": {"num_modes": num_modes, "default_mode": 0},
    }


def random_drafter(c: TargetConfig, target_layer_ids: list[int], num_modes: int, seed: int, device,
                   dtype: torch.dtype, *, gated: bool = False) -> MFDDrafter:
    """A drafter with random weights for a target of config c (made on the device); gated: with a mode gate
    (mfd_config.mode_prior "gate", `mode_prior.weight` / `.bias`: `MFDDrafter.gate_modes` can choose modes)."""
    raw = drafter_raw_config(c, target_layer_ids, num_modes)
    if gated:
        raw["mfd_config"]["mode_prior"] = "gate"
    cfg = parse_drafter_config(raw)
    torch.manual_seed(seed)
    with torch.device(device):
        drafter = MFDDrafter(cfg, context_features=len(target_layer_ids) * c.hidden)
    drafter.requires_grad_(False)
    if num_modes > 1:  # distinct modes, on the scale of the embeddings they are added to
        drafter.mode_embed.normal_(0.0, 0.02)
    return drafter.to(dtype).eval()


class SpecRound:
    """One speculative round over static buffers, a function per stage (each is captured alone). The draft and
    the tree are the serving stage's own (`DraftStage.candidates`, `DraftStage.tree_of`: its drafter joined on
    the round's backend, its context pool indexed by KV slot, here request b's position p at slot
    b * max_len + p), the accept walk and the commit the worker's (`verify_tree_greedy`, `commit_round`): a
    timed stage is the server's."""

    def __init__(self, target: StaticTarget, drafter: MFDDrafter, *, budget: int, single_mode: bool, backend: str):
        self.target, self.budget, self.arm = target, budget, Arm(single_mode, budget)
        bs, max_len = target.k_cache.shape[1], target.slots.shape[0]
        self.stage = DraftStage(drafter, target.embed, drafter.head_weight(target.lm_head), backend=backend)
        self.req_to_token = torch.arange(bs * max_len, device=target.device, dtype=torch.int32).view(bs, max_len)
        self.stage.init_context_pool(bs * max_len, SimpleNamespace(req_to_token=self.req_to_token),
                                     device=target.device, dtype=target.dtype)
        self.requests = torch.arange(bs, device=target.device)

    @property
    def drafter(self) -> MFDDrafter:
        return self.stage.drafter

    @property
    def context(self) -> DraftContextPool:
        return self.stage.context_pool

    def write_context(self, features, positions) -> None:
        """Drafter context K/V of target features [bs, T, n*H] at positions [bs, T]."""
        slots = self.req_to_token.gather(1, positions).long()
        self.stage.write_context(features.flatten(0, 1), positions.flatten(), slots.flatten())

    def prefill(self, prompts):
        """Returns the first roots (the target's token after each prompt) and cache_lens [bs]."""
        logits, features = self.target.prefill(prompts)
        self.write_context(features, self.target.slots[: prompts.shape[1]].expand_as(prompts))
        return logits.argmax(-1), torch.full_like(logits[:, 0], prompts.shape[1], dtype=torch.long)

    def draft(self, roots, cache_lens) -> DraftCandidates:
        """The B best tokens per (mode, position) of the blocks `[root, MASK x D]` at positions cache_lens..,
        over the context read in place (`DraftStage.paged_candidates`)."""
        return self.stage.paged_candidates(roots, cache_lens, self.requests, self.arm)

    def tree(self, candidates: DraftCandidates, roots, cache_lens) -> tuple[DraftTree, VerifyLayout]:
        """The mixture tree of the candidates and its verify layout (`DraftStage.tree_of`)."""
        return self.stage.tree_of(candidates, roots, cache_lens, self.budget)

    def verify(self, tree: DraftTree, layout: VerifyLayout, cache_lens):
        """The target over [root, tree nodes] in one pass under the layout's tree mask, and the greedy walk."""
        logits, features = self.target.verify(layout.draft_token, layout.positions, layout.ancestor_mask, cache_lens)
        return verify_tree_greedy(tree, logits, self.stage.backend), features

    def commit(self, result: TreeVerifyResult, features, cache_lens):
        """Root + accepted nodes into the target cache and the drafter context (the SGLang worker's
        `commit_round`, over the static cache); returns the next roots (the bonus tokens) and cache_lens."""
        window_slots = self.req_to_token.gather(1, cache_lens[:, None] + self.target.slots[: features.shape[1]])
        # The static cache moves whole rows: a path's -1 (none) moves junk row 0, masked until overwritten.
        commit_round(result, features, cache_lens, window_slots.long(), self.context, self.drafter,
                     lambda path: self.target.commit(path.clamp(min=0), cache_lens))
        return result.bonus_tokens.clone(), cache_lens + result.accept_lens


@dataclass
class RoundGraphs:
    replays: dict  # stage -> replay()
    candidates: DraftCandidates
    tree: DraftTree
    result: TreeVerifyResult
    next_roots: torch.Tensor
    next_lens: torch.Tensor

    def replay_round(self) -> None:
        for stage in STAGES:
            self.replays[stage]()


def capture_round(spec: SpecRound, roots, cache_lens, *, use_graph: bool) -> RoundGraphs:
    """Capture each stage over the previous one's static outputs. A round leaves its inputs (roots,
    cache_lens) alone, so replays repeat the same round; copy next_* into them to move on. Each stage
    is replayed once before the next capture, which would otherwise read never-computed outputs."""
    replays = {}
    replays["draft"], candidates = capture(spec.draft, roots, cache_lens, use_graph=use_graph)
    replays["draft"]()
    replays["tree"], (tree, layout) = capture(spec.tree, candidates, roots, cache_lens, use_graph=use_graph)
    replays["tree"]()
    replays["verify"], (result, features) = capture(spec.verify, tree, layout, cache_lens, use_graph=use_graph)
    replays["verify"]()
    replays["commit"], (next_roots, next_lens) = capture(spec.commit, result, features, cache_lens,
                                                         use_graph=use_graph)
    return RoundGraphs(replays, candidates, tree, result, next_roots, next_lens)


def round_state(spec: SpecRound) -> list[torch.Tensor]:
    """What a round writes besides its outputs: the target's KV cache and the drafter's context pool."""
    return [spec.target.k_cache, spec.target.v_cache, *spec.context.keys, *spec.context.values]


def graphs_match_eager(spec: SpecRound, graphs: RoundGraphs, roots, cache_lens) -> bool:
    """A replayed round (draft, tree, verify, commit) gives the tree, the accepted path, the next roots
    and lengths, and the same target-cache and drafter-context writes as the four stages run eagerly
    from the same state (the round is replayed, the state restored, then the eager round runs)."""
    before = [t.clone() for t in round_state(spec)]
    graphs.replay_round()
    replayed = [t.clone() for t in round_state(spec)]
    for t, saved in zip(round_state(spec), before):
        t.copy_(saved)
    tree, layout = spec.tree(spec.draft(roots, cache_lens), roots, cache_lens)
    result, features = spec.verify(tree, layout, cache_lens)
    next_roots, next_lens = spec.commit(result, features, cache_lens)
    outputs = [(tree.tokens, graphs.tree.tokens), (result.accepted_tokens, graphs.result.accepted_tokens),
               (next_roots, graphs.next_roots), (next_lens, graphs.next_lens)]
    return all(torch.equal(a, b) for a, b in outputs + list(zip(round_state(spec), replayed)))


def capture_decode_step(target: StaticTarget, roots, cache_lens, *, use_graph: bool):
    """The plain autoregressive step (one token per request, greedy): the unit of round cost."""
    return capture(lambda tokens, lens: target.decode(tokens, lens).argmax(-1), roots, cache_lens,
                   use_graph=use_graph)


def replay_ms(replay, device: str, repeats: int) -> float:
    """Mean ms of replay(): CUDA events on a GPU (the host only enqueues), wall clock elsewhere."""
    if not device.startswith("cuda"):
        return mean_ms(replay, device, repeats)
    replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def profile_round(replay, use_graph: bool, title: str, table_to) -> dict:
    """One replay of a round under torch.profiler: its table (kernel names, calls, times; CUDA kernels on a
    GPU, CPU ops otherwise) appended to `table_to`, and the kernels' launches and summed GPU time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_graph else [])
    with profile(activities=activities) as prof:
        replay()
        if use_graph:
            torch.cuda.synchronize()
    events = prof.key_averages()
    sort_by = "self_device_time_total" if use_graph else "self_cpu_time_total"
    with open(table_to, "a") as f:
        f.write(f"===== {title}\n{events.table(sort_by=sort_by, row_limit=60)}\n")
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    return {"profiled_kernel_launches": sum(e.count for e in kernels) if use_graph else None,
            "profiled_gpu_ms": round(sum(e.self_device_time_total for e in kernels) / 1e3, 4) if use_graph else None}


def round_cost_rows(device: str, quick: bool, batch_sizes: tuple[int, ...] = (1, 4, 16), profile_to=None):
    """Round cost of MFD, MFD_D and DDTree at B = 64 per batch size, a row at a time (quick: tiny shapes);
    `ok` when the replayed round equals the eager one (`graphs_match_eager`). profile_to: a file that gets
    each row's round under torch.profiler (`profile_round`)."""
    cfg = TargetConfig.tiny() if quick else TargetConfig.qwen3_4b()
    use_graph = device.startswith("cuda")
    dtype = torch.bfloat16 if use_graph and not quick else torch.float32
    prompt_len, repeats = (16, 5) if quick else (512, 20)
    target = StaticTarget(cfg, device, dtype, seed=0)
    drafters = {modes: random_drafter(cfg, target.feature_layers, modes, seed=modes, device=device, dtype=dtype)
                for modes in {m for m, _ in CONFIGS.values()}}
    gen = torch.Generator(device).manual_seed(1)
    for bs in batch_sizes:
        # Replays do not advance, so the cache only holds the prompt plus one verify window.
        target.allocate(bs, prompt_len + BUDGET + 1)
        prompts = torch.randint(0, cfg.vocab, (bs, prompt_len), generator=gen, device=device)
        for name, (modes, single_mode) in CONFIGS.items():
            spec = SpecRound(target, drafters[modes], budget=BUDGET, single_mode=single_mode,
                             backend="triton" if use_graph else "torch")
            roots, cache_lens = spec.prefill(prompts)
            ar_step, _ = capture_decode_step(target, roots, cache_lens, use_graph=use_graph)
            graphs = capture_round(spec, roots, cache_lens, use_graph=use_graph)
            ar_ms = replay_ms(ar_step, device, repeats)
            round_ms = replay_ms(graphs.replay_round, device, repeats)
            stage_ms = {f"{s}_ms": round(replay_ms(graphs.replays[s], device, repeats), 4) for s in STAGES}
            profiled = {}
            if profile_to is not None:
                try:  # the timings above stay when the profiler fails
                    profiled = profile_round(graphs.replay_round, use_graph, f"{name} bs {bs} K "
                                             f"{1 if single_mode else modes} B {BUDGET} "
                                             f"({'CUDA graph replay' if use_graph else 'eager, CPU'})", profile_to)
                except Exception as exc:
                    profiled = {"profile_error": f"{type(exc).__name__}: {exc}"}
            yield {"config": name, "bs": bs, "K": 1 if single_mode else modes, "B": BUDGET,
                   "shape": "tiny" if quick else "qwen3-4b", "ar_step_ms": round(ar_ms, 4), "round_ms": round(round_ms, 4),
                   "round_cost": round(round_ms / ar_ms, 3), **stage_ms, **profiled,
                   "ok": graphs_match_eager(spec, graphs, roots, cache_lens)}
            del spec, ar_step, graphs  # free this config's graphs and context before the next
            if use_graph:
                torch.cuda.empty_cache()


def print_round_cost(rows: list[dict]) -> None:
    print("\nround cost (AR steps per round; target: mfd at bs=1 <= 1.45)")
    print(f"{'config':>7} {'bs':>3} {'K':>2} {'B':>3} {'AR ms':>8} {'round ms':>9} {'cost':>6} "
          + " ".join(f"{s + ' ms':>9}" for s in STAGES) + "  graph = eager")
    for r in rows:
        print(f"{r['config']:>7} {r['bs']:>3} {r['K']:>2} {r['B']:>3} {r['ar_step_ms']:>8.3f} {r['round_ms']:>9.3f} "
              f"{r['round_cost']:>6.3f} " + " ".join(f"{r[s + '_ms']:>9.3f}" for s in STAGES)
              + f"  {r['ok']}")

