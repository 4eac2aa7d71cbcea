"""``model.vision_mlp_width`` (edgekv/model/vision.py pad_mlp_width): the vision tower's MLPs zero-padded to an
aligned width compute the same tower — on the CPU the padded and loaded towers agree to fp32 rounding, a stream
through a padded runtime keeps the same cache and answers — and "auto" pads only on CUDA. On a GPU: the 3B
width (3,420) padded to 3,424 in bf16 against the loaded one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgekv.model.language import GatedMLP
from edgekv.model.vision import pad_mlp_width

CUDA = torch.cuda.is_available()


def _mlp(dim: int, width: int, seed: int = 0, **kw) -> GatedMLP:
    torch.manual_seed(seed)
    return GatedMLP(dim, width, "silu", bias=True).to(**kw)


@pytest.mark.parametrize("width, multiple, padded", [(3420, 8, 3424), (84, 8, 88), (80, 8, 80), (5, 64, 64)])
def test_a_padded_mlp_is_the_same_mlp(width, multiple, padded):
    mlp = _mlp(24, width, dtype=torch.float64)
    x = torch.randn(10, 24, dtype=torch.float64)
    before = mlp(x)
    loaded = {name: p.clone() for name, p in mlp.named_parameters()}
    assert pad_mlp_width(mlp, multiple) == padded
    assert mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (padded, 24)
    assert mlp.gate_proj.bias.shape == mlp.up_proj.bias.shape == (padded,)
    assert mlp.down_proj.weight.shape == (24, padded) and mlp.down_proj.bias.shape == (24,)
    torch.testing.assert_close(mlp(x), before, rtol=0, atol=1e-12)
    # The loaded weights are kept as they were; what was added is zeros.
    for name in ("gate_proj", "up_proj"):
        layer = getattr(mlp, name)
        assert torch.equal(layer.weight[:width], loaded[f"{name}.weight"])
        assert torch.equal(layer.bias[:width], loaded[f"{name}.bias"])
        assert not layer.weight[width:].any() and not layer.bias[width:].any()
    assert torch.equal(mlp.down_proj.weight[:, :width], loaded["down_proj.weight"])
    assert not mlp.down_proj.weight[:, width:].any()


def test_padding_keeps_dtype_and_frozen_weights_frozen():
    mlp = _mlp(16, 84, dtype=torch.bfloat16).requires_grad_(False)
    assert pad_mlp_width(mlp, 8) == 88
    for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        assert layer.weight.dtype is torch.bfloat16 and not layer.weight.requires_grad
    assert pad_mlp_width(mlp, 8) == 88  # already aligned: nothing changes
    with pytest.raises(ValueError, match="multiple must be at least 1"):
        pad_mlp_width(mlp, 0)


def _runtime(checkpoint, **model):
    import edgekv

    return edgekv.Runtime.from_pretrained(checkpoint, model={"device": "cpu", "dtype": "fp32", **model},
                                          video={"resolution": [112, 112], "fps": 2},
                                          cache={"policy": "statekv", "sinks": 32, "max_tokens": 320,
                                                 "text_reserve_tokens": 64})


def test_auto_keeps_the_loaded_width_on_the_cpu(tiny_checkpoint):
    runtime = _runtime(tiny_checkpoint)
    width = runtime.model.visual.config.intermediate_size
    assert runtime.vision_mlp_width == width
    assert all(block.mlp.gate_proj.out_features == width for block in runtime.model.visual.blocks)
    assert runtime.session().stats()["vision_mlp_width"] == width


def test_a_stream_through_a_padded_tower_keeps_the_cache_and_answers(tiny_checkpoint, monkeypatch):
    """The tiny tower's width (128) is aligned to 8; to pad it, the multiple is raised to 48 (-> 144). A stream of
    30 pairs through both runtimes, compressions included, leaves the same cache to fp32 rounding and the same
    answer tokens."""
    import edgekv.runtime as runtime_module

    monkeypatch.setattr(runtime_module, "VISION_MLP_MULTIPLE", 48)
    loaded, padded = _runtime(tiny_checkpoint, vision_mlp_width="as_loaded"), _runtime(tiny_checkpoint,
                                                                                       vision_mlp_width="padded")
    assert loaded.vision_mlp_width == 128 and padded.vision_mlp_width == 144
    sessions = [loaded.session(), padded.session()]
    rng = np.random.default_rng(0)
    for i in range(60):
        frame = rng.integers(0, 255, (112, 112, 3), dtype=np.uint8)
        for session in sessions:
            session.ingest(frame, t=i * 0.5)
    a, b = (s.cache for s in sessions)
    assert a.length == b.length and sessions[0].stats()["compressions"] > 0
    for name in ("kind", "sink", "frame", "tpos"):
        assert torch.equal(getattr(a, name)[:, :, : a.length], getattr(b, name)[:, :, : b.length]), name
    for name in ("k", "v"):
        torch.testing.assert_close(getattr(a, name)[:, :, : a.length], getattr(b, name)[:, :, : b.length],
                                   rtol=1e-4, atol=1e-5)
    answers = [s.ask("What happened?", max_new_tokens=6).token_ids for s in sessions]
    assert answers[0] == answers[1]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_3b_width_padded_on_a_gpu_is_the_same_mlp_in_bf16():
    """The 3B's ViT MLP (1,280 -> 3,420 -> 1,280) padded to 3,424 on CUDA in bf16: within bf16 rounding of the
    loaded one over the 1,024 patches of a 448x448 pair (the products' summation order differs)."""
    mlp = _mlp(1280, 3420, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1024, 1280, device="cuda", dtype=torch.bfloat16)
    reference = _mlp(1280, 3420, device="cuda", dtype=torch.float64)(x.double())
    before = mlp(x)
    assert pad_mlp_width(mlp, 8) == 3424
    after = mlp(x)
    # Each against the fp64 MLP of the same weights: the padded product is as close as the loaded one.
    err_before = (before.double() - reference).abs().max().item()
    err_after = (after.double() - reference).abs().max().item()
    assert err_after <= 2 * err_before + 1e-6, (err_before, err_after)
