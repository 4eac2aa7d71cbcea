"""Optional Triton: the import guard and the one dispatch rule every op follows.

Triton is optional (Jetson and CPU installs may lack it), so nothing here fails when it is missing:
``triton`` and ``tl`` are then ``None``, ``jit`` leaves the kernels as plain (never launched) functions
and every op runs its torch reference.

The interpreter is a per-process choice: ``TRITON_INTERPRET=1`` must be set before ``import triton``,
because Triton's own ``tl.zeros``/``tl.sum``/... are jitted when Triton is imported, and a compiled
one cannot be called from an interpreted kernel (flipping the variable later is not enough).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

# Floating-point contraction (a*b+c as one FMA) stays on, as every kernel was written and measured with it (issue 32's
# GPU figures): Triton 3.9 warns that its default turns it off in 3.10, which would change the kernels' rounding
# with a Triton upgrade. A user's own setting wins.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

try:
    import triton
    import triton.language as tl
except (ImportError, OSError, RuntimeError):  # pragma: no cover - installs without a working Triton
    triton = None
    tl = None

try:  # precise fp32 sin/cos on CUDA (the interpreter has no libdevice)
    from triton.language.extra import libdevice
except (ImportError, OSError, RuntimeError):  # pragma: no cover
    libdevice = None


def triton_available() -> bool:
    """True when ``import triton`` works (a GPU is not required: the interpreter runs on CPU)."""
    return triton is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, read as Triton reads it)."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def use_triton(*tensors: torch.Tensor) -> bool:
    """The dispatch rule of every op in ``edgekv.kernels``.

    ``EDGEKV_TRITON=0`` forces the torch reference, ``EDGEKV_TRITON=1`` forces Triton (on CPU tensors
    that needs ``TRITON_INTERPRET=1`` too). Otherwise Triton runs when it imports and either every
    tensor is on CUDA or the interpreter is on.
    """
    forced = os.environ.get("EDGEKV_TRITON", "")
    if forced == "0":
        return False
    if not triton_available():
        if forced == "1":
            raise RuntimeError("EDGEKV_TRITON=1 but Triton does not import")
        return False
    if forced == "1" or interpreting():
        return True
    return all(t.is_cuda for t in tensors)


def dense(x: Any) -> torch.Tensor:
    """``x`` as a tensor: an 8-bit cache's ``DequantizedView`` (edgekv/cache/capped.py) materialized whole —
    the Triton launches take plain tensors; the CPU passes index the view a block at a time instead."""
    return x.materialize() if hasattr(x, "materialize") else x


def precise_trig() -> bool:
    """Use libdevice sin/cos (accurate for large angles) in compiled kernels; the interpreter lacks it."""
    return libdevice is not None and not interpreting()


def jit(fn: Callable[..., None]) -> Any:
    """``triton.jit`` when Triton imports; otherwise the plain function (never launched: see ``use_triton``)."""
    return triton.jit(fn) if triton is not None else fn


@jit
def round_to_bf16(w):
    """fp32 -> the nearest bf16 (ties to even), kept in fp32: the interpreter's own conversion truncates."""
    bits = w.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
