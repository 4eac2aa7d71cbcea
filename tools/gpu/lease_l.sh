#!/usr/bin/env bash
# Issue 32, the next device call — prepared 2026-11-27 after lease_j/k, NOT yet run. ~5 minutes.
#   1. the pair graphs' memory after the fix (one capture stream a device, no mask kept): lease_j's 1,000-pair
#      graph + fused stream measured allocated 8,457.5 MiB, 883 MiB over eager (7,574.4); expected ~100 MiB over
#   2. vit_mlp_3b.py: the ViT's MLP products at width 3,420 (an Ampere align2 cuBLAS kernel: 4.61 ms of a pair's
#      17.2 ms of device work) and zero-padded to 3,424 / 3,456 / 3,584 — if padding wins, pad at load on CUDA
#   3. the whole `-m gpu` count (every module touched since lease_k's 63 passed, the pair graph's fix among them)
# 2026-12-04: the eager stream is skipped by default (RUNS; lease_j measured it on the same kind of machine:
# 7,574.4 MiB allocated, 65.3 ms a pair) so that lease_toy.sh gets the rest of the session's device time.
# Carry: .whl (tools/gpu/README.md).
WHEELS=.whl source "$(dirname "$0")/setup.sh"
gpu_info
checkpoint_3b
stamp "pytest -m gpu, the whole suite (background: the 3B checkpoint)"
gpu_tests ${TESTS_S:-110} tests
stamp "ViT MLP products, 3,420 vs padded"
( cd tools/gpu && timeout -s INT ${VIT_S:-40} python3 vit_mlp_3b.py --json "$OUT/vit-mlp-3b.json" 2>&1 | grep -v -E "Warning|USDT" )
wait $CK; cat /tmp/ckpt.log
for name in ${RUNS:-graph-fused-1000}; do  # RUNS="eager graph-fused-1000" for both
  case $name in
    eager) set -- --pair-route eager; frames=600 limit=${STREAM_S:-55};;
    graph-fused-1000) set -- --pair-route graph --prefill-route fused; frames=2000 limit=${STREAM1000_S:-100};;
    *) echo "unknown run $name"; continue;;
  esac
  stamp "bench stream ($name), StateKV B=1024, $((frames / 2)) pairs"
  stream_3b $name $limit $frames "$@"
done
( cd "$OUT" && tar czf streams.tgz stream-*.json && rm -f stream-*.json )
stamp done
