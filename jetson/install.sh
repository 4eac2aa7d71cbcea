#!/usr/bin/env bash
# Install edgekv as a service on JetPack 6 (L4T R36, Ubuntu 22.04, Python 3.10).
# TensorRT and GStreamer-enabled OpenCV come from apt (python3-libnvinfer, python3-opencv); PyTorch from
# NVIDIA's Jetson wheel, whose URL you give in EDGEKV_TORCH_WHEEL (it must match your JetPack; see
# NVIDIA's "Installing PyTorch for Jetson Platform"). pip is never allowed to replace that torch.
# onnxruntime for the Jetson's GPU is not on PyPI (the PyPI wheel is CPU-only): give NVIDIA's / Jetson AI Lab's
# onnxruntime-gpu wheel in EDGEKV_ORT_WHEEL if you want the onnxruntime backend; TensorRT needs none of it.
# The deployment profile is picked by the board (/proc/device-tree/model); EDGEKV_PROFILE=orin-nano-8gb (a file
# name in configs/ without .yaml) overrides it.
#   sudo EDGEKV_TORCH_WHEEL=<url-or-path> [EDGEKV_ORT_WHEEL=<url-or-path>] jetson/install.sh [--dry-run]
set -euo pipefail

PREFIX=/opt/edgekv
SRC=$(cd "$(dirname "$0")/.." && pwd)
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1

run() {
  if [ "$DRY_RUN" = 1 ]; then echo "+ $*"; else "$@"; fi
}

if [ -z "${EDGEKV_TORCH_WHEEL:-}" ] && [ "$DRY_RUN" = 0 ]; then
  echo "set EDGEKV_TORCH_WHEEL to NVIDIA's PyTorch wheel for your JetPack (URL or file)" >&2
  exit 2
fi
WHEEL=${EDGEKV_TORCH_WHEEL:-torch-for-your-jetpack.whl}

# JetPack 6 = L4T R36 (/etc/nv_tegra_release's first line: "# R36 (release), REVISION: 4.3, ..."). JetPack 5 (R35)
# has Ubuntu 20.04's Python 3.8 and TensorRT 8.5: edgekv needs Python 3.10 and TensorRT 10, so say so before
# installing anything. No such file (not a Jetson, or a container without it): the board check below decides.
RELEASE_FILE=${EDGEKV_TEGRA_RELEASE:-/etc/nv_tegra_release}
if [ -r "$RELEASE_FILE" ]; then
  L4T_MAJOR=$(sed -n 's/^# R\([0-9][0-9]*\) (release).*/\1/p' "$RELEASE_FILE" | head -n 1)
  if [ -n "$L4T_MAJOR" ] && [ "$L4T_MAJOR" -lt 36 ]; then
    echo "this board runs L4T R$L4T_MAJOR (JetPack 5 or older: Python 3.8, TensorRT 8); edgekv needs JetPack 6" \
         "(L4T R36: Python 3.10, TensorRT 10): flash JetPack 6 first" >&2
    exit 2
  fi
fi

# The board decides the profile: an 8 GB Orin Nano cannot hold the AGX 64 GB profile's cache.
MODEL_FILE=${EDGEKV_DEVICE_TREE_MODEL:-/proc/device-tree/model}
if [ -r "$MODEL_FILE" ]; then
  BOARD=$(tr -d '\0' < "$MODEL_FILE")
else  # not a Jetson (or a container without /proc/device-tree): a bash error line said only "No such file"
  BOARD="unknown: no $MODEL_FILE, not a Jetson?"
fi
case "${EDGEKV_PROFILE:-}:$BOARD" in
  :*"AGX Orin"*) PROFILE=orin-agx-64gb ;;
  :*"Orin Nano"*|:*"Orin NX"*) PROFILE=orin-nano-8gb ;;
  :*) echo "no deployment profile for this board ($BOARD): set EDGEKV_PROFILE to one of configs/*.yaml" \
        "(without .yaml)" >&2
      exit 2 ;;
  *) PROFILE=$EDGEKV_PROFILE ;;
