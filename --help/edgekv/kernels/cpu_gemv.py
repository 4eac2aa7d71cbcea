"""Matrix-vector products on CPU for decode, in C (``cpu_gemv.c``), built with the system compiler at first
use: bf16 weights (issue 17) and 4-bit weights (issue 29).

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

4-bit weights (the AutoAWQ GEMM format of ``edgekv/model/int4.py``) are repacked once into the kernel's
tiles (``int4_tiles``: 16 output columns x 4 input rows per 32 bytes, see ``cpu_gemv.c``); the products are
integer (the activations as 24-bit fixed point per group) and the output fp32:

    gemv_int4(tiles, scales, zeros, x, bias=None, threads=1) -> fp32 [N]
    dequant_int4(tiles, scales, zeros, dtype)                -> [N, K] weight (prefill: then torch's GEMM)

int8 weights (the opt-in int8 ``lm_head``, ``model.lm_head: int8``) with an fp32 scale per row and group:

    q8_quantize(weight, group=128)              -> (int8 tiles [N/8, K/16, 128], fp32 scales [K/group, N])
    gemm_q8(tiles, scales, x [P, K], threads=1) -> fp32 [P, N]
    q8_dequant(tiles, scales)                   -> fp32 [N, K];  q8_rows(tiles, index) -> int8 rows

The glue of a decode step, in the arithmetic of transformers' eager code (one call where torch issues 6-8
small operations):

    rms_norm(x [..., n], weight [n], eps) -> RMSNorm(x) * weight, x's dtype (fp32 or bf16)
    rotary_(x [H, P, hd], cos [P, hd], sin [P, hd]) -> x rotated in place (q and k, rotate_half layout)

and a whole decoder layer of a 4-bit model with bf16 activations in two calls around its attention
(``Int4Layer``: ``pre`` = norm, q/k/v products, rotary; ``post`` = o product, residual, norm, SwiGLU MLP,
residual).

``load(portable=True)`` builds the same source without SIMD (``-DEDGEKV_PORTABLE``): the loop a CPU
without AVX2 or NEON runs, so that it is tested on this one.
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


def _flag_sets(portable: bool = False) -> list[list[str]]:
    native = ["-mcpu=native"] if platform.machine().lower() in ("aarch64", "arm64") else ["-march=native"]
    # -fno-math-errno: lrint becomes one instruction (the 4-bit kernel rounds every activation with it)
    base = ["-O3", "-fno-math-errno", "-fPIC", "-shared", "-pthread", "-std=c11"] + (["-DEDGEKV_PORTABLE"] if portable else [])
    return [base + native, base]


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


class Q4Linear(ctypes.Structure):
    """``struct edgekv_q4_linear``: one tiled 4-bit weight (``Int4Product``'s buffers) for the fused layer."""

    _fields_ = [("tiles", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("zeros", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("G", ctypes.c_int64)]


def _build(portable: bool = False) -> ctypes.CDLL:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler: {cc!r} is not on PATH (set CC, or install gcc)")
    source = SOURCE.read_bytes()
    version = _compiler_version(cc)
    errors = []
    for flags in _flag_sets(portable):
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(),
                                         platform.machine().encode(), platform.node().encode()])).hexdigest()[:16]
        target = cache_dir() / f"cpu_gemv-{key}.so"
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                result = subprocess.run([cc, *flags, "-o", str(built), str(SOURCE), "-lm"], capture_output=True,
                                        text=True, timeout=120)
                if result.returncode != 0:
                    errors.append(f"{cc} {' '.join(flags)}: {result.stderr.strip()[-400:]}")
                    continue
                os.replace(built, target)
        lib = ctypes.CDLL(str(target))
        lib.edgekv_gemv_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        lib.edgekv_gemv_bf16.restype = ctypes.c_int
        lib.edgekv_gemv_simd.restype = ctypes.c_int
        pointer, int64 = ctypes.c_void_p, ctypes.c_int64
        lib.edgekv_gemv_int4.argtypes = [pointer] * 6 + [int64, int64, int64, ctypes.c_int, ctypes.c_int]
        lib.edgekv_gemv_int4.restype = ctypes.c_int
        lib.edgekv_gemv_int4_bf16.argtypes = [pointer] * 6 + [int64, int64, int64, ctypes.c_int]
        lib.edgekv_gemv_int4_bf16.restype = ctypes.c_int
        lib.edgekv_gemm_int4.argtypes = [pointer] * 6 + [int64, int64, int64, int64, ctypes.c_int, ctypes.c_int]
        lib.edgekv_gemm_int4.restype = ctypes.c_int
        lib.edgekv_gemm_int4_bf16.argtypes = [pointer] * 6 + [int64, int64, int64, int64, ctypes.c_int]
        lib.edgekv_gemm_int4_bf16.restype = ctypes.c_int
        lib.edgekv_dequant_int4.argtypes = [pointer] * 4 + [ctypes.c_int, int64, int64, int64, ctypes.c_int]
        lib.edgekv_dequant_int4.restype = ctypes.c_int
        lib.edgekv_int4_simd.restype = ctypes.c_int
        lib.edgekv_int4_set_wide.argtypes = [ctypes.c_int]
        lib.edgekv_pool_hold.argtypes = [ctypes.c_int]
        lib.edgekv_pool_hold.restype = ctypes.c_int
        lib.edgekv_int4_set_wide.restype = ctypes.c_int
        lib.edgekv_gemm_q8.argtypes = [pointer] * 4 + [int64, int64, int64, int64, ctypes.c_int]
        lib.edgekv_gemm_q8.restype = ctypes.c_int
        lib.edgekv_rmsnorm.argtypes = [pointer] * 3 + [int64, int64, ctypes.c_float, ctypes.c_int]
        lib.edgekv_rmsnorm.restype = ctypes.c_int
        lib.edgekv_rotary.argtypes = [pointer] * 3 + [int64] * 5 + [ctypes.c_int]
        lib.edgekv_rotary.restype = ctypes.c_int
        linear = ctypes.POINTER(Q4Linear)
        lib.edgekv_layer_pre_bf16.argtypes = ([pointer, pointer, ctypes.c_float] + [linear] * 3 + [pointer] * 5
                                              + [int64] * 5 + [ctypes.c_int])
        lib.edgekv_layer_pre_bf16.restype = ctypes.c_int
        lib.edgekv_layer_post_bf16.argtypes = ([pointer, pointer, linear, pointer, ctypes.c_float] + [linear] * 3
                                               + [pointer, int64, int64, ctypes.c_int])
        lib.edgekv_layer_post_bf16.restype = ctypes.c_int
        return lib
    raise OSError("the C kernel did not compile: " + " | ".join(errors))


