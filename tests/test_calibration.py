"""`edgekv calibrate` writes thresholds the runtime loads; uncalibrated models say so in stats()."""

from __future__ import annotations

import pytest
import yaml

import edgekv
from edgekv.apps.cli import main
from edgekv.calibration.thresholds import CVThresholds, quartile_thresholds
from edgekv.model.config import ModelConfig


def test_quartile_rule_and_file_validation(tmp_path):
    assert quartile_thresholds([0.1, 0.2, 0.3, 0.4, 0.5]) == pytest.approx((0.2, 0.3, 0.4))
    bad = tmp_path / "bad.yaml"
    bad.write_text("thresholds: [0.3, 0.2, 0.1]\n")
    with pytest.raises(ValueError, match="increasing"):
        CVThresholds.load(bad)
    with pytest.raises(ValueError, match="does not exist"):
        CVThresholds.load(tmp_path / "missing.yaml")


@pytest.mark.gpu
def test_quartiles_of_layer_cvs_on_the_gpu():
    """A CUDA session hands its layer CVs over on the GPU: quantile's q once sat on the host (issue 32: every
    CUDA session failed at its first compression)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cvs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5], device="cuda")
    assert quartile_thresholds(cvs) == pytest.approx((0.2, 0.3, 0.4))


def test_calibrate_command_and_runtime_use(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "cv.yaml"
    code = main(["calibrate", "--model", str(tiny_checkpoint), "--video", "synthetic:shapes?size=80x60&frames=200",
                 "--frames", "80", "--fps", "2", "--resolution", "112", "112", "--max-tokens", "420", "--out", str(out)])
    assert code == 0
    data = yaml.safe_load(out.read_text())
    t1, t2, t3 = data["thresholds"]
    layers = ModelConfig.from_dir(tiny_checkpoint).text.num_hidden_layers
    assert t1 < t2 < t3 and len(data["layer_cv"]) == layers and data["compressions_sampled"] >= 1
    captured = capsys.readouterr()
    assert "thresholds" in captured.out
    progress = [line for line in captured.err.splitlines() if line.startswith("calibrate: ")]
    assert 2 <= len(progress) <= 12 and "100.0 %" in progress[-1] and "frame 80/80" in progress[-1]

    def run(calibration):
        rt = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"dtype": "fp32", "device": "cpu"},
                                            video={"resolution": [112, 112], "fps": 2.0},
                                            cache={"policy": "infinipot_v", "max_tokens": 420,
                                                   "text_reserve_tokens": 64, "calibration": calibration})
        session = rt.session()
        rng = __import__("numpy").random.default_rng(0)
        for i in range(60):
            session.ingest(rng.integers(0, 256, (60, 80, 3), dtype="uint8"), t=i / 2)
        return session.stats()

    assert run(str(out))["van_calibration"].startswith("calibrated")
    assert run(None)["van_calibration"].startswith("uncalibrated")
    # a --video that cannot be opened is named before any other is sampled (it was found after them)
    missing = tmp_path / "nope.mp4"
    assert main(["calibrate", "--model", str(tiny_checkpoint), "--video", "synthetic:shapes?size=80x60&frames=200",
                 "--video", str(missing), "--frames", "80", "--out", str(tmp_path / "never.yaml")]) == 2
    captured = capsys.readouterr()
    assert f"'{missing}': no such video file" in captured.err and not (tmp_path / "never.yaml").exists()
    assert "video 1/2" not in captured.err
