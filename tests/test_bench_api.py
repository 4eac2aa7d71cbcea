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
    # how many probes land in each window depends on the machine's speed: at least one while idle (the load
    # window may be shorter than one probe interval on a fast machine)
    assert result["idle"]["healthz_ms"]["n"] >= 1 and "healthz_ms" in result["load"]
    assert result["idle"]["ingest_fps"] > 0 and result["probe_failures"] == 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "idle" in printed and "/healthz p50" in printed and "target" in printed


@pytest.mark.slow
@pytest.mark.parametrize("load", ["hammer", "read", "slowloris"])
def test_bench_api_loads_of_issue_26_run_and_write_figures(tiny_checkpoint, tmp_path, load):
    """The hammer / read / slowloris loads (issue 26's probes) run, bounded, and write their figures."""
    from edgekv.apps.cli import main

    out_json = tmp_path / "api.json"
    code = main(["bench", "api", "--model", str(tiny_checkpoint), "--load", load, "--chats", "3", "--clients", "3",
                 "--answer-tokens", "2", "--idle-s", "1", "--load-s", "2", "--probe-ms", "100", "--replay",
                 "--json", str(out_json), "--plot", str(tmp_path / "api.png")])
    assert code == 0
    result = json.loads(out_json.read_text())
    assert result["load"]["kind"] == load and result["load"]["requests"] > 0
    assert result["load"]["healthz_served"]["sent"] > 0 and result["run"]["args"]["replay"] is True


@pytest.mark.slow
def test_bench_soak_daemon_samples_the_daemon_and_its_clients(tiny_checkpoint, tmp_path):
    from edgekv.apps.cli import main

    out_json = tmp_path / "soak.json"
    code = main(["bench", "soak", "--daemon", "--hours", "0.0015", "--clients", "2", "--ask-every-s", "1",
                 "--answer-tokens", "2", "--sample-s", "3", "--resolution", "56", "56", "--max-tokens", "200",
                 "--text-reserve", "48", "--model", str(tiny_checkpoint), "--json", str(out_json), "--plot", ""])
    assert code == 0
    result = json.loads(out_json.read_text())
    summary = result["summary"]
    assert summary["requests"] > 0 and summary["pairs"] > 0 and summary["rss_end_mb"] > 0
    assert len(result["samples"]) >= 2 and "client_errors" in result["samples"][-1]


@pytest.mark.slow
def test_bench_keepalive_times_both_kinds_of_connection(tmp_path, capsys):
    """``edgekv bench keepalive`` (it once imported a helper another refactor had moved: every run failed)."""
    from edgekv.apps.cli import main

    out_json, out_png = tmp_path / "keepalive.json", tmp_path / "keepalive.png"
    code = main(["bench", "keepalive", "--requests", "3", "--chats", "1", "--answer-tokens", "1",
                 "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    result = json.loads(out_json.read_text())
    assert {name: result[name]["n"] for name in ("healthz_kept", "healthz_fresh", "chat_kept", "chat_fresh")} == {
        "healthz_kept": 3, "healthz_fresh": 3, "chat_kept": 1, "chat_fresh": 1}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "kept-alive median" in capsys.readouterr().out