def load(portable: bool = False) -> ctypes.CDLL | None:
    """The built kernel library, building it on first use; None when that is impossible (see
    ``unavailable_reason``). ``EDGEKV_NATIVE=0`` turns it off. ``portable``: the build without SIMD."""
    with _lock:
        if portable:
            if "portable" not in _state:
                try:
                    _state["portable"] = _build(portable=True)
                except (OSError, subprocess.SubprocessError):
                    _state["portable"] = None
            return _state["portable"]
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


# ---------------------------------------------------------------------------------------------- 4-bit
TILE_COLUMNS, TILE_ROWS = 16, 4
INT4_SIMD = {0: "portable", 1: "avx2", 2: "neon", 3: "avx512"}
INT4_DIGITS = {torch.float32: 4, torch.float16: 3, torch.bfloat16: 2}  # bytes of fixed point per activation


def int4_kernel_fits(in_features: int, out_features: int, group: int) -> str | None:
    """Why the 4-bit kernel cannot take a weight of this shape, or None when it can."""
    if out_features % TILE_COLUMNS or in_features % 16 or group % 16 or in_features % group:
        return (f"the 4-bit CPU kernel needs out_features % 16, in_features % 16 and group size % 16 == 0 "
                f"(got {out_features}, {in_features}, {group})")
    return None


