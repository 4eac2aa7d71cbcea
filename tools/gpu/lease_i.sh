#!/usr/bin/env bash
# Issue 32 (and 29), the next device call — prepared 2026-11-26 (third session), NOT yet run. ~6 minutes.
# Built after the last call, run only in Triton's interpreter and compiled for sm_87 so far:
#   - model.prefill_route: fused (edgekv/model/prefill_fused.py): a chunk's small work in Triton kernels, ten
#     launches a layer; "auto" stays eager until this run (then flip prefill_fused.AUTO_FUSED_PREFILL)
#   - the fused decode step with 4-bit projections (Int4Linear) inside it (lease_g: 4-bit graph-split 177.4 tok/s)
#   - an int8 cache's chunk write in one launch a layer (kernels/quant_write.py; lease_g: int8 pair 5,458 kernels)
#   1. pytest -m gpu, the whole suite (lease_f/g: 54 passed, 4 skipped; new: the fused-prefill session test)
#   2. decode_3b.py --int4: the fused 4-bit route beside graph-split; int4_variants.py with the lanes-* variants
#   3. profile_pair.py, bf16 cache: prefill eager vs fused (lease_g: 3,221 kernels, 20 ms device, ~47 ms wall)
#   4. bench stream, StateKV B=1024, 300 pairs each: prefill eager, fused; fused on an int8 cache
# Carry: .whl (tools/gpu/README.md).
WHEELS=.whl source "$(dirname "$0")/setup.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
checkpoint_3b
stamp "pytest -m gpu, whole suite (background: the 3B checkpoint)"
gpu_tests ${TESTS_S:-110} tests
stamp "decode at the 3B shape, 4-bit layers (fused step now)"
timeout -s INT ${DECODE4_S:-60} python3 tools/gpu/decode_3b.py --no-hf --int4 --json "$OUT/decode-3b-int4.json" 2>&1 \
  | grep -v -E "Warning|USDT|warn_once"
stamp "4-bit GEMV variants (new: lanes-*, no reshape)"
timeout -s INT ${VARIANTS_S:-60} python3 tools/gpu/int4_variants.py --json "$OUT/int4-variants.json" 2>&1 \
  | grep -v -E "Warning|USDT"
wait $CK; cat /tmp/ckpt.log
for route in eager fused; do
  stamp "profile of a 3B pair, prefill $route"
  timeout -s INT ${PROFILE_S:-50} python3 tools/gpu/profile_pair.py --model $CKPT --prefill-route $route \
    --json "$OUT/profile-pair-$route.json" 2>&1 | grep -v -E "Warning|USDT"
done
for run in "eager --prefill-route eager" "fused --prefill-route fused" "fused-int8 --prefill-route fused --kv-dtype int8"; do
  set -- $run; name=$1; shift
  stamp "bench stream ($name), StateKV B=1024, 300 pairs"
  stream_3b $name ${STREAM_S:-45} 600 "$@"
done
( cd "$OUT" && tar czf streams.tgz stream-*.json && rm -f stream-*.json )
stamp done
