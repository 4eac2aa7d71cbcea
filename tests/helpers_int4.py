"""The 4-bit checkpoint oracle of issue 29's tests, written from the published format descriptions (not from
edgekv's unpacking code): see ``test_int4_format.py``'s docstring for the layouts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from edgekv.model.int4 import Int4Linear

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GROUP = 32


# ---------------------------------------------------------------------------------------------- oracle
def _as_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def awq_pack_oracle(q: np.ndarray) -> torch.Tensor:
    """[R, C] -> int32 [R, C/8], AutoAWQ's order, one value at a time."""
    rows, cols = q.shape
    out = np.zeros((rows, cols // 8), dtype=np.uint64)
    for j in range(cols // 8):
        for i in range(8):
            out[:, j] |= q[:, 8 * j + ORDER[i]].astype(np.uint64) << np.uint64(4 * i)
    return _as_int32(out)


def awq_unpack_oracle(words: torch.Tensor) -> np.ndarray:
    w = words.numpy().view(np.uint32).astype(np.uint64)
    rows, packed = w.shape
    out = np.zeros((rows, packed * 8), dtype=np.int64)
    for j in range(packed):
        for i in range(8):
            out[:, 8 * j + ORDER[i]] = (w[:, j] >> np.uint64(4 * i)) & np.uint64(15)
    return out


def gptq_pack_rows_oracle(q: np.ndarray) -> torch.Tensor:
    k, n = q.shape
    out = np.zeros((k // 8, n), dtype=np.uint64)
    for r in range(k // 8):
        for i in range(8):
            out[r] |= q[8 * r + i].astype(np.uint64) << np.uint64(4 * i)
    return _as_int32(out)


def gptq_pack_cols_oracle(z: np.ndarray) -> torch.Tensor:
    g, n = z.shape
    out = np.zeros((g, n // 8), dtype=np.uint64)
    for j in range(n // 8):
        for i in range(8):
            out[:, j] |= z[:, 8 * j + i].astype(np.uint64) << np.uint64(4 * i)
    return _as_int32(out)


def dequant_oracle(q: np.ndarray, z: np.ndarray, s: np.ndarray, group: int) -> torch.Tensor:
    """W [N, K] (nn.Linear orientation) in fp32 from q [K, N], z, s [K/g, N]."""
    zz = np.repeat(z, group, axis=0).astype(np.float64)
    ss = np.repeat(s.astype(np.float64), group, axis=0)
    return torch.from_numpy(((q.astype(np.float64) - zz) * ss).T.astype(np.float32).copy())


# ---------------------------------------------------------------------------------------------- builders
def _integers(shape_nk: tuple[int, int], group: int, rng: np.random.Generator, sym: bool = False,
              lowest_zero: int = 0):
    n, k = shape_nk
    q = rng.integers(0, 16, size=(k, n))
    z = np.full((k // group, n), 8) if sym else rng.integers(lowest_zero, 16, size=(k // group, n))
    s = (rng.uniform(0.5, 2.0, size=(k // group, n)) * 2.0 ** rng.integers(-9, -3, size=(k // group, n))).astype(np.float16)
    return q, z, s


def write_quantized(dense: Path, out: Path, method: str, *, group: int = GROUP, sym: bool = False,
                    fmt: str = "gptq", quant_extra: dict | None = None, seed: int = 0) -> dict[str, tuple]:
    """A copy of ``dense`` whose decoder linears are 4-bit (AWQ or GPTQ) from known integers; returns
    checkpoint prefix -> (q, z, s)."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    with safe_open(str(dense / "model.safetensors"), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    truth = {}
    for key in list(tensors):
        prefix = key.removesuffix(".weight")
        if not (key.startswith("model.layers.") and prefix.endswith(LINEARS)):
            continue
        n, k = tensors.pop(key).shape
        # a GPTQ v1 zero of 0 is stored as -1 (AutoGPTQ's overflow, refused when read): v1 zeros are 1..15
        q, z, s = _integers((n, k), group, rng, sym, lowest_zero=1 if (method, fmt) == ("gptq", "gptq") else 0)
        truth[prefix] = (q, z, s)
        tensors[f"{prefix}.scales"] = torch.from_numpy(s)
        if method == "awq":
            tensors[f"{prefix}.qweight"] = awq_pack_oracle(q)
            tensors[f"{prefix}.qzeros"] = awq_pack_oracle(z)
        else:
            tensors[f"{prefix}.qweight"] = gptq_pack_rows_oracle(q)
            tensors[f"{prefix}.qzeros"] = gptq_pack_cols_oracle(z - 1 if fmt == "gptq" else z)
            tensors[f"{prefix}.g_idx"] = torch.arange(k, dtype=torch.int32) // group
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    if method == "awq":
        quant = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                 "modules_to_not_convert": ["visual"]}
    else:
        quant = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": sym,
                 "checkpoint_format": fmt}
    config["quantization_config"] = {**quant, **(quant_extra or {})}
    (out / "config.json").write_text(json.dumps(config))
    shutil.copyfile(dense / "generation_config.json", out / "generation_config.json")
    return truth


def assert_loaded_equals_oracle(model, truth: dict, group: int = GROUP) -> None:
    modules = dict(model.language.named_modules())
    assert len(truth) == 2 * len(LINEARS)
    for prefix, (q, z, s) in truth.items():
        module = modules[prefix.replace("model.", "", 1)]
        assert isinstance(module, Int4Linear)
        assert torch.equal(module.dequantized_weight(torch.float32), dequant_oracle(q, z, s, group)), prefix