def int4_tiles(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] (0..15) -> the kernel's tiles, uint8 [N/16, K/4, 32]: byte 2c + p of the tile of rows
    k0..k0+3 holds q[k0 + p, c] in its low and q[k0 + 2 + p, c] in its high nibble (``cpu_gemv.c``)."""
    k, n = q.shape
    # q[kq*4 + h*2 + p, b*16 + c] -> [b, kq, c, p, h]
    t = q.to(torch.uint8).reshape(k // TILE_ROWS, 2, 2, n // TILE_COLUMNS, TILE_COLUMNS).permute(3, 0, 4, 2, 1)
    return (t[..., 0] | (t[..., 1] << 4)).reshape(n // TILE_COLUMNS, k // TILE_ROWS, 32).contiguous()


def int4_untile(tiles: torch.Tensor) -> torch.Tensor:
    """The tiles -> q [K, N] uint8 (the inverse of ``int4_tiles``)."""
    blocks, quads, _ = tiles.shape
    t = tiles.reshape(blocks, quads, TILE_COLUMNS, 2)
    both = torch.stack([t & 0xF, t >> 4], dim=-1)  # [b, kq, c, p, h]
    return both.permute(1, 4, 3, 0, 2).reshape(quads * TILE_ROWS, blocks * TILE_COLUMNS).contiguous()


def int4_simd(portable: bool = False) -> str:
    lib = load(portable)
    return INT4_SIMD[lib.edgekv_int4_simd()] if lib else "unavailable"


def int4_set_wide(on: bool) -> bool | None:
    """Bf16 activations through the kernel's AVX-512 blocks (True) or its AVX2 ones (False) where both were
    compiled (an AVX-512 BW CPU): the same outputs, for tests and benchmarks to compare. Returns the setting it
    replaced, or None where there is no such choice (nothing changes). Set it between products, not during."""
    lib = load()
    before = lib.edgekv_int4_set_wide(int(bool(on))) if lib else -1
    return None if before < 0 else bool(before)


def _int4_weight(tiles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 activations: int | None = None) -> tuple[int, int, int]:
    """(N, K, group) of a tiled 4-bit weight the kernel can read (and ``activations`` of them, when given);
    ValueError naming what does not fit."""
    blocks, quads, width = tiles.shape
    n, k = blocks * TILE_COLUMNS, quads * TILE_ROWS
    groups = scales.shape[0]
    if (tiles.dtype != torch.uint8 or width != 32 or scales.dtype != torch.float16 or tuple(scales.shape) != (groups, n)
            or zeros.dtype != torch.uint8 or tuple(zeros.shape) != (groups, n) or k % groups
            or not (tiles.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous())
            or activations not in (None, k)):
        given = "" if activations is None else f" and {activations} activations"
        raise ValueError(f"cpu_gemv int4: tiles {tuple(tiles.shape)} {tiles.dtype}, scales {tuple(scales.shape)} "
                         f"{scales.dtype}, zeros {tuple(zeros.shape)} {zeros.dtype}{given} do not make one contiguous "
                         f"[{n}, {k}] 4-bit weight")
    reason = int4_kernel_fits(k, n, k // groups)
    if reason:
        raise ValueError(f"cpu_gemv int4: {reason}")
    return n, k, k // groups


def gemv_int4(tiles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, x: torch.Tensor,
              bias: torch.Tensor | None = None, threads: int = 1, portable: bool = False,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """tiles uint8 [N/16, K/4, 32], scales float16 [K/g, N], zeros uint8 [K/g, N], x with K elements (any
    float dtype), bias [N] or None -> fp32 [N]. The activations are read as fixed point per group, as many
    bits as their dtype warrants (``cpu_gemv.c``: fp32 31, fp16 23, bf16 15). Raises RuntimeError when the
    kernel is unavailable and ValueError for shapes or a non-finite activation it cannot take."""
    _, k, _ = _int4_weight(tiles, scales, zeros, x.numel())
    return gemm_int4(tiles, scales, zeros, x.reshape(1, k), bias, threads, portable,
                     None if out is None else out.view(1, -1)).view(-1)


def gemm_int4(tiles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, x: torch.Tensor,
              bias: torch.Tensor | None = None, threads: int = 1, portable: bool = False,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``gemv_int4`` for P rows at once: x [P, K] -> fp32 [P, N], each row exactly what ``gemv_int4`` gives it;
    every 16-column block of the weight is read from memory once for all the rows (``cpu_gemv.c``)."""
    lib = load(portable)
    if lib is None:
        raise RuntimeError(f"cpu_gemv: the C kernel is unavailable ({_state.get('reason')})")
    n, k, group = _int4_weight(tiles, scales, zeros)
    if x.dim() != 2 or x.shape[1] != k or x.shape[0] < 1:
        raise ValueError(f"cpu_gemv int4: activations {tuple(x.shape)} for a weight of {k} inputs (want [P, {k}])")
    rows = x.shape[0]
    x32 = x.to(torch.float32).contiguous()
    bias32 = None if bias is None else bias.reshape(-1).to(torch.float32).contiguous()
    if out is None:
        out = torch.empty(rows, n, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (rows, n) or not out.is_contiguous():
        raise ValueError(f"cpu_gemv int4: out must be a contiguous fp32 [{rows}, {n}] tensor, got {out.dtype} "
                         f"{tuple(out.shape)}")
    code = lib.edgekv_gemm_int4(tiles.data_ptr(), scales.data_ptr(), zeros.data_ptr(), x32.data_ptr(),
                                None if bias32 is None else bias32.data_ptr(), out.data_ptr(), rows, n, k, group,
                                INT4_DIGITS.get(x.dtype, 4), max(1, int(threads)))
    _int4_code(code, rows, n, k)
    return out


def _int4_code(code: int, rows: int, n: int, k: int) -> None:
    if code == -2:
        raise ValueError("cpu_gemv int4: an activation is inf or nan")
    if code != 0:
        raise MemoryError(f"cpu_gemv int4: error {code} for {rows} row(s) of a [{n}, {k}] product")


class Int4Product:
    """One 4-bit weight checked once for the products of decode and of short chunks: ``product(x, threads)``.

    ``gemv_int4`` checks shapes and converts the activations, the bias and the result with torch on every
    call — ~23 us of Python a call on the 2-core x86 machine, 6 ms of a 3B token's 252 products. Here the
    shapes are checked and the bias widened to fp32 once (a copy: later changes to the bias tensor are not
    seen, as the weights themselves were repacked), and bf16 rows go to the kernel's bf16 entry, which
    widens them, multiplies and rounds the result to bf16 in C. Other dtypes take ``gemm_int4``; the results
    are the same bits either way (fp32 result rounded once to the activations' dtype)."""

    def __init__(self, tiles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        lib = load()
        if lib is None:
            raise RuntimeError(f"cpu_gemv: the C kernel is unavailable ({_state.get('reason')})")
        self.n, self.k, self.group = _int4_weight(tiles, scales, zeros)
        if bias is not None and bias.numel() != self.n:
            raise ValueError(f"cpu_gemv int4: a bias of {bias.numel()} for {self.n} outputs")
        self.tiles, self.scales, self.zeros = tiles, scales, zeros
        self.bias32 = None if bias is None else bias.detach().reshape(-1).to(torch.float32).contiguous()
        self._entry = lib.edgekv_gemm_int4_bf16

    def __call__(self, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
        """x [..., K] (P rows of K) -> [P * N] in x's dtype. ValueError for an inf / nan activation."""
        if x.numel() == 0 or x.shape[-1] != self.k:
            raise ValueError(f"cpu_gemv int4: activations {tuple(x.shape)} for a weight of {self.k} inputs")
        rows = x.numel() // self.k
        if x.dtype is not torch.bfloat16 or not x.is_contiguous():
            return gemm_int4(self.tiles, self.scales, self.zeros, x.reshape(rows, self.k), self.bias32,
                             threads).to(x.dtype).view(-1)
        out = torch.empty(rows * self.n, dtype=torch.bfloat16)
        code = self._entry(self.tiles.data_ptr(), self.scales.data_ptr(), self.zeros.data_ptr(), x.data_ptr(),
                           None if self.bias32 is None else self.bias32.data_ptr(), out.data_ptr(), rows, self.n,
                           self.k, self.group, threads if threads > 1 else 1)
        _int4_code(code, rows, self.n, self.k)
        return out


def dequant_int4(tiles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype = torch.float32,
                 portable: bool = False, threads: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight [N, K] (a ``nn.Linear``'s orientation) in fp32 (exact) or bf16 (rounded once). ``out``: a
    contiguous [N, K] tensor of that dtype (fp32 or bf16) to write into instead of a new one."""
    lib = load(portable)
    if lib is None:
        raise RuntimeError(f"cpu_gemv: the C kernel is unavailable ({_state.get('reason')})")
    blocks, quads, _ = tiles.shape
    n, k = blocks * TILE_COLUMNS, quads * TILE_ROWS
    native = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    if out is None:
        out = torch.empty(n, k, dtype=native)
    elif out.dtype != dtype or native != dtype or tuple(out.shape) != (n, k) or not out.is_contiguous():
        raise ValueError(f"cpu_gemv int4: out must be a contiguous [{n}, {k}] fp32 or bf16 tensor of the dtype "
                         f"asked, got {out.dtype} {tuple(out.shape)} for {dtype}")
    code = lib.edgekv_dequant_int4(tiles.data_ptr(), scales.data_ptr(), zeros.data_ptr(), out.data_ptr(),
                                   int(native == torch.bfloat16), n, k, k // scales.shape[0], max(1, int(threads)))
    if code != 0:
        raise ValueError(f"cpu_gemv int4: cannot dequantize a [{n}, {k}] weight (error {code})")
    return out if native == dtype else out.to(dtype)


# ---------------------------------------------------------------------------------------------- int8
Q8_GROUP = 128  # inputs per scale: the AWQ checkpoints' group size
Q8_TILE_ROWS = 8  # rows a tile
_Q8_QUANTIZE_ROWS = 8192  # rows quantized at a time (a 3B embedding: 32 MiB of fp32 temporaries, not 1.2 GiB)


def q8_quantize(weight: torch.Tensor, group: int = Q8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (int8 tiles [N/8, K/16, 128], fp32 scales [K/group, N]): per row and group of
    ``group`` inputs, scale = largest |w| / 127 and w8 = round(w / scale) (symmetric, round half to even; an
    all-zero group gets scale 0). The tiles hold rows 8b .. 8b + 7 of inputs 16c .. 16c + 15 as 128 consecutive
    bytes (row-major 8 x 16), so the kernel reads one stream (``cpu_gemv.c``; ``q8_rows`` reads rows back). The
    tiles are allocated as a weight (``hostmem.weight_empty``: huge pages at 3B's size)."""
    from edgekv.hostmem import weight_empty

    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"q8_quantize: expected a float weight [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if n % Q8_TILE_ROWS or group < 16 or group > 1024 or group % 16 or k % group:
        raise ValueError(f"q8_quantize: a [{n}, {k}] weight in groups of {group} does not fit the int8 kernel "
                         f"(out_features % 8 == 0; group a multiple of 16 in [16, 1024] dividing in_features)")
    tiles = weight_empty((n // Q8_TILE_ROWS, k // 16, Q8_TILE_ROWS * 16), torch.int8)
    scales = torch.empty(k // group, n, dtype=torch.float32)
    for row in range(0, n, _Q8_QUANTIZE_ROWS):
        block = weight[row:row + _Q8_QUANTIZE_ROWS].detach().to("cpu", torch.float32)
        rows = block.shape[0]
        if not bool(torch.isfinite(block).all()):
            raise ValueError(f"q8_quantize: the weight has inf or nan values (rows {row}..{row + rows - 1})")
        block = block.view(rows, k // group, group)
        scale = block.abs().amax(-1) / 127.0  # [rows, groups]
        q = torch.where(scale[..., None] > 0, block / scale[..., None], torch.zeros((), dtype=torch.float32))
        q = q.round_().clamp_(-127, 127).to(torch.int8).view(rows // Q8_TILE_ROWS, Q8_TILE_ROWS, k // 16, 16)
        tiles[row // Q8_TILE_ROWS:(row + rows) // Q8_TILE_ROWS] = q.permute(0, 2, 1, 3).reshape(-1, k // 16, 128)
        scales[:, row:row + rows] = scale.T
    return tiles, scales


def q8_rows(tiles: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` (any shape of int64) of the int8 weight -> int8 [*index.shape, K] (what an embedding
    lookup reads)."""
    blocks, columns, _ = tiles.shape
    picked = tiles[index // Q8_TILE_ROWS].view(*index.shape, columns, Q8_TILE_ROWS, 16)  # [..., K/16, 8, 16]
    lane = (index % Q8_TILE_ROWS)[..., None, None, None].expand(*index.shape, columns, 1, 16)
    return picked.gather(-2, lane).reshape(*index.shape, columns * 16)


def q8_dequant(tiles: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The int8 tiles and their scales -> the fp32 weight [N, K] (w8 * scale, exact in fp32)."""
    blocks, columns, _ = tiles.shape
    n, k = blocks * Q8_TILE_ROWS, columns * 16
    rows = tiles.view(blocks, columns, Q8_TILE_ROWS, 16).permute(0, 2, 1, 3).reshape(n, k)
    return (rows.to(torch.float32).view(n, scales.shape[0], -1) * scales.T[..., None]).view(n, k)


def gemm_q8(tiles: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, threads: int = 1,
            portable: bool = False) -> torch.Tensor:
    """tiles int8 [N/8, K/16, 128] and scales fp32 [K/g, N] (``q8_quantize``), x [P, K] (any float dtype) ->
    fp32 [P, N]: the activations read as 15-bit fixed point per group (``cpu_gemv.c``), integer products, one
    fp32 fma per group. Raises RuntimeError when the kernel is unavailable and ValueError for shapes or an inf /
    nan activation."""
    lib = load(portable)
    if lib is None:
        raise RuntimeError(f"cpu_gemv: the C kernel is unavailable ({_state.get('reason')})")
    if tiles.dim() != 3 or scales.dim() != 2:
        raise ValueError(f"cpu_gemv int8: tiles {tuple(tiles.shape)} and scales {tuple(scales.shape)} must be 3-D and 2-D")
    n, k = tiles.shape[0] * Q8_TILE_ROWS, tiles.shape[1] * 16
    groups = scales.shape[0]
    if (tiles.dtype != torch.int8 or tiles.shape[2] != Q8_TILE_ROWS * 16 or scales.dtype != torch.float32
            or tuple(scales.shape) != (groups, n) or groups < 1 or k % groups or (k // groups) % 16
            or not 16 <= k // groups <= 1024 or tiles.device.type != "cpu"
            or not (tiles.is_contiguous() and scales.is_contiguous())):
        raise ValueError(f"cpu_gemv int8: tiles {tiles.dtype} {tuple(tiles.shape)} and scales {scales.dtype} "
                         f"{tuple(scales.shape)} are not one contiguous CPU int8 weight [N/8, K/16, 128] with fp32 "
                         f"[K/g, N] scales, g a multiple of 16 in [16, 1024]")
    if x.dim() != 2 or x.shape[1] != k or x.shape[0] < 1:
        raise ValueError(f"cpu_gemv int8: activations {tuple(x.shape)} for a weight of {k} inputs (want [P, {k}])")
    x32 = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    code = lib.edgekv_gemm_q8(tiles.data_ptr(), scales.data_ptr(), x32.data_ptr(), out.data_ptr(), x.shape[0], n, k,
                              k // groups, max(1, int(threads)))
    if code == -2:
        raise ValueError("cpu_gemv int8: an activation is inf or nan")
    if code != 0:
        raise MemoryError(f"cpu_gemv int8: error {code} for {x.shape[0]} row(s) of a [{n}, {k}] product")
    return out


GLUE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _glue_lib(portable: bool):
    lib = load(portable)
    if lib is None:
        raise RuntimeError(f"cpu_gemv: the C kernel is unavailable ({_state.get('reason')})")
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, portable: bool = False) -> torch.Tensor:
    """Qwen2's RMSNorm of the rows of ``x [..., n]`` (fp32 or bf16, CPU, contiguous) times ``weight [n]`` of
    the same dtype, in transformers' arithmetic (``cpu_gemv.c``); a new tensor. ValueError names what does
    not fit."""
    n = x.shape[-1] if x.dim() else 0
    if (x.dtype not in GLUE_DTYPES or weight.dtype != x.dtype or x.device.type != "cpu"
            or weight.device.type != "cpu" or tuple(weight.shape) != (n,) or n == 0):
        raise ValueError(f"cpu_gemv rms_norm: x {x.dtype} {tuple(x.shape)} on {x.device} and weight {weight.dtype} "
                         f"{tuple(weight.shape)} are not CPU fp32/bf16 rows [..., n] with a weight [n] of their dtype")
    x = x.contiguous()
    weight = weight.contiguous()
    out = torch.empty_like(x)
    code = _glue_lib(portable).edgekv_rmsnorm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // n, n,
                                              float(eps), GLUE_DTYPES[x.dtype])
    if code != 0:
        raise ValueError(f"cpu_gemv rms_norm: error {code} for x {tuple(x.shape)}")
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """Rotate ``x [H, P, hd]`` (fp32 or bf16, CPU, last dim contiguous; any head and row strides) in place by
    ``cos, sin [P, hd]`` of its dtype (contiguous): ``x * cos + rotate_half(x) * sin`` rounded as transformers'
    eager code rounds it (``cpu_gemv.c``). Returns ``x``. ValueError names what does not fit."""
    if (x.dim() != 3 or x.dtype not in GLUE_DTYPES or x.device.type != "cpu" or x.stride(-1) != 1
            or x.shape[-1] % 2 or x.shape[-1] > 1024
            or any(t.dtype != x.dtype or t.device.type != "cpu" or tuple(t.shape) != tuple(x.shape[1:])
                   or not t.is_contiguous() for t in (cos, sin))):
        raise ValueError(f"cpu_gemv rotary_: x {x.dtype} {tuple(x.shape)} strides {x.stride()} and cos/sin "
                         f"{cos.dtype} {tuple(cos.shape)} are not CPU fp32/bf16 [H, P, hd] (last dim contiguous, hd "
                         f"even and at most 1024) with contiguous [P, hd] of its dtype")
    heads, rows, hd = x.shape
    code = _glue_lib(portable).edgekv_rotary(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), heads, rows, hd,
                                             x.stride(0), x.stride(1), GLUE_DTYPES[x.dtype])
    if code != 0:
        raise ValueError(f"cpu_gemv rotary_: error {code} for x {tuple(x.shape)}")
    return x


class Int4Layer:
    """One Qwen2 decoder layer of a 4-bit model with bf16 activations as two C calls around its attention
    (``cpu_gemv.c``, "One Qwen2 decoder layer"): ``pre(x, cos, sin)`` -> rotated q, k and v; ``post(x, a)`` -> the
    layer's output from its input and the attention's. Each is what the seven ``Int4Product``s and torch's bf16
    operations between them give one by one, but for last-bit differences of the norms' means (summed in double)
    and SiLU's exp (libm's), which move a bf16 value only on a rounding tie. ValueError for an inf / nan
    activation (nothing written to the caller's tensors), for shapes that do not fit."""

    def __init__(self, products: dict[str, Int4Product], input_norm: torch.Tensor, post_norm: torch.Tensor,
                 eps: float, heads: int, kv_heads: int, head_dim: int) -> None:
        lib = _glue_lib(False)
        names = ("q", "k", "v", "o", "gate", "up", "down")
        if set(products) != set(names):
            raise ValueError(f"cpu_gemv Int4Layer: products {sorted(products)}, want {list(names)}")
        d = products["q"].k
        norms = (input_norm, post_norm)
        if any(t.dtype != torch.bfloat16 or tuple(t.shape) != (d,) or t.device.type != "cpu" for t in norms):
            raise ValueError(f"cpu_gemv Int4Layer: the norms' weights must be bf16 [{d}] on the CPU")
        self._lib, self.d, self.eps = lib, d, float(eps)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self._products = products  # keeps the buffers the structs point at alive
        self._norms = tuple(t.detach().contiguous() for t in norms)
        self._w = {name: Q4Linear(p.tiles.data_ptr(), p.scales.data_ptr(), p.zeros.data_ptr(),
                                  None if p.bias32 is None else p.bias32.data_ptr(), p.n, p.k, p.group)
                   for name, p in products.items()}
        self._refs = {name: ctypes.byref(w) for name, w in self._w.items()}
        self.inner = products["gate"].n

    def pre(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            threads: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x bf16 [P, d], cos / sin bf16 [P, hd] -> q [P, Hq * hd], k, v [P, Hkv * hd] (bf16, q and k rotated)."""
        rows = x.shape[0]
        if (x.dtype != torch.bfloat16 or tuple(x.shape) != (rows, self.d) or rows < 1 or not x.is_contiguous()
                or any(t.dtype != torch.bfloat16 or tuple(t.shape) != (rows, self.head_dim) or not t.is_contiguous()
                       for t in (cos, sin))):
            raise ValueError(f"cpu_gemv Int4Layer.pre: x {x.dtype} {tuple(x.shape)}, cos {cos.dtype} "
                             f"{tuple(cos.shape)}: want contiguous bf16 [P, {self.d}] and [P, {self.head_dim}]")
        q = torch.empty(rows, self.heads * self.head_dim, dtype=torch.bfloat16)
        k = torch.empty(rows, self.kv_heads * self.head_dim, dtype=torch.bfloat16)
        v = torch.empty_like(k)
        r = self._refs
        code = self._lib.edgekv_layer_pre_bf16(
            x.data_ptr(), self._norms[0].data_ptr(), self.eps, r["q"], r["k"], r["v"], cos.data_ptr(), sin.data_ptr(),
            q.data_ptr(), k.data_ptr(), v.data_ptr(), rows, self.d, self.heads, self.kv_heads, self.head_dim,
            max(1, int(threads)))
        _int4_code(code, rows, self.d, self.d)
        return q, k, v

    def post(self, x: torch.Tensor, attention: torch.Tensor, threads: int = 1) -> torch.Tensor:
        """x bf16 [P, d] (the layer's input), attention bf16 [P, Hq * hd] -> the layer's output bf16 [P, d]."""
        rows = x.shape[0]
        width = self.heads * self.head_dim
        if (x.dtype != torch.bfloat16 or tuple(x.shape) != (rows, self.d) or rows < 1 or not x.is_contiguous()
                or attention.dtype != torch.bfloat16 or tuple(attention.shape) != (rows, width)
                or not attention.is_contiguous()):
            raise ValueError(f"cpu_gemv Int4Layer.post: x {x.dtype} {tuple(x.shape)}, attention {attention.dtype} "
                             f"{tuple(attention.shape)}: want contiguous bf16 [P, {self.d}] and [P, {width}]")
        out = torch.empty_like(x)
        r = self._refs
        code = self._lib.edgekv_layer_post_bf16(
            x.data_ptr(), attention.data_ptr(), r["o"], self._norms[1].data_ptr(), self.eps, r["gate"], r["up"],
            r["down"], out.data_ptr(), rows, self.d, max(1, int(threads)))
        _int4_code(code, rows, self.d, self.inner)
        return out
