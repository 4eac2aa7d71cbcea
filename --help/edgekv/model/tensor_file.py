"""Read a safetensors file tensor by tensor into memory the model owns, without a memory map.

Why not ``safetensors.safe_open``: it maps the whole file, and every page a read touches stays resident —
counted in the process's RSS — until the handle closes. Loading a 2 GB shard of a 4-bit 3B checkpoint that
way held the shard's pages and the copies made from them at once: the 3B load peaked 1.2 GiB above the
model it produced (VmHWM 4.64 GiB for 3.47 GiB resident after; issue 29's RSS figures), and on an 8 GB Orin
Nano the peak, not the steady state, decides whether the model starts. Here each tensor is read with
``readinto`` straight into a tensor allocated in its final dtype and device (the file's pages stay in the
page cache, which is not the process's and which the kernel reclaims), and a tensor stored in another dtype
is converted through a bounded scratch buffer (:data:`CONVERT_BLOCK_BYTES`), so the load's peak is the model
plus that buffer.

The format (https://github.com/huggingface/safetensors, "Format"): 8 bytes little-endian header length N,
N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then
the data; offsets are relative to the data's start, tensors are C-contiguous little-endian.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import torch

from edgekv.hostmem import weight_empty

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
CONVERT_BLOCK_BYTES = 32 << 20  # stored bytes converted a block at a time (a 622 MB fp32 embedding: 20 blocks)


class TensorFileError(ValueError):
    """A safetensors file that cannot be read as its header says; ``tensor`` names the tensor, when one."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


class TensorFile:
    """One safetensors file: its header checked against its size on open, tensors read on demand.

    ``names`` in the order of their bytes in the file (reading in that order reads the file front to back)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        self._file = open(self.path, "rb", buffering=0)
        try:
            self._header = self._read_header(size)
        except BaseException:
            self._file.close()
            raise

    def _read_header(self, size: int) -> dict:
        head = self._file.read(8)
        if len(head) < 8:
            raise TensorFileError(f"{self.path}: truncated safetensors file ({size} bytes, no header)")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise TensorFileError(f"{self.path}: corrupt or truncated safetensors header (header says {length} "
                                  f"bytes, file has {size - 8} after the length)")
        try:
            header = json.loads(self._file.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TensorFileError(f"{self.path}: corrupt safetensors header ({exc})") from exc
        if not isinstance(header, dict):
            raise TensorFileError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self._data_start = 8 + length
        data_size = size - self._data_start
        for name, entry in header.items():
            try:
                begin, end = (int(v) for v in entry["data_offsets"])
                shape = tuple(int(d) for d in entry["shape"])
                stored = entry["dtype"]
            except (KeyError, TypeError, ValueError) as exc:
                raise TensorFileError(f"{self.path}: tensor {name}: malformed header entry {entry!r}", name) from exc
            if stored not in DTYPES:
                raise TensorFileError(f"{self.path}: tensor {name}: dtype {stored} is not one this loader reads "
                                      f"(known: {', '.join(DTYPES)})", name)
            expected = math.prod(shape) * DTYPES[stored].itemsize
            if begin < 0 or end - begin != expected or any(d < 0 for d in shape):
                raise TensorFileError(f"{self.path}: tensor {name}: data_offsets [{begin}, {end}] hold {end - begin} "
                                      f"bytes; a {stored} tensor of shape {list(shape)} needs {expected}", name)
        # a file cut short keeps a valid header: name the first tensor whose bytes run past the end
        for name in sorted(header, key=lambda n: header[n]["data_offsets"][1]):
            begin, end = header[name]["data_offsets"]
            if end > data_size:
                raise TensorFileError(f"{self.path}: truncated safetensors file: tensor {name} needs bytes "
                                      f"{begin}..{end} of the data section, which has {data_size}", name)
        return header

    @property
    def names(self) -> list[str]:
        return sorted(self._header, key=lambda n: self._header[n]["data_offsets"][0])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self._header[name]["dtype"]]

    def read(self, name: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """Tensor ``name`` in ``dtype`` (default: as stored) on ``device``: a fresh tensor no file backs."""
        entry = self._header[name]
        stored, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        dtype = stored if dtype is None else dtype
        device = torch.device(device)
        offset = self._data_start + entry["data_offsets"][0]
        out = weight_empty(shape, dtype) if device.type == "cpu" else torch.empty(shape, dtype=dtype, device=device)
        if out.numel() == 0:
            return out
        if dtype == stored and device.type == "cpu":
            self._read_into(_bytes_of(out), offset, name)
            return out
        flat = out.view(-1)
        step = max(1, CONVERT_BLOCK_BYTES // stored.itemsize)
        scratch = torch.empty(min(step, flat.numel()), dtype=stored)
        for start in range(0, flat.numel(), step):
            count = min(step, flat.numel() - start)
            block = scratch[:count]
            self._read_into(_bytes_of(block), offset + start * stored.itemsize, name)
            flat[start:start + count].copy_(block)
        return out

    def _read_into(self, buffer: memoryview, offset: int, name: str) -> None:
        self._file.seek(offset)
        done = 0
        while done < len(buffer):
            got = self._file.readinto(buffer[done:])
            if not got:
                raise TensorFileError(f"{self.path}: tensor {name}: the file ended {len(buffer) - done} bytes short "
                                      f"of it (was it cut or rewritten while loading?)", name)
            done += got

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, in the host's order (safetensors stores little-endian)."""
    if sys.byteorder != "little":
        raise TensorFileError("safetensors files are little-endian; this host is big-endian")
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())
