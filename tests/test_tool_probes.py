"""The offline tools a user runs before deploying (``quantize``, ``plan``, ``calibrate``, ``eval videoqa``,
``eval compare``), given what a user gets wrong: a damaged or incomplete checkpoint, values no device has, a
results folder of another run, runs of other streams. Each mistake is one line on stderr and exit status 2,
refused before anything is written, never a traceback or a figure of the wrong thing."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from edgekv.apps.cli import main
from edgekv.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dense") / "ckpt", preset="test-gqa4", seed=5)


# ---------------------------------------------------------------------------------------------- quantize
def test_quantize_refuses_a_truncated_or_incomplete_checkpoint_before_writing(dense, tmp_path, capsys):
    """A weight file cut short used to stop safetensors' reader with a traceback (exit 1); a checkpoint lacking a
    decoder linear was written out without it (exit 0), a 4-bit checkpoint that no loader takes."""
    cut = tmp_path / "cut"
    shutil.copytree(dense, cut)
    weights = cut / "model.safetensors"
    with weights.open("r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    assert main(["quantize", str(cut), str(tmp_path / "q1"), "--group-size", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors" in err and "truncated" in err
    assert not (tmp_path / "q1").exists()

    lacking = tmp_path / "lacking"
    shutil.copytree(dense, lacking)
    tensors = load_file(lacking / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(lacking / "model.safetensors"), metadata={"format": "pt"})
    assert main(["quantize", str(lacking), str(tmp_path / "q2"), "--group-size", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.layers.1.mlp.up_proj.weight is in no weight file" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut", "lacking"]  # no output, no partial folder

    (lacking / "config.json").write_bytes(b"\xff\xfe{")  # was: the decoder's message alone, naming no file
    assert main(["quantize", str(lacking), str(tmp_path / "q3"), "--group-size", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{lacking / 'config.json'}: not a JSON config" in err


def test_quantize_onto_a_full_disk_is_one_line_and_leaves_nothing(dense, tmp_path, monkeypatch, capsys):
    """safetensors reports ENOSPC as its own SafetensorError: a traceback and exit 1 (seen on an 8 MiB tmpfs)."""
    import edgekv.calibration.quantize as quantize
    from safetensors import SafetensorError

    def full(tensors, path, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(quantize, "save_file", full)
    assert main(["quantize", str(dense), str(tmp_path / "q"), "--group-size", "16"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("quantize: ")]  # progress
    assert len(err) == 1 and "cannot write it" in err[0] and "No space left on device" in err[0]
    assert list(tmp_path.iterdir()) == []  # the partial folder is gone


# ---------------------------------------------------------------------------------------------- plan
@pytest.fixture
def config_3b(tmp_path):
    from edgekv.model.tiny import PRESETS

    (tmp_path / "3b").mkdir()
    (tmp_path / "3b" / "config.json").write_text(json.dumps(PRESETS["3b"].config.to_hf_dict()))
    return tmp_path / "3b"


@pytest.mark.parametrize("flags, said", [
    (["--device-memory", "nan"], "the device memory must be positive (GB), got nan"),  # was: "cannot convert NaN"
    (["--device-memory", "inf"], "the device memory must be positive (GB), got inf"),  # was: OverflowError traceback
    (["--device-memory", "64", "--reserve-gb", "nan"], "the reserve must be 0 or more (GB), got nan"),
    (["--device-memory", "64", "--weights-gb", "nan"], "the weights' size must be positive (GB), got nan"),
    (["--device-memory", "64", "--flash-tbw", "-1"], "--flash-tbw: the flash"),  # was "-0.4 years"
    (["--device-memory", "64", "--flash-tbw", "nan"], "--flash-tbw: the flash's rating must be a positive"),
])
def test_plan_refuses_values_no_device_has(config_3b, capsys, flags, said):
    assert main(["plan", "--model", str(config_3b), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and said in captured.err and captured.out == ""


def test_plan_names_a_config_json_it_cannot_read(config_3b, capsys):
    """A config.json of other keys stopped the estimate with a KeyError traceback; one that is not UTF-8 JSON was
    refused with the decoder's message alone, naming no file."""
    path = config_3b / "config.json"
    for content, said in ((b'{"text_config": {}}', "hidden_size, intermediate_size"),
                          (b"\xff\xfe{", "not a JSON config"), (b'{"hidden', "not a JSON config")):
        path.write_bytes(content)
        assert main(["plan", "--model", str(config_3b), "--device-memory", "64"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(path) in err and said in err


def test_plan_of_a_four_bit_checkpoint_too_big_does_not_advise_quantizing_it(config_3b, capsys):
    config = json.loads((config_3b / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                     "version": "gemm"}
    (config_3b / "config.json").write_text(json.dumps(config))
    assert main(["plan", "--model", str(config_3b), "--device-memory", "4"]) == 2
    err = capsys.readouterr().err
    assert "short by" in err and "4-bit AWQ decoder linears" in err
    assert "bf16 weights" not in err and "edgekv quantize" not in err


# ---------------------------------------------------------------------------------------------- calibrate
def test_calibrate_refuses_an_out_it_cannot_write_before_streaming(tmp_path, monkeypatch, capsys):
    """``--out`` is written after every sample video has streamed (minutes of a 3B model on a Jetson): a folder
    missing there failed only then, the work lost."""
    import edgekv

    def streamed(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(edgekv.Runtime, "from_pretrained", streamed)
    for out, said in ((tmp_path / "nowhere" / "cv.yaml", "no writable folder"), (tmp_path, "a folder")):
        assert main(["calibrate", "--model", "unused", "--video", "synthetic:shapes?frames=10", "--frames", "4",
                     "--out", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out {out}: {said}" in err


# ---------------------------------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_while_a_command_loads_is_an_interrupt_not_a_traceback(monkeypatch, capsys):
    """A command's modules import while its options are added (torch, seconds on a Jetson); Ctrl-C then escaped
    main() as a KeyboardInterrupt traceback instead of "interrupted", exit 130."""
    import edgekv.calibration.quantize

    def importing(parser):
        raise KeyboardInterrupt

    monkeypatch.setattr(edgekv.calibration.quantize, "add_quantize_arguments", importing)
    assert main(["quantize", "a", "b"]) == 130
    assert capsys.readouterr().err == "edgekv: interrupted\n"
