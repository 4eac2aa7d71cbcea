#!/usr/bin/env bash
# Issue 32, device call E (2026-11-26, second session, the budget's last ~3 minutes): call D measured the 4-bit
# GEMV at 0.11 ms for 2,048 x 2,048 (bf16 F.linear 0.006 ms; a K walk of 32 serial blocks in 32 programs) and the
# 4-bit GEMM of a frame pair 40-100x slower than bf16. Since: split-K for rows below 64, dequantize-once + the dense
# product for wider chunks (kernels/int4_matmul.py). This call: the int4 gpu tests, then the int4 rows of
# `edgekv bench kernels` against bf16. Carry: .whl2.
WHEELS=.whl2 source "$(dirname "$0")/setup.sh"
stamp "int4 gpu tests"
timeout -s INT ${TESTS_S:-60} python3 -m pytest -q -rfEs -p no:cacheprovider -n 4 -m gpu tests/test_int4_kernels.py \
  > "$OUT/int4-tests.log" 2>&1
echo "int4 tests rc $?"; tail -2 "$OUT/int4-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/int4-tests.log" | head -10
stamp "bench kernels: 4-bit rows"
timeout -s INT ${KERNELS_S:-70} edgekv bench kernels --only int4 --repeats 10 --json "$OUT/kernels-int4.json" --plot "" \
  2>&1 | tail -14
stamp done
