"""``edgekv bench api`` end to end, small: a daemon in a child process, idle probes, a few concurrent chats,
JSON + PNG written with the figures (their values are measurements, not asserted)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("matplotlib")


@pytest.mark.slow
def test_bench_api_writes_figures(tiny_checkpoint, tmp_path, capsys):
    from edgekv.apps.cli import main

    out_json, out_png = tmp_path / "api.json", tmp_path / "api.png"
    code = main(["bench", "api", "--model", str(tiny_checkpoint), "--chats", "4", "--answer-tokens", "2",
                 "--idle-s", "2", "--probe-ms", "100", "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    result = json.loads(out_json.read_text())
    assert result["load"]["statuses"] == {"200": 4}
    assert result["idle"]["healthz_ms"]["n"] >= 10 and result["load"]["healthz_ms"]["n"] >= 1
    assert result["idle"]["ingest_fps"] > 0 and result["probe_failures"] == 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "idle" in printed and "/healthz p50" in printed and "target" in printed
