"""``train-toy --reshape-heads H:KV`` (issue 27): a trained toy's LM attention cut into fewer, wider heads and made
new — the rest of the toy copied, ``o_proj`` zero so that at step 0 no attention enters the residual stream — with
the teacher of ``--distill-logits`` the toy as it was. Checked: the config is a toy's of those heads (head_dim and
M-RoPE sections as ``toy_config`` scales them), every weight outside attention is the original's, the model
computes what the original computes with its attention branches removed, a round trains the new attention and
writes a toy of this version (a later round goes on from it), and bad requests are refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from edgekv.toy.data import REFINE, draw_sample
from edgekv.toy.model import MAX_POSITIONS, init_model, reshape_heads, save_checkpoint, toy_config
from edgekv.toy.train import Encoder, forward_logits

SMALL = dict(width=64, layers=2, vision_width=32, vision_depth=2)


def _trained_looking(seed: int):
    model = init_model(toy_config(**SMALL), seed)
    with torch.no_grad():  # non-zero everywhere, so a weight copied to the wrong place shows
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def test_toy_config_takes_heads_and_refuses_what_does_not_divide():
    config = toy_config(**SMALL, heads=2, kv_heads=2)
    assert (config.text.num_attention_heads, config.text.num_key_value_heads, config.text.head_dim) == (2, 2, 32)
    assert tuple(config.text.mrope_section) == (4, 6, 6)  # 16 pairs: 6 of them in the width section
    assert tuple(toy_config(**SMALL, heads=1, kv_heads=1).text.mrope_section) == (8, 12, 12)
    assert toy_config(**SMALL) == toy_config(**SMALL, heads=4, kv_heads=2)  # the shipped shape by default
    for heads, kv in ((3, 1), (4, 3), (32, 2), (0, 1)):
        with pytest.raises(ValueError, match="toy LM heads"):
            toy_config(**SMALL, heads=heads, kv_heads=kv)


def test_reshape_heads_keeps_everything_but_attention():
    start = _trained_looking(3)
    wide = reshape_heads(start, 2, 1, seed=4)
    assert wide.config == toy_config(**SMALL, heads=2, kv_heads=1)
    old, new = start.state_dict(), wide.state_dict()
    for name, value in new.items():
        if ".self_attn." not in name:
            torch.testing.assert_close(value, old[name], rtol=0, atol=0)
        elif ".o_proj." in name or name.endswith(".bias"):
            assert not value.any(), name
        else:
            assert value.std() == pytest.approx(0.02, rel=0.3), name  # drawn anew
    assert new["language.layers.0.self_attn.k_proj.weight"].shape == (32, 64)  # one KV head of 32
    # at step 0 the attention branches add nothing: the original with its o_proj zeroed computes the same
    batch = Encoder().encode([draw_sample(np.random.default_rng(0), REFINE[0][1], MAX_POSITIONS) for _ in range(2)])
    with torch.no_grad():
        for layer in start.language.layers:
            layer.self_attn.o_proj.weight.zero_()
        torch.testing.assert_close(forward_logits(wide, batch), forward_logits(start, batch), rtol=0, atol=1e-6)
    assert reshape_heads(start, 2, 1, seed=4).state_dict()["language.layers.1.self_attn.q_proj.weight"].equal(
        new["language.layers.1.self_attn.q_proj.weight"])  # the seed decides the draw


def test_a_reshaped_round_trains_the_new_attention_and_is_a_toy(tmp_path, capsys):
    from edgekv.apps.cli import main
    from edgekv.model.loading import load_pretrained
    from edgekv.toy.train import _from_checkpoint

    path = save_checkpoint(_trained_looking(5), tmp_path / "start", {"note": "test"})
    common = ["--steps", "2", "--batch-size", "2", "--log-every", "2", "--heldout-streams", "0", "--eval-samples",
              "2", "--vision-steps", "0", "--threads", "1", "--curriculum", "refine", "--no-prefetch", "--lr", "0.01"]
    out = tmp_path / "wide"
    assert main(["train-toy", str(out), "--init", str(path), "--reshape-heads", "2:2", "--distill-logits", "1",
                 "--distill-layers", "1", *common]) == 0
    card = json.loads((out / "card.json").read_text())
    assert (card["heads"], card["kv_heads"], card["reshaped_heads"]) == (2, 2, [2, 2])
    assert "--distill-logits 1" in card["command"] and card["command"].endswith("--reshape-heads 2:2")
    trained = load_pretrained(out, dtype=torch.float32)
    assert trained.config.text.head_dim == 32 and all(layer.self_attn.o_proj.weight.any()
                                                      for layer in trained.language.layers)  # attention trained
    assert _from_checkpoint(out)[0].config.text.num_attention_heads == 2  # a toy of this version
    assert main(["train-toy", str(tmp_path / "on"), "--init", str(out), *common]) == 0  # a round goes on from it
    assert json.loads((tmp_path / "on" / "config.json").read_text())["num_attention_heads"] == 2
    capsys.readouterr()
    for bad, said in ((["--reshape-heads", "2:2"], "without --init"),
                      (["--init", str(path), "--reshape-heads", "two"], "two positive integers"),
                      (["--init", str(path), "--reshape-heads", "2:2", "--distill-weight", "1"], "--distill-weight")):
        assert main(["train-toy", str(tmp_path / "x"), *bad]) == 2
        assert said in capsys.readouterr().out
