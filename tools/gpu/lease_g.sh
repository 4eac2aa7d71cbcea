#!/usr/bin/env bash
# Issue 32 (and 29), the fourth device call — prepared 2026-11-26 (third session) after lease_f's figures.
#   1. pytest -m gpu over the whole suite (lease_f: 54 passed, 4 skipped) with the new 4-bit GEMV and auto = graph
#   2. tools/gpu/decode_3b.py --int4: the 4-bit decode graph with the word-loading GEMV (lease_f: 44.4 tok/s, the
#      GEMV 18.4 ms of a 21.9 ms token) and its split sums in one Triton launch
#   3. tools/gpu/int4_variants.py: shipped (now words-128x128 + sum kernel) against tile / program variants
#   4. tools/gpu/products_3b.py: cuBLAS decode products, 7 a layer vs q|k|v and gate|up merged
#   5. tools/gpu/profile_pair.py: where a 3B pair's ingest goes (bf16 cache, then int8: 32 vs 61 ms of prefill)
#   6. edgekv bench stream, 3B at 448x448, StateKV B=1024, 1,000 pairs, the default vision route (auto = graph now)
# About 5 minutes. 7 files come back (the stream JSON tarred). Carry: .whl (tools/gpu/README.md).
WHEELS=.whl source "$(dirname "$0")/setup.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
checkpoint_3b
stamp "pytest -m gpu, whole suite (background: the 3B checkpoint)"
gpu_tests ${TESTS_S:-100} tests
stamp "decode at the 3B shape, 4-bit layers"
timeout -s INT ${DECODE4_S:-60} python3 tools/gpu/decode_3b.py --no-hf --int4 --json "$OUT/decode-3b-int4.json" 2>&1 \
  | grep -v -E "Warning|USDT|warn_once"
stamp "4-bit GEMV variants"
timeout -s INT ${VARIANTS_S:-60} python3 tools/gpu/int4_variants.py --json "$OUT/int4-variants.json" 2>&1 \
  | grep -v -E "Warning|USDT"
stamp "decode products, separate vs merged"
timeout -s INT ${PRODUCTS_S:-40} python3 tools/gpu/products_3b.py --json "$OUT/products-3b.json" 2>&1 \
  | grep -v -E "Warning|USDT"
wait $CK; cat /tmp/ckpt.log
for kv in bf16 int8; do
  stamp "profile of a 3B pair, $kv cache"
  timeout -s INT ${PROFILE_S:-50} python3 tools/gpu/profile_pair.py --model $CKPT --kv-dtype $kv \
    --json "$OUT/profile-pair-$kv.json" 2>&1 | grep -v -E "Warning|USDT"
done
stamp "bench stream (auto route), StateKV B=1024, 1000 pairs"
stream_3b auto ${STREAM_S:-80} 2000
( cd "$OUT" && tar czf stream.tgz stream-auto.json && rm -f stream-auto.json )
stamp done
