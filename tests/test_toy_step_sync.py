"""The toy's training step never makes the host wait for the GPU (issues 27 and 32).

A GPU toy step that reads a device value on the host — ``.item()``, ``.any()`` in a condition, a boolean mask
indexing a device tensor — waits there for every kernel queued before it, so the host (launching ~1,000 kernels
a step from Python) and the GPU take turns instead of overlapping: the step's profile on an H200 (2026-12-04,
tools/gpu/toy_step_profile.py) found ~25 such waits a step, and wall 100 ms against 53 ms of device time at batch
32. These tests run the step on PyTorch's ``meta`` device, whose tensors hold no values: any read of one on the
host raises there, so a wait that comes back fails them. Which rows a term reads is decided from the batch's host
copy (``Batch.host``), which the meta batch keeps, as the CUDA one does.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from edgekv.toy.model import init_model, toy_config
from edgekv.toy.train import (AVOID_LAYERS, Encoder, distill_terms, forward_logits, loss_of, probe_loss, qa_batches,
                              vision_batches)

FAMILIES = ("noise", "checks")


def lured_batch():
    """A batch of the lured round (``world-lures-free-dilute``) with every mark the round's terms read."""
    return next(qa_batches(np.random.default_rng(4), 1, 4, True, 5, curriculum="world-lures-free-dilute",
                           families=FAMILIES, mark_lures=True))


def test_batch_to_a_device_keeps_its_host_copy():
    batch = lured_batch()
    moved = batch.to("meta")
    assert moved.host is batch and moved.ids.device.type == "meta" and moved.grid_thw.device.type == "cpu"
    assert moved.to("meta").host is batch  # moved twice: still the batch as drawn
    assert batch.to("cpu") is batch and batch.host is None


def test_the_lured_round_step_reads_nothing_from_the_device():
    """Forward with every term the rounds use (the answer and auxiliary losses with hard negatives, the steering
    and avoid terms with ``avoid_among="needles"``, the teacher's hidden-lure look and both distillation terms),
    then backward: all on meta tensors."""
    batch = lured_batch()
    assert batch.attend_rows is not None and batch.avoid_rows is not None and batch.lure_keys is not None
    model = init_model(toy_config(), 0)
    teacher = copy.deepcopy(model).to("meta").requires_grad_(False)
    model = model.to("meta").train()
    moved = batch.to("meta")
    no = Encoder(aux=True).no
    steered, avoided, looked, taught = [], [], {}, {}
    logits = forward_logits(model, moved, attention_loss=steered, avoid_loss=avoided, avoid_among="needles",
                            looks=looked)
    with torch.no_grad():
        teacher_logits = forward_logits(teacher, moved, hide_lures=AVOID_LAYERS, looks=taught)
    loss, answer, auxiliary = loss_of(logits, moved, 0.5, no, hard_negatives=0.05)
    attention, answers = distill_terms(looked, taught, logits, teacher_logits, moved)
    assert steered and avoided and sorted(looked) == list(AVOID_LAYERS)
    total = loss + 3 * attention + answers + steered[0] + torch.stack(avoided).mean()
    total.backward()
    assert {t.device.type for t in (logits, answer, auxiliary, total)} == {"meta"}
    assert not answer.requires_grad and not auxiliary.requires_grad  # the logged terms keep no graph
    assert all(p.grad is not None for p in model.language.parameters())


@pytest.mark.parametrize("among", ["all", "video"])
def test_the_avoid_term_reads_nothing_from_the_device_either_way(among):
    model = init_model(toy_config(), 0).to("meta")
    avoided: list = []
    forward_logits(model, lured_batch().to("meta"), avoid_loss=avoided, avoid_among=among)
    assert avoided and avoided[0].device.type == "meta"


def test_the_vision_warm_up_step_reads_nothing_from_the_device():
    """The warm-up's probe loss chooses its tokens from the labels on the host."""
    pixels, grid, shape, color = next(vision_batches(np.random.default_rng(0), 1, 4, FAMILIES))
    model = init_model(toy_config(), 0).to("meta")
    width = model.config.vision.out_hidden_size
    probes = torch.nn.Linear(width, 5).to("meta"), torch.nn.Linear(width, 7).to("meta")
    tokens = model.visual(pixels.to("meta"), grid)
    loss = probe_loss(*probes, tokens, shape, color)
    loss.backward()
    assert loss.device.type == "meta" and probes[0].weight.grad is not None


def test_tf32_products_on_a_gpu_only_and_only_for_the_block(capsys):
    """``train-toy --device cuda`` trains with TF32 products (the profile found fp32 FFMA kernels, the tensor cores
    idle) unless ``--fp32-products``; the flags are torch's process-wide ones, restored after."""
    from edgekv.apps.cli import main
    from edgekv.toy.train import tf32_products

    flags = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)  # noqa: E731
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with tf32_products("cuda"):
            assert flags() == (True, True)
        assert flags() == (False, False)
        for device, enabled in (("cuda", False), ("cpu", True)):
            with tf32_products(device, enabled):
                assert flags() == (False, False)
    finally:
        torch.backends.cudnn.allow_tf32 = True  # torch's default
    capsys.readouterr()
    assert main(["train-toy", "/tmp/never-written", "--fp32-products", "--hard-negatives", "2"]) == 2
    said = capsys.readouterr()
    assert "hard-negatives" in said.out + said.err and "unrecognized" not in said.err  # the flag parsed
