#!/usr/bin/env bash
# Issue 32 — prepared 2026-12-04 after lease_l, run the same day (150 s; results in tools/gpu/README.md).
#   1. gpu tests of the touched modules: model.vision_mlp_width (the 3B's ViT MLP padded 3,420 -> 3,424 in bf16),
#      the vision and pair graphs that capture the padded tower
#   2. the 3B stream (graph + fused, 300 pairs) with the ViT MLPs as loaded and padded: lease_l's vit_mlp_3b.py
#      measured a block's MLP 155.6 -> 58.3 us, ~3 ms of a pair over 32 blocks; the vision phase was 11.4 ms
#   3. profile_pair.py, padded: the pair's device time by kernel (2026-11-27: 17.2 ms, 4.61 in the align2 kernel)
#   4. int4_variants.py --only magic: the 4-bit GEMV with nibbles made floats without a conversion instruction and
#      the zero point out of the K sum (magic-*, 2026-12-04), beside the shipped kernel and bf16 (~40 s)
# Then, in the time left, lease_toy.sh (issue 27): `TOTAL_S=<left - 60> bash tools/gpu/lease_toy.sh`, carry .assets
# too. Carry: .whl (tools/gpu/README.md).
WHEELS=.whl source "$(dirname "$0")/setup.sh"
gpu_info
checkpoint_3b
stamp "pytest -m gpu: vision MLP width, vision and pair graphs (background: the 3B checkpoint)"
gpu_tests ${TESTS_S:-80} tests/test_vision_mlp_width.py tests/test_vision_graph.py tests/test_pair_graph.py
wait $CK; cat /tmp/ckpt.log
for width in as_loaded padded; do
  stamp "bench stream (graph + fused, ViT MLP $width), StateKV B=1024, 300 pairs"
  stream_3b "mlp-$width" ${STREAM_S:-55} 600 --pair-route graph --prefill-route fused --vision-mlp-width $width
done
( cd "$OUT" && tar czf streams.tgz stream-*.json && rm -f stream-*.json )
stamp "profile_pair.py: graph + fused, ViT MLP padded"
timeout -s INT ${PROFILE_S:-50} python3 tools/gpu/profile_pair.py --model $CKPT --pair-route graph \
  --prefill-route fused --vision-mlp-width padded --json "$OUT/profile-pair-padded.json" 2>&1 | grep -v -E "Warning|USDT"
stamp "4-bit GEMV: magic-* variants beside shipped and bf16 (tools/gpu/int4_variants.py)"
timeout -s INT ${VARIANTS_S:-60} python3 tools/gpu/int4_variants.py --only magic --json "$OUT/int4-variants.json" 2>&1 \
  | grep -v -E "Warning|USDT"
stamp done
