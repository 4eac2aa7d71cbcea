#!/usr/bin/env bash
# Issue 32, device call B (run 2026-11-26, second session): what the first session's device time did not reach,
# sized to about 8.5 minutes of run; each step has its own timeout, so a slow one costs only itself.
#   1. a random 3B checkpoint (bf16, for the stream bench) written in the background, and the server tests
#      (could not import fastapi in call A; opentelemetry is carried now) on the CPU cores beside
#   2. pytest -m gpu over the whole suite (the split decode-attention and fused decode kernels, the decode graph,
#      the stream bench, everything gpu-marked)
#   3. tools/gpu/decode_3b.py --no-hf: eager / graph (split attention + fused) / graph-split / graph-sdpa
#      (transformers' generate was measured in call C; torch.compile costs minutes of compile at this shape)
#   4. edgekv bench stream: 3B at 448x448, M 6144, StateKV B=1024 (1,000 pairs) and capped-full (300 pairs)
#   5. edgekv bench kernels: the 8-bit attention and 4-bit rows (rows print as they finish)
# At most 8 files come back: JSON and logs only. Carry: .whl (tools/gpu/README.md).
WHEELS=.whl source "$(dirname "$0")/setup.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
CKPT=/tmp/ckpt-3b
( edgekv make-tiny-checkpoint $CKPT --preset 3b --dtype bf16 > /tmp/ckpt.log 2>&1; echo "checkpoint rc $?" >> /tmp/ckpt.log ) &
CK=$!
( CUDA_VISIBLE_DEVICES= timeout -s INT ${SERVER_S:-150} python3 -m pytest -q -rfEs -p no:cacheprovider -n 4 --timeout 120 \
  -m "not slow" tests/test_server_faults.py tests/test_server_requests.py tests/test_server_security.py \
  tests/test_archive_faults.py tests/test_clock_jumps.py > "$OUT/server-tests.log" 2>&1; echo "server tests rc $?" >> "$OUT/server-tests.log" ) &
SV=$!
stamp "pytest -m gpu (background: the 3B checkpoint, the server tests on the CPU)"
timeout -s INT ${TESTS_S:-130} python3 -m pytest -q -rfEs -p no:cacheprovider -n 6 --timeout 120 -m gpu tests \
  > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests rc $?"; tail -3 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -20
stamp "decode at the 3B shape"
timeout -s INT ${DECODE_S:-100} python3 tools/gpu/decode_3b.py --no-hf --json "$OUT/decode-3b.json" 2>&1 \
  | grep -v -E "Warning|USDT|warn_once"
wait $CK; cat /tmp/ckpt.log
wait $SV; tail -4 "$OUT/server-tests.log"
stamp "bench stream, StateKV B=1024, 1,000 pairs"
timeout -s INT ${STREAM_S:-130} edgekv bench stream --model $CKPT --device cuda --dtype bf16 --resolution 448 448 \
  --source 'synthetic:shapes?size=448x448&fps=2' --fps 2 --frames 2000 --max-tokens 6144 --policy statekv --sinks 1024 \
  --no-hf --json "$OUT/stream-b1024.json" --plot "" 2>&1 | tail -12
stamp "bench stream, capped-full, 300 pairs"
timeout -s INT ${STREAM_FULL_S:-60} edgekv bench stream --model $CKPT --device cuda --dtype bf16 --resolution 448 448 \
  --source 'synthetic:shapes?size=448x448&fps=2' --fps 2 --frames 600 --max-tokens 6144 --policy statekv --sinks 0 \
  --no-hf --json "$OUT/stream-full.json" --plot "" 2>&1 | tail -12
stamp "bench kernels: 8-bit attention and 4-bit rows"
timeout -s INT ${KERNELS_S:-80} edgekv bench kernels --only quant_attention,int4 --keys 6144 --repeats 10 \
  --json "$OUT/kernels.json" --plot "" 2>&1 | tail -30
stamp done
