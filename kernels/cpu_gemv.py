"""bf16 matrix-vector product on CPU for decode, in C (``cpu_gemv.c``), built with the system compiler
at first use.

One decode token multiplies one vector by every weight of the language model, so on a CPU its time is
the time to stream the weights from memory. torch's bf16 ``linear`` on an AVX2 CPU (no native bf16
arithmetic) converts as it goes and streams at about half the speed of its own fp32 product (measured
in ``edgekv/model/decode_routes.py``); the C kernel widens bf16 to fp32 with a 16-bit shift, eight
weights per instruction, fp32 products and sums, and rounds the output once (to nearest even) — the
numbers of an fp32 product of the same bf16 weights, rounded to bf16.

Built with ``$CC`` (default ``cc``) ``-O3 -march=native`` (``-mcpu=native`` on aarch64; plain ``-O3``
if the compiler refuses either) into ``$EDGEKV_CACHE_DIR/native`` (default ``~/.cache/edgekv/native``),
named by a hash of the source, the flags, the compiler's version and the machine, written to a
temporary name and renamed, so concurrent first uses cannot load a half-written library. Without a
compiler ``load()`` returns ``None`` and ``unavailable_reason()`` says why; the runtime then keeps
torch's kernel (``model.decode_route``).

    gemv_bf16(weight, x, bias=None, threads=1) -> bf16 [N]   the C kernel
    gemv_bf16_reference(weight, x, bias=None)  -> bf16 [N]   torch, fp32 math, the same rounding
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_gemv.c")
_lock = threading.Lock()
_state: dict = {}


def cache_dir() -> Path:
    root = os.environ.get("EDGEKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "edgekv")
    return Path(root) / "native"


def _flag_sets() -> list[list[str]]:
    native = ["-mcpu=native"] if platform.machine().lower() in ("aarch64", "arm64") else ["-march=native"]
    base = ["-O3", "-fPIC", "-shared", "-pthread", "-std=c11"]
    return [base + native, base]


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler: {cc!r} is not on PATH (set CC, or install gcc)")
    source = SOURCE.read_bytes()
    version = _compiler_version(cc)
    errors = []
    for flags in _flag_sets():
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(),
                                         platform.machine().encode(), platform.node().encode()])).hexdigest()[:16]
        target = cache_dir() / f"cpu_gemv-{key}.so"
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                result = subprocess.run([cc, *flags, "-o", str(built), str(SOURCE)], capture_output=True, text=True,
                                        timeout=120)
                if result.returncode != 0:
                    errors.append(f"{cc} {' '.join(flags)}: {result.stderr.strip()[-400:]}")
                    continue
                os.replace(built, target)
        lib = ctypes.CDLL(str(target))
        lib.edgekv_gemv_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        lib.edgekv_gemv_bf16.restype = ctypes.c_int
        lib.edgekv_gemv_simd.restype = ctypes.c_int
        return lib
    raise OSError("the C kernel did not compile: " + " | ".join(errors))


def load() -> ctypes.CDLL | None:
    """The built kernel library, building it on first use; None when that is impossible (see
    ``unavailable_reason``). ``EDGEKV_NATIVE=0`` turns it off."""
    with _lock:
        if "lib" not in _state:
            if os.environ.get("EDGEKV_NATIVE", "1") == "0":
                _state.update(lib=None, reason="EDGEKV_NATIVE=0")
            else:
                try:
                    _state.update(lib=_build(), reason=None)
                except (OSError, subprocess.SubprocessError) as exc:
                    _state.update(lib=None, reason=str(exc))
        return _state["lib"]


def unavailable_reason() -> str | None:
    load()
    return _state.get("reason")


def simd() -> bool:
    """True when the library was built with the AVX2 path (False: the portable loop)."""
    lib = load()
    return bool(lib and lib.edgekv_gemv_simd())


def gemv_bf16_reference(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """bf16(bias + weight @ x) computed in fp32 from the bf16 values."""
    out = weight.float() @ x.reshape(-1).float()
    if bias is not None:
        out = out + bias.float()
    return out.to(torch.bfloat16)


def gemv_bf16(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None, threads: int = 1,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight`` bf16 [N, K] (contiguous, CPU), ``x`` bf16 with K elements, ``bias`` bf16 [N] or None ->
    bf16 [N]; raises RuntimeError when the kernel is unavailable."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"cpu_gemv: the C kernel is unavailable ({_state.get('reason')})")
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or x.numel() != k:
        raise ValueError(f"cpu_gemv: expected bf16 weight [N, K] and a bf16 vector of K, got {weight.dtype} "
                         f"{tuple(weight.shape)} and {x.dtype} {tuple(x.shape)}")
    if weight.device.type != "cpu" or not weight.is_contiguous():
        raise ValueError("cpu_gemv: the weight must be a contiguous CPU tensor")
    x = x.reshape(-1).contiguous()
    if bias is not None:
        if bias.dtype != torch.bfloat16 or bias.numel() != n:
            raise ValueError(f"cpu_gemv: expected a bf16 bias of {n}, got {bias.dtype} {tuple(bias.shape)}")
        bias = bias.contiguous()
    if out is None:
        out = torch.empty(n, dtype=torch.bfloat16)
    code = lib.edgekv_gemv_bf16(weight.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(),
                                out.data_ptr(), n, k, max(1, int(threads)))
    if code != 0:
        raise MemoryError(f"cpu_gemv: no memory for the fp32 scratch of a [{n}, {k}] product")
    return out
