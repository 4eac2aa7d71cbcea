#!/usr/bin/env bash
# Issue 32, the next device call — prepared 2026-11-27 after lease_j/k, NOT yet run. ~5 minutes.
#   1. the pair graphs' memory after the fix (one capture stream a device, no mask kept): lease_j's 1,000-pair
#      graph + fused stream measured allocated 8,457.5 MiB, 883 MiB over eager (7,574.4); expected ~100 MiB over
#   2. vit_mlp_3b.py: the ViT's MLP products at width 3,420 (an Ampere align2 cuBLAS kernel: 4.61 ms of a pair's
#      17.2 ms of device work) and zero-padded to 3,424 / 3,456 / 3,584 — if padding wins, pad at load on CUDA
#   3. gpu tests of the pair graph (the touched module)
# Carry: .whl (tools/gpu/README.md).
WHEELS=.whl source "$(dirname "$0")/setup.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
checkpoint_3b
stamp "pytest -m gpu: pair graph (background: the 3B checkpoint)"
gpu_tests ${TESTS_S:-80} tests/test_pair_graph.py
stamp "ViT MLP products, 3,420 vs padded"
( cd tools/gpu && timeout -s INT ${VIT_S:-40} python3 vit_mlp_3b.py --json "$OUT/vit-mlp-3b.json" 2>&1 | grep -v -E "Warning|USDT" )
wait $CK; cat /tmp/ckpt.log
for run in "eager --pair-route eager" "graph-fused-1000 --pair-route graph --prefill-route fused"; do
  set -- $run; name=$1; shift
  frames=600 limit=${STREAM_S:-55}; case $name in *1000) frames=2000 limit=${STREAM1000_S:-100};; esac
  stamp "bench stream ($name), StateKV B=1024, $((frames / 2)) pairs"
  stream_3b $name $limit $frames "$@"
done
( cd "$OUT" && tar czf streams.tgz stream-*.json && rm -f stream-*.json )
stamp done
