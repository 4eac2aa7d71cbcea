#!/usr/bin/env bash
# Issue 32, device call B (a lent H100/H200), after call A's fixes: one prepared script, logs and figures to $OUT.
#   1. a random 3B checkpoint (bf16) is written in the background while
#   2. pytest -m gpu and the test files that failed on CUDA in call A run (xdist)
#   3. edgekv bench decode --device cuda: eager / CUDA graph (+ kernel profile) / transformers generate, 3B bf16, M 6144
#   4. edgekv bench stream: 3B at 448x448, M 6144, StateKV B=1024 (1,000 pairs) and capped-full (300 pairs)
#   5. edgekv bench kernels: the 8-bit attention and 4-bit GEMV rows
#   6. the compiled-graph decode route (torch.compile), last: its compilation time is unknown
# At most 8 files come back: JSON and logs only (the PNGs are drawn here from the JSON). Each step has its own timeout, so a slow one costs only itself. Carry: .whl (tools/gpu/README.md).
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s); stamp() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile -e . >/dev/null 2>&1 || { echo "editable install failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
CKPT=/tmp/ckpt-3b
( edgekv make-tiny-checkpoint $CKPT --preset 3b --dtype bf16 > /tmp/ckpt.log 2>&1; echo "checkpoint rc $?" >> /tmp/ckpt.log ) &
CK=$!
stamp "tests (background: the 3B checkpoint)"
timeout -s INT ${GPU_TESTS_S:-140} python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 4 tests > "$OUT/gpu-tests.log" 2>&1 &
G=$!
timeout -s INT ${RERUN_S:-140} python3 -m pytest -q -rfE -p no:cacheprovider -n 8 --timeout 120 \
  tests/test_calibration.py tests/test_eval.py tests/test_readme.py tests/test_videoqa_streaming.py tests/test_kernels.py \
  tests/test_archive_faults.py tests/test_clock_jumps.py tests/test_startup.py tests/test_newcomer.py \
  tests/test_server_faults.py tests/test_server_requests.py tests/test_server_security.py tests/test_decode_graph.py \
  > "$OUT/rerun.log" 2>&1
echo "rerun rc $?"; wait $G; echo "gpu tests rc $?"
tail -4 "$OUT/rerun.log"; grep -E "^(FAILED|ERROR)" "$OUT/rerun.log" | head -20
tail -4 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -20
wait $CK; cat /tmp/ckpt.log
stamp "bench decode (eager, graph, transformers)"
timeout -s INT ${DECODE_S:-150} edgekv bench decode --device cuda --model $CKPT --dtypes bf16 --cuda-routes eager,graph \
  --prompt 6000 --tokens 128 --capacity 6144 --repeats 3 --profile --json "$OUT/decode.json" --plot "" 2>&1 | grep -v Warning
stamp "bench stream, StateKV B=1024, 1,000 pairs"
timeout -s INT ${STREAM_S:-120} edgekv bench stream --model $CKPT --device cuda --dtype bf16 --resolution 448 448 \
  --source 'synthetic:shapes?size=448x448&fps=2' --fps 2 --frames 2000 --max-tokens 6144 --policy statekv --sinks 1024 \
  --no-hf --json "$OUT/stream-b1024.json" --plot "" 2>&1 | tail -25
stamp "bench stream, capped-full, 300 pairs"
timeout -s INT ${STREAM_FULL_S:-60} edgekv bench stream --model $CKPT --device cuda --dtype bf16 --resolution 448 448 \
  --source 'synthetic:shapes?size=448x448&fps=2' --fps 2 --frames 600 --max-tokens 6144 --policy statekv --sinks 0 \
  --no-hf --json "$OUT/stream-full.json" --plot "" 2>&1 | tail -25
stamp "bench kernels: 8-bit attention and 4-bit rows"
timeout -s INT ${KERNELS_S:-80} edgekv bench kernels --only quant_attention,int4 --json "$OUT/kernels.json" --plot "" 2>&1 | tail -30
stamp "bench decode, compiled graph"
timeout -s INT ${COMPILED_S:-100} edgekv bench decode --device cuda --model $CKPT --dtypes bf16 --cuda-routes compiled \
  --prompt 6000 --tokens 128 --capacity 6144 --repeats 3 --profile --no-hf --json "$OUT/decode-compiled.json" --plot "" 2>&1 \
  | grep -v Warning | tail -20
stamp done
