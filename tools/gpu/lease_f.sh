#!/usr/bin/env bash
# Issue 32 (and 29), the next device call — prepared 2026-11-26 (second session), NOT yet run.
#   1. pytest -m gpu over the whole suite: the green count the issue asks for (no single whole run was green yet)
#   2. tools/gpu/attention_3b.py: decode attention each way (the 8-bit split had run once; regression check)
#   3. tools/gpu/decode_3b.py --no-hf: bf16 (344.7 tok/s last) and --int4: 4-bit layers through the Triton kernels
#   4. tools/gpu/int4_variants.py: 4-bit GEMV variants (words loaded once, wider tiles, atomics) vs shipped and bf16
#   5. edgekv bench kernels --only quant_attention: the 8-bit rows (frame pair now dequantized once; was 3.6 ms)
#   6. edgekv bench stream, 3B at 448x448, 200 pairs each: the vision tower eager, as a CUDA graph (opt-in until
#      this run: then flip engines/torch_backend.AUTO_VISION_GRAPH), and on an int8 cache (last: 63.3 ms a pair, vision ~22 ms of it, eager)
# About 9 minutes in all (each step time-boxed). 8 files come back. Carry: .whl (tools/gpu/README.md).
WHEELS=.whl source "$(dirname "$0")/setup.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
checkpoint_3b
stamp "pytest -m gpu, whole suite (background: the 3B checkpoint)"
gpu_tests ${TESTS_S:-110} tests
stamp "attention at the 3B shape"
timeout -s INT ${ATTN_S:-40} python3 tools/gpu/attention_3b.py --json "$OUT/attention-3b.json" 2>&1 | grep -v -E "Warning|USDT"
stamp "decode at the 3B shape, bf16 then 4-bit layers"
timeout -s INT ${DECODE_S:-60} python3 tools/gpu/decode_3b.py --no-hf --json "$OUT/decode-3b.json" 2>&1 \
  | grep -v -E "Warning|USDT|warn_once"
timeout -s INT ${DECODE4_S:-60} python3 tools/gpu/decode_3b.py --no-hf --int4 --json "$OUT/decode-3b-int4.json" 2>&1 \
  | grep -v -E "Warning|USDT|warn_once"
stamp "4-bit GEMV variants (tools/gpu/int4_variants.py)"
timeout -s INT ${VARIANTS_S:-60} python3 tools/gpu/int4_variants.py --json "$OUT/int4-variants.json" 2>&1 \
  | grep -v -E "Warning|USDT"
stamp "bench kernels: 8-bit attention rows (the 4-bit ones are int4_variants' 'shipped')"
timeout -s INT ${KERNELS_S:-45} edgekv bench kernels --only quant_attention --keys 6144 --repeats 10 \
  --json /tmp/kernels.json --plot "" 2>&1 | tail -8
wait $CK; cat /tmp/ckpt.log
for run in "eager --vision-route eager" "graph --vision-route graph" "int8 --vision-route graph --kv-dtype int8"; do
  set -- $run; name=$1; shift
  stamp "bench stream ($name), StateKV B=1024, 200 pairs"
  stream_3b $name ${STREAM_S:-45} 400 "$@"
done
stamp done
