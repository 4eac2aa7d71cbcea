#!/usr/bin/env bash
# Issue 32 (and 29), the next device call — prepared 2026-11-26 (second session), NOT yet run.
#   1. pytest -m gpu over the whole suite: the green count the issue asks for (no single whole run was green yet)
#   2. tools/gpu/attention_3b.py: decode attention each way (the 8-bit split had run once; regression check)
#   3. tools/gpu/decode_3b.py --no-hf: bf16 (344.7 tok/s last) and --int4: 4-bit layers through the Triton kernels
#   4. edgekv bench kernels --only quant_attention,int4: the 8-bit frame-pair row now dequantizes once (was 3.6 ms)
#   5. edgekv bench stream --kv-dtype int8: the 3B stream on an 8-bit cache (300 pairs), beside bf16 (last: 63.3 ms)
#   6. tools/gpu/int4_variants.py: 4-bit GEMV variants (words loaded once, wider tiles, atomics) vs shipped and bf16
# About 9 minutes in all. At most 8 files come back (7 here). Carry: .whl (tools/gpu/README.md).
WHEELS=.whl source "$(dirname "$0")/setup.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
CKPT=/tmp/ckpt-3b
( edgekv make-tiny-checkpoint $CKPT --preset 3b --dtype bf16 > /tmp/ckpt.log 2>&1; echo "checkpoint rc $?" >> /tmp/ckpt.log ) &
CK=$!
stamp "pytest -m gpu, whole suite (background: the 3B checkpoint)"
timeout -s INT ${TESTS_S:-130} python3 -m pytest -q -rfEs -p no:cacheprovider -n 6 --timeout 120 -m gpu tests \
  > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests rc $?"; tail -3 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -20
stamp "attention at the 3B shape"
timeout -s INT ${ATTN_S:-40} python3 tools/gpu/attention_3b.py --json "$OUT/attention-3b.json" 2>&1 | grep -v -E "Warning|USDT"
stamp "decode at the 3B shape, bf16 then 4-bit layers"
timeout -s INT ${DECODE_S:-70} python3 tools/gpu/decode_3b.py --no-hf --json "$OUT/decode-3b.json" 2>&1 \
  | grep -v -E "Warning|USDT|warn_once"
timeout -s INT ${DECODE4_S:-70} python3 tools/gpu/decode_3b.py --no-hf --int4 --json "$OUT/decode-3b-int4.json" 2>&1 \
  | grep -v -E "Warning|USDT|warn_once"
stamp "4-bit GEMV variants (tools/gpu/int4_variants.py)"
timeout -s INT ${VARIANTS_S:-60} python3 tools/gpu/int4_variants.py --json "$OUT/int4-variants.json" 2>&1 \
  | grep -v -E "Warning|USDT"
stamp "bench kernels: 8-bit attention and 4-bit rows"
timeout -s INT ${KERNELS_S:-70} edgekv bench kernels --only quant_attention,int4 --keys 6144 --repeats 10 \
  --json "$OUT/kernels.json" --plot "" 2>&1 | tail -16
wait $CK; cat /tmp/ckpt.log
stamp "bench stream, int8 cache, StateKV B=1024, 300 pairs"
timeout -s INT ${STREAM_S:-70} edgekv bench stream --model $CKPT --device cuda --dtype bf16 --kv-dtype int8 \
  --resolution 448 448 --source 'synthetic:shapes?size=448x448&fps=2' --fps 2 --frames 600 --max-tokens 6144 \
  --policy statekv --sinks 1024 --no-hf --json "$OUT/stream-int8.json" --plot "" 2>&1 | tail -10
stamp done
