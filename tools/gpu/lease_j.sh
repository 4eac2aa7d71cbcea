#!/usr/bin/env bash
# Issue 32, the second call of 2026-11-27 (~6 minutes). lease_i (this morning) measured the 3B pair on an H200:
# eager 56.2 ms wall for 20.1 ms of device work (3,222 launches), the fused layers 68.2 ms for 17.2 ms (2,250
# launches: each Triton launch costs the host more than the operators it replaced). New: model.pair_route: graph
# (edgekv/session/pair_graph.py), a pair's LM prefill as one CUDA graph per cache length; CPU-tested through its
# capture=False twin only.
#   1. pytest -m gpu: the pair graph's bits against the eager stream (bf16/fp32, StateKV, int8, InfiniPot-V), the
#      fused-prefill and stream-device tests
#   2. bench stream, StateKV B=1024, 448x448, M=6144: eager (baseline on this machine), graph, graph + fused layers
#      (1,000 pairs: memory flat with the graphs held), graph + fused on an int8 cache
# Carry: .whl (tools/gpu/README.md).
WHEELS=.whl source "$(dirname "$0")/setup.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
checkpoint_3b
stamp "pytest -m gpu: pair graph, fused prefill, stream device (background: the 3B checkpoint)"
gpu_tests ${TESTS_S:-100} tests/test_pair_graph.py tests/test_prefill_route.py tests/test_bench_stream_device.py
wait $CK; cat /tmp/ckpt.log
for run in "eager --pair-route eager" "graph --pair-route graph" "graph-fused-1000 --pair-route graph --prefill-route fused" \
           "graph-fused-int8 --pair-route graph --prefill-route fused --kv-dtype int8"; do
  set -- $run; name=$1; shift
  frames=600 limit=${STREAM_S:-55}; case $name in *1000) frames=2000 limit=${STREAM1000_S:-100};; esac
  stamp "bench stream ($name), StateKV B=1024, $((frames / 2)) pairs"
  stream_3b $name $limit $frames "$@"
done
( cd "$OUT" && tar czf streams.tgz stream-*.json && rm -f stream-*.json )
stamp done
