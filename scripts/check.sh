#!/usr/bin/env bash
# The house rules, run by the README's test command before the tests (and so by CI):
# lint and format (ruff), the import layers (import-linter, contracts in pyproject.toml) and types.
# Each must report zero findings. Run after `bash scripts/setup.sh --test`.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
$bin/ruff check --quiet .
$bin/ruff format --check --quiet .
$bin/lint-imports --no-cache
$bin/mypy
