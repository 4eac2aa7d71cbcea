"""``edgekv-camera --check`` in tests: a deployment YAML on a checkpoint, and the check's lines as results."""

from __future__ import annotations

from pathlib import Path

import yaml

from edgekv.apps.daemon.camera import main


def check_config(tmp_path: Path, model: Path, **sections) -> Path:
    """``tmp_path/deploy.yaml``: a synthetic camera, an infinipot_v cache of 400 tokens, the API on a free port;
    each section given (``server={...}``) updated over these."""
    data = {
        "model": {"path": str(model), "dtype": "fp32", "device": "cpu"},
        "video": {"source": "synthetic:shapes?size=160x120&fps=8&frames=1000", "fps": 4.0, "resolution": [112, 112]},
        "cache": {"policy": "infinipot_v", "max_tokens": 400, "text_reserve_tokens": 96},
        "server": {"port": 0},
        "monitor": {"backend": "cpu"},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_check(path: Path, capsys) -> tuple[int, dict[str, tuple[str, str]]]:
    """The exit status of ``--check`` on ``path``, and each checked item: ``{name: (status, detail)}``."""
    code = main(["--config", str(path), "--check"])
    results = {}
    for line in capsys.readouterr().out.splitlines()[1:-1]:
        status, _, rest = line.partition("  ")
        key, _, detail = rest.strip().partition(": ")
        results[key] = (status.strip(), detail)
    return code, results
