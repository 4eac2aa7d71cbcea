"""edgekv.model.tensor_file: safetensors read without a memory map, tensor by tensor (issue 29, load peak).

The reference is the safetensors package's own writer and reader."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from edgekv.model import load_pretrained, tensor_file
from edgekv.model.tensor_file import TensorFile, TensorFileError
from edgekv.model.tiny import make_tiny_checkpoint


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {
        "f32": torch.randn(7, 5, generator=g),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "bf16": torch.randn(4, 33, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 3, 4, generator=g).to(torch.float16),
        "i32": torch.randint(-2**31, 2**31 - 1, (9, 2), generator=g, dtype=torch.int32),
        "i64": torch.randint(-2**40, 2**40, (5,), generator=g, dtype=torch.int64),
        "i16": torch.randint(-2**15, 2**15 - 1, (6,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (11,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (3, 3), generator=g, dtype=torch.uint8),
        "bool": torch.rand(10, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    if hasattr(torch, "float8_e4m3fn"):
        out["f8"] = torch.randn(8, generator=g).to(torch.float8_e4m3fn)
    return out


def test_every_dtype_reads_bit_exact_against_safetensors(tmp_path):
    tensors = _tensors()
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    with TensorFile(path) as handle, safe_open(str(path), framework="pt") as reference:
        assert sorted(handle.names) == sorted(tensors)
        offsets = [json.loads(path.read_bytes()[8:8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])[n]
                   ["data_offsets"][0] for n in handle.names]
        assert offsets == sorted(offsets)  # names come in file order: a load reads front to back
        for name in tensors:
            got = handle.read(name)
            want = reference.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert handle.shape(name) == tuple(want.shape) and handle.dtype(name) == want.dtype
            assert torch.equal(got.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("block", [4, 40, 1 << 20])
@pytest.mark.parametrize("stored,target", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                           (torch.float16, torch.float32), (torch.float32, torch.float16)], ids=str)
def test_conversion_through_blocks_equals_one_conversion(tmp_path, monkeypatch, block, stored, target):
    """A tensor stored in another dtype goes through a bounded buffer (4 and 40 bytes: blocks that split rows
    and one element at a time); the result is the same bits as converting the whole tensor at once."""
    monkeypatch.setattr(tensor_file, "CONVERT_BLOCK_BYTES", block)
    x = (torch.randn(13, 37, generator=torch.Generator().manual_seed(1)) * 100).to(stored)
    path = tmp_path / "x.safetensors"
    save_file({"x": x}, str(path))
    with TensorFile(path) as handle:
        got = handle.read("x", target)
    assert got.dtype == target and torch.equal(got, x.to(target))


def _write_raw(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("header,data,words", [
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 10,
     ["truncated safetensors file", "tensor a needs bytes 0..16", "which has 10"]),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16,
     ["tensor a", "[0, 12] hold 12 bytes", "F32 tensor of shape [4] needs 16"]),
    ({"a": {"dtype": "U4", "shape": [4], "data_offsets": [0, 2]}}, b"\0" * 2,
     ["tensor a", "dtype U4 is not one this loader reads"]),
    ({"a": {"dtype": "F32", "shape": [4]}}, b"\0" * 16, ["tensor a", "malformed header entry"]),
    ([1, 2], b"", ["not a JSON object"]),
], ids=["cut", "offsets", "dtype", "entry", "array"])
def test_bad_files_are_refused_naming_the_tensor(tmp_path, header, data, words):
    path = tmp_path / "bad.safetensors"
    _write_raw(path, header, data)
    with pytest.raises(TensorFileError) as err:
        TensorFile(path)
    message = str(err.value)
    assert str(path) in message and all(w in message for w in words), message


def test_a_file_cut_after_opening_is_named_not_read_as_zeros(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.ones(64), "b": torch.ones(64)}, str(path))
    with TensorFile(path) as handle:
        with open(path, "r+b") as f:  # another process truncates the file under the loader
            f.truncate(path.stat().st_size - 100)
        assert torch.equal(handle.read(handle.names[0]), torch.ones(64))
        with pytest.raises(TensorFileError, match=r"tensor b: the file ended 100 bytes short"):
            handle.read(handle.names[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_loaded_model_maps_no_checkpoint_file(tmp_path, dtype):
    """Every weight is the model's own memory: no page of a weight file stays mapped into the process (a
    mapped file's touched pages count in its RSS: the 3B load peaked 1.2 GiB above the model that way)."""
    source = make_tiny_checkpoint(tmp_path / "ckpt", preset="test-gqa4", seed=4)
    model = load_pretrained(source, dtype=dtype)
    maps = Path("/proc/self/maps").read_text()
    assert ".safetensors" not in maps
    with safe_open(str(source / "model.safetensors"), framework="pt") as reference:
        embed = reference.get_tensor("model.embed_tokens.weight")
        assert str(source / "model.safetensors") in Path("/proc/self/maps").read_text()  # the check can see one
    assert torch.equal(model.language.embed_tokens.weight, embed.to(dtype))


def _vm_flags(address: int) -> list[str]:
    """VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            begin, end = (int(part, 16) for part in head.split("-"))
            inside = begin <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                    reason="needs Linux with transparent huge pages (/proc/self/smaps, /sys/kernel/mm/transparent_hugepage)")
def test_large_weights_are_advised_huge_pages_and_small_ones_are_plain(monkeypatch):
    from edgekv import hostmem

    if hostmem._glibc() is None:
        pytest.skip("weight_empty advises huge pages through glibc's madvise; this C library is not glibc")
    rows = hostmem.HUGE_MIN_BYTES // (4096 * 2)
    big = hostmem.weight_empty((rows, 4096), torch.bfloat16)  # the smallest that is advised (64 MiB)
    assert big.shape == (rows, 4096) and big.dtype == torch.bfloat16 and big.is_contiguous()
    assert big.data_ptr() % hostmem.HUGE_PAGE == 0
    big.fill_(1.5)
    assert float(big.float().sum()) == 1.5 * big.numel()
    assert "hg" in _vm_flags(big.data_ptr())  # madvise(MADV_HUGEPAGE) took: the kernel may back it with 2 MiB pages
    small = hostmem.weight_empty((rows - 1, 4096), torch.bfloat16)  # one row short: a plain tensor
    assert small.shape == (rows - 1, 4096) and small.untyped_storage().nbytes() == small.numel() * 2
    monkeypatch.setattr(hostmem, "huge_pages", False)  # EDGEKV_HUGE_PAGES=0
    plain = hostmem.weight_empty((rows, 4096), torch.bfloat16)
    assert plain.untyped_storage().nbytes() == plain.numel() * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_loading_onto_the_gpu_equals_loading_on_the_host(tmp_path, monkeypatch, dtype):
    """Tensors go to the device in blocks through a small host buffer (no whole host copy first): a block smaller
    than most tensors here, so the loop runs; the weights are the host load's, moved."""
    monkeypatch.setattr(tensor_file, "CONVERT_BLOCK_BYTES", 4096)
    source = make_tiny_checkpoint(tmp_path / "ckpt", preset="test-gqa4", seed=5)
    host = load_pretrained(source, dtype=dtype)
    device = load_pretrained(source, dtype=dtype, device="cuda")
    for (name, a), (_, b) in zip(host.state_dict().items(), device.state_dict().items()):
        assert b.device.type == "cuda" and torch.equal(a, b.cpu()), name