esac
if [ ! -f "$SRC/configs/$PROFILE.yaml" ]; then
  echo "EDGEKV_PROFILE=$PROFILE: no configs/$PROFILE.yaml" >&2
  exit 2
fi
# ... and its memory: an Orin Nano 4 GB or an AGX Orin 32 GB gives the model string of its larger sibling, whose
# profile's cache it cannot hold (the daemon would refuse to start, or the board swap). A profile given is taken as is.
if [ -z "${EDGEKV_PROFILE:-}" ]; then
  MEM_KB=$(awk '/^MemTotal:/ {print $2}' "${EDGEKV_MEMINFO:-/proc/meminfo}" 2>/dev/null || true)
  case $PROFILE in orin-agx-64gb) NEED_GIB=48 ;; orin-nano-8gb) NEED_GIB=6 ;; *) NEED_GIB=0 ;; esac
  if [ -n "$MEM_KB" ] && [ "$MEM_KB" -lt $((NEED_GIB * 1048576)) ]; then
    echo "board: $BOARD with $((MEM_KB / 1024)) MiB of memory: configs/$PROFILE.yaml is for one of at least" \
         "$NEED_GIB GiB (its cache would not fit); copy it into configs/, lower cache.max_mib until" \
         "'edgekv plan --config FILE' says it fits, and give its name as EDGEKV_PROFILE" >&2
    exit 2
  fi
fi
echo "board: $BOARD -> profile configs/$PROFILE.yaml"

run apt-get update
run apt-get install -y python3-venv python3-pip python3-libnvinfer python3-opencv \
  gstreamer1.0-tools gstreamer1.0-plugins-good gstreamer1.0-plugins-bad v4l-utils libportaudio2 \
  python3-gi gir1.2-gstreamer-1.0
if ! id -u edgekv >/dev/null 2>&1; then
  run useradd --system --home /var/cache/edgekv --shell /usr/sbin/nologin --groups video,render,audio edgekv
fi
# /var/lib/edgekv: the persistent memory (state.dir) and the archive (archive.dir) of the README's examples
run install -d -o edgekv -g edgekv /var/cache/edgekv /var/log/edgekv
run install -d -o edgekv -g edgekv -m 0700 /var/lib/edgekv /var/lib/edgekv/archive  # what it saw: its user's alone
run install -d /etc/edgekv
# --system-site-packages: TensorRT and OpenCV (with GStreamer) bindings come from apt
run python3 -m venv --system-site-packages "$PREFIX/venv"
run "$PREFIX/venv/bin/pip" install "$WHEEL"
if [ "$DRY_RUN" = 1 ]; then
  echo "+ $PREFIX/venv/bin/python -c 'import torch; print(torch.__version__)' > $PREFIX/torch-pin.txt"
else
  "$PREFIX/venv/bin/python" -c 'import torch; print("torch==" + torch.__version__)' > "$PREFIX/torch-pin.txt"
fi
# [export]: what `edgekv build` needs (onnx, onnxscript) without the CPU-only onnxruntime of [engines]
run "$PREFIX/venv/bin/pip" install -c "$PREFIX/torch-pin.txt" "${SRC}[server,export]"
if [ -n "${EDGEKV_ORT_WHEEL:-}" ]; then
  run "$PREFIX/venv/bin/pip" install "$EDGEKV_ORT_WHEEL"
fi
if [ ! -f /etc/edgekv/deploy.yaml ]; then
  run install -m 0644 "$SRC/configs/$PROFILE.yaml" /etc/edgekv/deploy.yaml
fi
run install -m 0644 "$SRC/jetson/edgekv-camera.service" /etc/systemd/system/edgekv-camera.service
run systemctl daemon-reload
run systemctl enable edgekv-camera.service
echo "edit /etc/edgekv/deploy.yaml (model.path, video.source), check that its cache fits this board's memory:"
echo "  $PREFIX/venv/bin/edgekv plan --config /etc/edgekv/deploy.yaml"
echo "build the TensorRT engines on this device:"
echo "  sudo -u edgekv $PREFIX/venv/bin/edgekv build --config /etc/edgekv/deploy.yaml --backend tensorrt"
echo "then: sudo systemctl start edgekv-camera"
