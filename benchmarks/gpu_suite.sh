#!/usr/bin/env bash
# Everything the H200 runs in one device call: kernel tests at full size, HF equality on CUDA,
# bf16 parity, and the throughput / latency benchmarks. Results land in $OUT (default: benchmarks/results).
# Usage: bash benchmarks/gpu_suite.sh [quick]
set -uo pipefail
OUT=${OUT:-benchmarks/results}
D=$(date +%F)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "=== $* ($(date +%T))"; }
log kernels; EMBER_KERNEL_TEST_FULL=1 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -5 | tee "$OUT/kernels-cuda-$D.log"
log equality; EMBER_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_hf_equality.py tests/test_batching.py \
  tests/test_prefix_cache.py 2>&1 | tail -5 | tee "$OUT/equality-cuda-$D.log"
log throughput-qwen3; python3 benchmarks/throughput.py --model benchmarks/configs/qwen3-0.6b --load-format dummy \
  --out "$OUT/throughput-qwen3-0.6b-cuda-$D.json" 2>&1 | grep -vE "Processed|it/s"
[ "${1:-}" = quick ] && exit 0
log latency-8b; python3 benchmarks/latency.py --model benchmarks/configs/llama-3.1-8b --load-format dummy \
  --out "$OUT/latency-llama-3.1-8b-cuda-$D.json" 2>&1 | tail -4
log throughput-8b; python3 benchmarks/throughput.py --model benchmarks/configs/llama-3.1-8b --load-format dummy \
  --out "$OUT/throughput-llama-3.1-8b-cuda-$D.json" 2>&1 | grep -vE "Processed|it/s"
log parity; python3 benchmarks/hf_parity.py --device cuda --dtype bfloat16 --out "$OUT/hf-parity-cuda-bfloat16-$D.json" 2>&1 | tail -9
