#!/usr/bin/env bash
# Issue 32, the next device call — prepared 2026-12-04 (sixth session, after lease_m), NOT yet run. ~3 minutes.
#   1. gpu tests: the attention-mass kernel with its occupancy knobs (kernels/attention_mass.py MASS_SPLIT,
#      FORWARD_BLOCK_M) at the 3B shape, and the pair graph's (it captures that kernel); recall into a CUDA cache
#      (float and int8 caches; float, int8 and int4 records: tests/test_archive_recall.py, added 2026-12-06)
#   2. attention_mass_3b.py: the StateKV prefill's attention + mass as the pair calls it (1,044 visible keys and a
#      256-token pair), forward_block_m 64 / 32 / 16 x mass_split 1 / 2 / 4 / 8, beside eager torch (~40 s).
#      lease_m's profile put its mass pass first among a pair's kernels (1.26 ms of 14.2) and its forward third
#      (0.90 ms): 42 and 64 programs on 132 multiprocessors
#   3. profile_pair.py (graph + fused, ViT MLP padded) with the fastest row's knobs, to set against lease_m's 14.2 ms
#      of device time a pair; the constants change in the source only with that figure
# Then, in the time left, lease_toy.sh (issue 27): tools/gpu/README.md says how. Carry: .whl (tools/gpu/README.md).
WHEELS=.whl source "$(dirname "$0")/setup.sh"
gpu_info
checkpoint_3b
stamp "pytest -m gpu: attention mass (knobs), pair graph, recall into a CUDA cache (background: the 3B checkpoint)"
gpu_tests "${TESTS_S:-90}" tests/test_kernels.py tests/test_pair_graph.py tests/test_archive_recall.py \
  -k "attention_mass or pair or gpu_recall"
stamp "attention + mass at the 3B shape: forward_block_m x mass_split (tools/gpu/attention_mass_3b.py)"
timeout -s INT "${VARIANTS_S:-90}" python3 tools/gpu/attention_mass_3b.py --json "$OUT/attention-mass-3b.json" 2>&1 \
  | grep -v -E "Warning|USDT"
# the fastest Triton row (shipped: split 1, block 64 when nothing ran)
read -r SPLIT BLOCK < <(python3 - "$OUT/attention-mass-3b.json" <<'PY'
import json, sys
try:
    rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r.get("variant") == "triton" and "us" in r]
except (OSError, ValueError, KeyError):
    rows = []
best = min(rows, key=lambda r: r["us"]) if rows else {"mass_split": 1, "forward_block_m": 64}
print(best["mass_split"], best["forward_block_m"])
PY
)
wait "$CK"; cat /tmp/ckpt.log
KNOBS=("1 64"); [ "$SPLIT $BLOCK" != "1 64" ] && KNOBS+=("$SPLIT $BLOCK")  # the shipped launch, then the fastest
for knobs in "${KNOBS[@]}"; do
  read -r split block <<< "$knobs"
  stamp "profile_pair.py: graph + fused, ViT MLP padded, mass split $split, forward block $block"
  timeout -s INT "${PROFILE_S:-50}" python3 tools/gpu/profile_pair.py --model "$CKPT" --pair-route graph \
    --prefill-route fused --vision-mlp-width padded --mass-split "$split" --forward-block-m "$block" \
    --json "$OUT/profile-pair-split$split-block$block.json" 2>&1 | grep -v -E "Warning|USDT|_warn_once"
done
stamp "done"
