#!/usr/bin/env bash
# Issue 32, the fifth device call — prepared 2026-11-26 (third session), ~3 minutes, after lease_g found the
# reserved GPU memory of a 3B stream growing 7.8 -> 10.4 GiB over 1,000 pairs (allocated flat): the pooled-VaN
# planes covered every distinct frame held, a count that grows with the stream; now passes over chunks of frames.
#   1. pytest -m gpu on the touched modules (VaN kernel, decode graph with gate|up packed, 4-bit products)
#   2. tools/gpu/decode_3b.py --no-hf: bf16 decode with gate|up packed (lease_f: graph 345.1 tok/s)
#   3. edgekv bench stream, 3B at 448x448, StateKV B=1024, 800 pairs, auto route: reserved memory flat?
# Carry: .whl (tools/gpu/README.md).
WHEELS=.whl source "$(dirname "$0")/setup.sh"
checkpoint_3b
stamp "pytest -m gpu, touched modules"
gpu_tests ${TESTS_S:-60} tests/test_kernels.py tests/test_decode_graph.py tests/test_decode_attention_kernel.py tests/test_int4_kernels.py \
  tests/test_vision_graph.py
stamp "decode at the 3B shape, bf16"
timeout -s INT ${DECODE_S:-45} python3 tools/gpu/decode_3b.py --no-hf --json "$OUT/decode-3b.json" 2>&1 \
  | grep -v -E "Warning|USDT|warn_once"
wait $CK; cat /tmp/ckpt.log
stamp "bench stream (auto route), StateKV B=1024, 800 pairs"
stream_3b auto ${STREAM_S:-70} 1600
python3 - "$OUT/stream-auto.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["results"][0]["rows"]
for i in (50, 200, 400, 600, len(rows) - 1):
    if i < len(rows):
        r = rows[i]
        print(f"pair {r['pair']}: allocated {r['gpu_allocated_mb']:.1f} MiB, reserved {r['gpu_reserved_mb']:.0f} MiB, "
              f"peak {r['gpu_peak_mb']:.1f} MiB")
PY
stamp done
