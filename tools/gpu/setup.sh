# Sourced by the lease scripts (bash): the environment every device call starts with. WHEELS names the carried
# wheel folder (default .whl). Installs the wheels into /tmp/site (first on PYTHONPATH) and edgekv itself
# (editable, no dependencies: the image has torch, triton and numpy); defines OUT and `stamp`.
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s); stamp() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
if [ "${EDGEKV_SETUP:-1}" = 1 ]; then  # EDGEKV_SETUP=0: a dry run on the dev VM, in its venv (lease_toy.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${WHEELS:-.whl}"/*.whl && export PYTHONPATH=/tmp/site || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile -e . >/dev/null 2>&1 \
    || { echo "editable install failed"; exit 1; }
fi

# `gpu_info`: the chip, its driver, clocks, temperature and power as the call starts (beside every figure).
gpu_info() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
}

# The random 3B-shape checkpoint at $CKPT, written in the background: `wait $CK` before reading it.
checkpoint_3b() {
  CKPT=/tmp/ckpt-3b
  ( edgekv make-tiny-checkpoint $CKPT --preset 3b --dtype bf16 > /tmp/ckpt.log 2>&1; echo "checkpoint rc $?" >> /tmp/ckpt.log ) &
  CK=$!
}

# `gpu_tests SECONDS PATH...`: pytest -m gpu over the paths, time-boxed, the log in $OUT/gpu-tests.log, its end shown.
gpu_tests() {
  local limit=$1; shift
  timeout -s INT "$limit" python3 -m pytest -q -rfEs -p no:cacheprovider -n 6 --timeout 120 -m gpu "$@" \
    > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests rc $?"; tail -3 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -20
}

# `stream_3b NAME SECONDS FRAMES [bench stream options...]`: the 3B stream at 448x448, StateKV B = 1,024, M = 6,144,
# its JSON in $OUT/stream-NAME.json.
stream_3b() {
  local name=$1 limit=$2 frames=$3; shift 3
  timeout -s INT "$limit" edgekv bench stream --model $CKPT --device cuda --dtype bf16 "$@" \
    --resolution 448 448 --source 'synthetic:shapes?size=448x448&fps=2' --fps 2 --frames "$frames" --max-tokens 6144 \
    --policy statekv --sinks 1024 --no-hf --json "$OUT/stream-$name.json" --plot "" 2>&1 | tail -6
}
