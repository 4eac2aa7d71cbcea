"""``edgekv quantize`` and 4-bit loading as an Orin Nano owner meets them: source weights the 4-bit format cannot
hold, a config.json that disagrees with its tensors, checkpoints that are already 4-bit, damaged scales, a killed
run's leftovers, a float checkpoint in the way, and checkpoints written by transformers' own ``save_pretrained``.

Each refusal must name the file and the tensor (or the argument), exit 2 from the command line, and leave OUT_DIR
as it was, with no hidden partial folder beside it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_checkpoints import rewrite_safetensors

from edgekv.apps.cli import main
from edgekv.calibration.quantize import dequantize_checkpoint, quantize_checkpoint, quantize_weight
from edgekv.model import CheckpointError, load_pretrained
from edgekv.model.int4 import Int4Linear, dequantize
from edgekv.model.language import dense_causal_attend
from edgekv.model.rope import text_position_ids
from edgekv.model.tiny import make_tiny_checkpoint

LINEAR = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dense") / "ckpt", preset="test-gqa4", seed=4)


@pytest.fixture
def copy(dense, tmp_path) -> Path:
    return Path(shutil.copytree(dense, tmp_path / "src"))


@pytest.fixture(scope="module")
def quantized(dense, tmp_path_factory) -> Path:
    return quantize_checkpoint(dense, tmp_path_factory.mktemp("q4") / "q4", group_size=16)


def _refused(capsys, args: list[str], *needles: str) -> str:
    assert main(["quantize", *args]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    return err


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# ---------------------------------------------------------------------------------------------- the quantizer
def _reference(weight: torch.Tensor, group: int) -> torch.Tensor:
    """The docstring's formulas in float64 (the scale rounded to float16, as stored): W as the 4-bit copy holds it."""
    n, k = weight.shape
    w = weight.double().reshape(n, k // group, group)
    low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    s = ((high - low).clamp(min=1e-5) / 15).half().double()
    z = (-torch.round(low / s)).clamp(0, 15)
    q = (torch.round(w / s[..., None]) + z[..., None]).clamp(0, 15)
    return ((q - z[..., None]) * s[..., None]).reshape(n, k)


@pytest.mark.parametrize("case", ["normal", "zero", "constant", "negative", "tiny", "large", "k_is_group"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_round_trip_is_the_documented_formula_at_odd_groups(case, dtype):
    gen = torch.Generator().manual_seed(0)
    n, k, group = 24, 96, 32
    weight = {"normal": torch.randn(n, k, generator=gen) * 0.05, "zero": torch.zeros(n, k),
              "constant": torch.full((n, k), 0.3), "negative": torch.full((n, k), -0.3),
              "tiny": torch.randn(n, k, generator=gen) * 1e-7, "large": torch.randn(n, k, generator=gen) * 1e4,
              "k_is_group": torch.randn(n, k, generator=gen)}[case].to(dtype)
    group = k if case == "k_is_group" else group
    q, zeros, scales = quantize_weight(weight, group)
    back = dequantize(q, zeros, scales, group).t().double()
    assert torch.equal(back, _reference(weight.float(), group))
    assert bool(torch.isfinite(back).all())
    if case == "zero":
        assert not bool(back.any())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nonfinite_weight_is_refused_by_position(bad):
    """It was quantized silently: its group's scale became nan, and the whole group of every such row came back
    nan from the 4-bit checkpoint (the logits nan on the first token)."""
    weight = torch.randn(8, 64)
    weight[5, 40] = bad
    with pytest.raises(ValueError, match=r"layer\.x: 1 weight\(s\) are inf or nan \(first at \[5, 40\]\)"):
        quantize_weight(weight, 32, "layer.x")


def test_a_group_wider_than_float16_scales_reach_is_refused():
    """A span past 15 x 65504: the float16 scale overflowed to inf, and (q - z) * inf came back nan."""
    weight = torch.randn(4, 64) * 0.01
    weight[2, 33] = 1.2e6
    with pytest.raises(ValueError, match=r"row 2, inputs 32\.\.63 span 1\.2e\+06"):
        quantize_weight(weight, 32)
    weight[2, 33] = 9.0e5  # 15 steps of a finite scale still reach it
    q, zeros, scales = quantize_weight(weight, 32)
    assert bool(torch.isfinite(dequantize(q, zeros, scales, 32)).all())


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_cli_refuses_a_nonfinite_source_weight_naming_file_and_tensor(copy, tmp_path, capsys, method):
    """``--method awq`` reads the weights before its calibration run, so the refusal comes before minutes of it."""
    rewrite_safetensors(copy / "model.safetensors", lambda t: t[LINEAR].__setitem__((3, 7), float("nan")))
    _refused(capsys, [str(copy), str(tmp_path / "out"), "--group-size", "16", "--method", method],
             f"{copy / 'model.safetensors'}: tensor {LINEAR}: 1 weight(s) are inf or nan (first at [3, 7])")
    assert not (tmp_path / "out").exists() and _hidden(tmp_path) == []


def test_an_unquantized_tensor_past_float16_is_refused_unless_kept_wider(copy, tmp_path, capsys):
    """A bf16 / fp32 norm or embedding value past 65504 was written as inf in the default fp16 output."""
    norm = "model.layers.0.input_layernorm.weight"
    rewrite_safetensors(copy / "model.safetensors", lambda t: t[norm].__setitem__(2, 1.0e5))
    _refused(capsys, [str(copy), str(tmp_path / "out"), "--group-size", "16"],
             f"tensor {norm}: 1 value(s) (first at [2]: 100000) do not fit float16", "--dtype bf16")
    assert not (tmp_path / "out").exists()
    assert main(["quantize", str(copy), str(tmp_path / "out"), "--group-size", "16", "--dtype", "bf16"]) == 0
    model = load_pretrained(tmp_path / "out")
    assert float(model.language.layers[0].input_layernorm.weight[2]) == float(torch.tensor(1.0e5).bfloat16())


# ---------------------------------------------------------------------------------------------- the input checkpoint
def test_a_config_that_disagrees_with_the_tensors_is_refused_before_writing(copy, tmp_path, capsys):
    """It used to be written out whole (exit 0): a 4-bit checkpoint whose shapes the loader then refused, naming the
    output folder rather than the source that was wrong."""
    config = json.loads((copy / "config.json").read_text())
    config["intermediate_size"] += 16
    (copy / "config.json").write_text(json.dumps(config))
    _refused(capsys, [str(copy), str(tmp_path / "out"), "--group-size", "16"],
             "IN_DIR: ", "model.safetensors: tensor model.layers.0.mlp.down_proj.weight: config.json implies shape "
             f"[128, {config['intermediate_size']}], found [128, {config['intermediate_size'] - 16}]")
    assert not (tmp_path / "out").exists()


def test_already_4bit_tensors_or_a_nested_quantization_config_are_refused(quantized, tmp_path, capsys):
    stripped = Path(shutil.copytree(quantized, tmp_path / "stripped"))
    config = json.loads((stripped / "config.json").read_text())
    del config["quantization_config"]
    (stripped / "config.json").write_text(json.dumps(config))
    _refused(capsys, [str(stripped), str(tmp_path / "out")], "already quantized", ".qweight")
    nested = Path(shutil.copytree(quantized, tmp_path / "nested"))
    config["text_config"] = {"quantization_config": json.loads((quantized / "config.json").read_text())[
        "quantization_config"]}
    (nested / "config.json").write_text(json.dumps(config))
    _refused(capsys, [str(nested), str(tmp_path / "out")], "already quantized (config.json has a quantization_config)")
    assert not (tmp_path / "out").exists()


def test_a_file_given_as_in_dir_is_named_as_not_a_directory(dense, tmp_path, capsys):
    _refused(capsys, [str(dense / "model.safetensors"), str(tmp_path / "out")],
             "model.safetensors: not a directory (give the checkpoint's folder)")


# ---------------------------------------------------------------------------------------------- the output folder
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_shard_size_that_is_no_number_of_gb_is_refused(dense, tmp_path, capsys, value):
    """--max-shard-gb inf was an OverflowError's traceback; nan was 'cannot convert float NaN to integer'."""
    _refused(capsys, [str(dense), str(tmp_path / "out"), f"--max-shard-gb={value}"],
             "--max-shard-gb: must be > 0 and finite")
    assert not (tmp_path / "out").exists()


def test_a_float_checkpoint_in_out_dir_is_not_replaced(dense, copy, tmp_path, capsys):
    """OUT_DIR holding a floating-point checkpoint (another run's source, a slip of the command line) was deleted
    and replaced by the 4-bit one; an earlier 4-bit output there is still replaced."""
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    _refused(capsys, [str(dense), str(copy), "--group-size", "16"], f"OUT_DIR: {copy} holds a checkpoint that is "
             f"not 4-bit")
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before
    out = tmp_path / "q4"
    assert main(["quantize", str(dense), str(out), "--group-size", "16"]) == 0
    assert main(["quantize", str(dense), str(out), "--group-size", "32"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 32


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_runs_partial_folder_is_removed_by_the_next_run(dense, tmp_path):
    """A run killed mid-write (SIGKILL, power loss) left ``.OUT.partial-PID`` beside OUT_DIR; no later run removed
    it (each makes its own by its own pid): at 3B up to 2 GB of a Jetson's flash each, for good. A folder whose
    process is still alive (another conversion to the same place) is left alone."""
    out = tmp_path / "q4"
    dead, alive = tmp_path / f".q4.partial-{_dead_pid()}", tmp_path / ".q4.partial-1"
    old = tmp_path / f".q4.old-{_dead_pid()}"
    for folder in (dead, alive, old):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    quantize_checkpoint(dense, out, group_size=16)
    assert _hidden(tmp_path) == [alive.name]
    assert isinstance(load_pretrained(out).language.layers[0].mlp.up_proj, Int4Linear)


def test_a_full_disk_is_named_and_leaves_nothing(dense, small_disk, capsys):
    _refused(capsys, [str(dense), str(small_disk / "q4"), "--group-size", "16"], "No space left on device")
    assert list(small_disk.iterdir()) == []


# ---------------------------------------------------------------------------------------------- loading
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_scales_are_refused_naming_file_and_tensor(quantized, tmp_path, bad):
    """A flipped bit or an overflowed quantizer: the checkpoint loaded, and every weight of the group was nan."""
    damaged = Path(shutil.copytree(quantized, tmp_path / "damaged"))
    scales = "model.layers.0.self_attn.k_proj.scales"
    rewrite_safetensors(damaged / "model.safetensors", lambda t: t[scales].__setitem__((1, 5), bad))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor {scales}: 1 scale\(s\) are inf or nan "
                                              rf"\(first at \[1, 5\]\)") as caught:
        load_pretrained(damaged)
    assert caught.value.tensor == scales


# ---------------------------------------------------------------------------------------------- transformers' writer
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model.language(model.language.embed_tokens(ids), text_position_ids(0, ids.numel()),
                                dense_causal_attend)
        return model.language.logits(hidden)


@pytest.mark.parametrize("tied,shard", [(True, None), (False, "40KB")], ids=["tied", "untied-sharded"])
def test_a_save_pretrained_checkpoint_converts_twice_and_loads(tmp_path, tied, shard):
    """What an owner converts: transformers' own ``save_pretrained`` (its tensor names, nested text_config, shards
    and index), tied and untied heads; converting twice into one folder gives the same files."""
    transformers = pytest.importorskip("transformers")
    text = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=tied, bos_token_id=504, eos_token_id=505,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[0])
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied,
                                           image_token_id=500, video_token_id=501, vision_start_token_id=502,
                                           vision_end_token_id=503, bos_token_id=504, eos_token_id=505)
    torch.manual_seed(0)
    source = tmp_path / "hf"
    transformers.Qwen2_5_VLForConditionalGeneration(config).save_pretrained(
        source, **({} if shard is None else {"max_shard_size": shard}))
    assert (source / "model.safetensors.index.json").is_file() == (shard is not None)
    out = quantize_checkpoint(source, tmp_path / "q4", group_size=16)
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    quantize_checkpoint(source, out, group_size=16)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    model = load_pretrained(out)
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 14
    twin = load_pretrained(dequantize_checkpoint(out, tmp_path / "twin"))
    ids = torch.randint(0, 500, (16,), generator=torch.Generator().manual_seed(1))
    got, want = _logits(model, ids).double(), _logits(twin, ids).double()
    assert float((got - want).norm() / want.norm()) <= 1e-3
    assert _hidden(tmp_path) == []


# ---------------------------------------------------------------------------------------------- the shipped toy
@pytest.mark.slow
def test_the_shipped_toy_in_4_bits_answers_as_the_float_toy(tmp_path, capsys):
    """README (issue 29): ``edgekv quantize builtin:toy OUT --group-size 16`` answers as the float toy did. On the same
    16 held-out streams (deterministic seeds) every question family within one answer, all together within two
    (measured: count 13 of 16 against 14, the other families equal)."""
    out = tmp_path / "toy-q4"
    assert main(["quantize", "builtin:toy", str(out), "--group-size", "16"]) == 0
    correct = {}
    for model in ("builtin:toy", str(out)):
        report = tmp_path / f"{len(correct)}.json"
        assert main(["eval", "toy", "--model", model, "--streams", "16", "--families", "events",
                     "--json", str(report)]) == 0
        by_question = json.loads(report.read_text())["families"]["events"]["by_question"]
        correct[model] = {family: figures["correct"] for family, figures in by_question.items()}
    capsys.readouterr()
    floating, four_bit = correct["builtin:toy"], correct[str(out)]
    assert floating.keys() == four_bit.keys() and len(floating) == 5
    assert all(abs(floating[f] - four_bit[f]) <= 1 for f in floating), (floating, four_bit)
    assert abs(sum(floating.values()) - sum(four_bit.values())) <= 2, (floating, four_bit)
