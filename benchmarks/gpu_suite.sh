#!/usr/bin/env bash
# The GPU benchmarks and tests, as named stages run in order: bash benchmarks/gpu_suite.sh STAGE...
# Results land in $OUT (default: benchmarks/results). Every stage has its own time limit, so one
# failure leaves the others' results. Stages:
#   kernels      kernel tests compiled on the GPU (small shapes), then quantized GEMM at full size
#   quantgemm    benchmarks/quant_gemm.py: fused vs dequantize+cuBLAS vs fp8 per batch size
#   smoke        benchmarks/quality.py on CUDA: every quantization mode and fp8 KV (4-layer default model)
#   equality     HF equality tests on CUDA (float32)
#   tput         offline throughput, Qwen3-0.6B shape, with HF continuous batching on 64 of the requests
#   tput8b       offline throughput, Llama-3.1-8B shape
#   latency      batch-1 TTFT / TPOT, Llama-3.1-8B shape
#   startup      seconds to /health = 200, Qwen3-0.6B shape, CUDA graphs on and --enforce-eager
#   serve        online throughput: ember serve + ember bench serve on the offline workload's requests
#   quant        int4/int8 latency (8B), fp8-weight throughput (8B), fp8-KV throughput (0.6B)
#   parity       bf16 greedy agreement with HF
set -uo pipefail
OUT=${OUT:-benchmarks/results}
D=$(date +%F)
Q=benchmarks/configs/qwen3-0.6b
L=benchmarks/configs/llama-3.1-8b
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "=== $* ($(date +%T))"; }
quiet() { grep -vE "Processed|it/s"; }
tput() { timeout 300 python3 benchmarks/throughput.py --load-format dummy "$@" 2>&1 | quiet; }
lat() { timeout 200 python3 benchmarks/latency.py --load-format dummy --model $L "$@" 2>&1 | tail -3; }

stage_kernels() {
  timeout 240 python3 -m pytest -q --tb=${KTB:-line} -p no:cacheprovider tests/test_kernels.py tests/test_quant_kernels.py \
    ${KTESTS:+-k "$KTESTS"} 2>&1 | tail -8 | tee "$OUT/kernels-cuda-$D.log"
  EMBER_KERNEL_TEST_FULL=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py 2>&1 \
    | tail -3 | tee "$OUT/quant-kernels-full-cuda-$D.log"
}
stage_quantgemm() { timeout 300 python3 benchmarks/quant_gemm.py --out "$OUT/quant-gemm-cuda-$D.json" 2>&1 | tail -40; }
stage_smoke() {
  timeout 150 python3 benchmarks/quality.py --modes none gguf int8 int4 fp8 --max-windows 4 \
    --out "$OUT/quality-smollm2-4layer-cuda-$D.json" 2>&1 | grep -v INFO | tail -8
  timeout 100 python3 benchmarks/quality.py --modes none --kv-cache-dtype fp8 --max-windows 4 \
    --out "$OUT/quality-smollm2-4layer-cuda-fp8kv-$D.json" 2>&1 | grep -v INFO | tail -4
}
stage_equality() {
  EMBER_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_hf_equality.py \
    tests/test_batching.py tests/test_prefix_cache.py 2>&1 | tail -4 | tee "$OUT/equality-cuda-$D.log"
}
stage_tput() { tput --model $Q --hf --hf-num-seqs 64 --out "$OUT/throughput-qwen3-0.6b-cuda-$D.json"; }
stage_tput8b() { tput --model $L --out "$OUT/throughput-llama-3.1-8b-cuda-$D.json"; }
stage_latency() { lat --out "$OUT/latency-llama-3.1-8b-cuda-$D.json"; }
stage_startup() {
  timeout 150 python3 benchmarks/startup.py --model $Q --repeat ${REPEAT:-2} --out "$OUT/startup-qwen3-0.6b-cuda-$D.json" \
    -- --load-format dummy 2>&1 | tail -4
  timeout 100 python3 benchmarks/startup.py --model $Q --repeat ${REPEAT:-2} --out "$OUT/startup-qwen3-0.6b-cuda-eager-$D.json" \
    -- --load-format dummy --enforce-eager 2>&1 | tail -4
}
stage_serve() {
  python3 -m ember.cli serve --model $Q --load-format dummy --port 8011 --max-model-len 4096 > /tmp/serve.log 2>&1 &
  local pid=$!
  for _ in $(seq 120); do curl -sf localhost:8011/health >/dev/null && break; sleep 0.5; done
  timeout 200 python3 -m ember.cli bench serve --base-url http://localhost:8011 --dataset nano-vllm --num-prompts 256 \
    --temperature 0.6 --label qwen3-0.6b-saturation --result-file "$OUT/serve-qwen3-0.6b-cuda-$D.json" 2>&1 | tail -25
  kill $pid; wait $pid
}
stage_quant() {
  lat --quantization int4 --out "$OUT/latency-llama-3.1-8b-int4-cuda-$D.json"
  lat --quantization int8 --out "$OUT/latency-llama-3.1-8b-int8-cuda-$D.json"
  tput --model $L --quantization fp8 --out "$OUT/throughput-llama-3.1-8b-fp8-cuda-$D.json"
  tput --model $Q --kv-cache-dtype fp8 --out "$OUT/throughput-qwen3-0.6b-fp8kv-cuda-$D.json"
}
stage_parity() {
  timeout 200 python3 benchmarks/hf_parity.py --device cuda --dtype bfloat16 \
    --out "$OUT/hf-parity-cuda-bfloat16-$D.json" 2>&1 | tail -9
}
for s in "$@"; do log "$s"; "stage_$s"; done
log done
