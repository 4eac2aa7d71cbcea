# Sourced by the lease scripts (bash): the environment every device call starts with. WHEELS names the carried
# wheel folder (default .whl). Installs the wheels into /tmp/site (first on PYTHONPATH) and edgekv itself
# (editable, no dependencies: the image has torch, triton and numpy); defines OUT and `stamp`.
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s); stamp() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "${WHEELS:-.whl}"/*.whl && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile -e . >/dev/null 2>&1 \
  || { echo "editable install failed"; exit 1; }
