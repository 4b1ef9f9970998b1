"""Fixed-shape replays of a tensor function: CUDA graphs on a GPU, the same static buffers run
eagerly elsewhere (so the padding logic is exercised, and tested, on a CPU too).

`capture(fn, *static_inputs)` records fn once over static input tensors; the returned replay
re-runs it after the caller has copied new values into those same tensors. `BatchGraphs` keeps one
capture per batch-size bucket and pads a smaller batch up to the next bucket: padded rows get the
caller's pad values and their outputs are sliced away, so fn must treat rows independently.
"""

from __future__ import annotations

import contextlib
from dataclasses import fields, is_dataclass, replace
from typing import Callable, Sequence

import torch


@contextlib.contextmanager
def host_syncs_raise(device):
    """On CUDA, CUDA sync debug mode "error" for the block (the first host sync raises): what a graph
    capture or an overlapped round needs; elsewhere nothing."""
    if not str(device).startswith("cuda"):
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _map_tensors(value, fn):
    """Apply fn to every tensor of a tensor / tuple / list / dataclass of tensors."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if is_dataclass(value):
        return replace(value, **{f.name: _map_tensors(getattr(value, f.name), fn) for f in fields(value)
                                 if f.init})
    return value


def capture(fn: Callable, *static_inputs: torch.Tensor, use_graph: bool, pool=None, warmup: int = 2):
    """Returns (replay, outputs): replay() recomputes `outputs` in place from the current contents of
    static_inputs. With use_graph (CUDA tensors) fn is recorded as a CUDA graph after `warmup` eager
    runs on a side stream (Triton compiles there, allocators settle); without, replay calls fn again
    and copies its result into the same output tensors."""
    if not use_graph:
        outputs = fn(*static_inputs)

        def replay_eager():
            fresh = fn(*static_inputs)
            _copy_into(outputs, fresh)
            return outputs

        return replay_eager, outputs
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn(*static_inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn(*static_inputs)

    def replay_graph():
        graph.replay()
        return outputs

    return replay_graph, outputs


def _tensors(value) -> list[torch.Tensor]:
    found = []
    _map_tensors(value, found.append)
    return found


def _copy_into(dst, src) -> None:
    for d, s in zip(_tensors(dst), _tensors(src)):
        d.copy_(s)


def smallest_bucket(buckets: Sequence[int], bs: int) -> int:
    """The smallest of ascending `buckets` that holds bs (a batch pads up to it); ValueError past the largest."""
    for size in buckets:
        if size >= bs:
            return size
    raise ValueError(f"a batch of {bs} exceeds the largest bucket {buckets[-1]}")


def default_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_bs (SGLang's decode graph sizes follow the same idea)."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs + 8, 8))
    return sorted({min(b, max_bs) for b in sizes})


class BatchGraphs:
    """fn(*batched_inputs) -> tensors with a leading batch dim, replayed at bucketed batch sizes.

    example_inputs(bs) builds static inputs for a bucket (their contents are the pad values of
    unused rows); `key` separates variants of fn that need their own capture (e.g. a mode path).
    """

    def __init__(self, fn: Callable, example_inputs: Callable[[int], Sequence[torch.Tensor]],
                 buckets: Sequence[int], *, use_graph: bool):
        self.fn = fn
        self.example_inputs = example_inputs
        self.buckets = sorted(buckets)
        self.use_graph = use_graph
        self.pool = torch.cuda.graph_pool_handle() if use_graph else None
        self._captured: dict[tuple, tuple] = {}

    @property
    def max_bs(self) -> int:
        return self.buckets[-1]

    def bucket(self, bs: int) -> int:
        return smallest_bucket(self.buckets, bs)

    def capture_all(self, keys: Sequence = (None,)) -> None:
        self.capture_pairs([(size, key) for key in keys for size in self.buckets])

    def capture_pairs(self, pairs: Sequence[tuple[int, object]]) -> None:
        """Capture fn at each (bucket, key) of pairs (buckets of `buckets` only)."""
        for size, key in pairs:
            if size not in self.buckets:
                raise ValueError(f"batch size {size} is not a bucket of {self.buckets}")
            self._entry(size, key)

    def has(self, bs: int, key=None) -> bool:
        """Whether a batch of bs requests has a capture for key (its bucket's)."""
        return bs <= self.max_bs and (self.bucket(bs), key) in self._captured

    def _entry(self, size: int, key):
        entry = self._captured.get((size, key))
        if entry is None:
            static = list(self.example_inputs(size))
            pads = [t.clone() for t in static]
            replay, outputs = capture(lambda *xs: self.fn(*xs, key=key), *static,
                                      use_graph=self.use_graph, pool=self.pool)
            entry = self._captured[(size, key)] = (static, pads, replay, outputs)
        return entry

    def __call__(self, *inputs: torch.Tensor, key=None):
        bs = inputs[0].shape[0]
        static, pads, replay, _ = self._entry(self.bucket(bs), key)
        for buffer, pad, value in zip(static, pads, inputs):
            buffer[:bs].copy_(value)
            buffer[bs:].copy_(pad[bs:])
        outputs = replay()
        return _map_tensors(outputs, lambda t: t[:bs])
