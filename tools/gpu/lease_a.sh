#!/usr/bin/env bash
# Issue 32, device call A (a lent H100/H200): what already exists, run once on CUDA.
#   env + providers | pytest -m gpu | edgekv bench kernels (3B shapes) | the whole suite on CUDA torch (xdist)
# Carry: .whl (test dependencies the GPU image lacks; see tools/gpu/README.md). Logs and figures go to $OUT.
WHEELS=.whl source "$(dirname "$0")/setup.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv
  python3 - <<'PY'
import torch, triton, transformers, onnxruntime as ort, platform
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__)
print("gpu", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))
print("onnxruntime", ort.__version__, ort.get_available_providers())
print("python", platform.python_version(), "cpus", __import__("os").cpu_count())
PY
  gcc --version | head -1; } 2>&1 | tee "$OUT/env.txt"
stamp "pytest -m gpu"
timeout -s INT 200 python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
stamp "bench kernels"
timeout -s INT 150 edgekv bench kernels --json "$OUT/bench-kernels.json" --plot "$OUT/bench-kernels.png" 2>&1 | tee "$OUT/bench-kernels.log"
stamp "whole suite on CUDA torch"
timeout -s INT ${SUITE_S:-210} python3 -m pytest -q -p no:cacheprovider -n 14 --timeout 150 -rfE tests > "$OUT/suite.log" 2>&1
echo "suite rc $?"; tail -45 "$OUT/suite.log"
stamp done
