#!/usr/bin/env bash
# Set a Jetson power mode by name and pin clocks. Mode ids come from /etc/nvpmodel.conf
# (< POWER_MODEL ID=n NAME=X >), so the same names work across AGX Orin (MAXN, 15W, 30W, 50W) and
# Orin Nano (15W, 7W; JetPack 6.2 "super": 15W, 25W, MAXN_SUPER).
#   power-mode.sh list | set NAME | clocks-on | clocks-off   [--dry-run]
set -euo pipefail

CONF=${NVPMODEL_CONF:-/etc/nvpmodel.conf}
DRY_RUN=0
args=()
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then DRY_RUN=1; else args+=("$arg"); fi
done
set -- "${args[@]+"${args[@]}"}"

run() {
  if [ "$DRY_RUN" = 1 ]; then echo "+ $*"; else "$@"; fi
}

mode_id() {
  sed -n "s/.*< *POWER_MODEL *ID=\([0-9]*\) *NAME=$1 *>.*/\1/p" "$CONF" | head -n 1
}

case "${1:-}" in
  list)
    sed -n 's/.*< *POWER_MODEL *ID=\([0-9]*\) *NAME=\([^ >]*\) *>.*/\1 \2/p' "$CONF"
    ;;
  set)
    name=${2:?usage: power-mode.sh set NAME}
    id=$(mode_id "$name")
    if [ -z "$id" ]; then
      echo "no power mode named $name in $CONF; try: power-mode.sh list" >&2
      exit 2
    fi
    run nvpmodel -m "$id"
    ;;
  clocks-on)
    run jetson_clocks --store /var/cache/edgekv/clocks.conf
    run jetson_clocks
    ;;
  clocks-off)
    run jetson_clocks --restore /var/cache/edgekv/clocks.conf
    ;;
  *)
    echo "usage: power-mode.sh list | set NAME | clocks-on | clocks-off [--dry-run]" >&2
    exit 2
    ;;
esac
