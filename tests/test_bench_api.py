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


@pytest.mark.slow
def test_bench_keepalive_over_https(tmp_path, capsys):
    """``--tls``: the daemon serves HTTPS with a certificate made for the run; both kinds of connection go over it."""
    pytest.importorskip("cryptography")
    from edgekv.apps.cli import main

    out_json = tmp_path / "keepalive.json"
    assert main(["bench", "keepalive", "--tls", "--requests", "3", "--chats", "1", "--answer-tokens", "1",
                 "--json", str(out_json), "--plot", ""]) == 0
    result = json.loads(out_json.read_text())
    assert result["tls"] is True and result["tls_version"].startswith("TLSv1.")
    assert result["healthz_fresh"]["n"] == 3 and result["chat_fresh"]["n"] == 1
    assert f"over {result['tls_version']}" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_soak_daemon_soaks_a_deployment_config_with_two_cameras(tiny_checkpoint, tmp_path):
    """``--config``: the deployment's own file (here two cameras, as edgekv-camera runs them: the soak's child
    once built a single-camera daemon and refused ``video.sources``); streamed chats name a camera in turn (a
    streamed answer comes from one camera: unnamed, every one was a 400) and the pairs are both cameras'."""
    from edgekv.apps.cli import main

    config = tmp_path / "two.yaml"
    config.write_text(
        f"model: {{path: {json.dumps(str(tiny_checkpoint))}, dtype: fp32, device: cpu}}\n"
        "video:\n  fps: 2.0\n  resolution: [56, 56]\n  sources:\n"
        "    - {name: a, source: 'synthetic:shapes?size=56x56&fps=2&frames=100000'}\n"
        "    - {name: b, source: 'synthetic:shapes?size=56x56&fps=2&frames=100000&seed=3'}\n"
        "cache: {max_tokens: 400, text_reserve_tokens: 48}\n"
        "server: {port: 8080}\n"  # a deployment's port: the soak's daemon listens on a free one instead
        "generation: {max_new_tokens: 2}\nmonitor: {backend: cpu}\n")
    out_json = tmp_path / "soak.json"
    code = main(["bench", "soak", "--daemon", "--config", str(config), "--replay", "--hours", "0.0015", "--clients",
                 "2", "--ask-every-s", "1", "--sample-s", "2", "--json", str(out_json), "--plot", ""])
    assert code == 0
    result = json.loads(out_json.read_text())
    summary = result["summary"]
    assert summary["client_errors"] == 0, summary["client_error_messages"]
    assert summary["answers"] >= 2 and summary["pairs"] > 0
    assert result["setup"]["config"] == str(config) and result["setup"]["model"] == str(tiny_checkpoint)
    assert summary["cache_bytes"][-1] > 0


def test_bench_soak_daemon_stats_sum_the_cameras():
    from edgekv.apps.bench.soak import _daemon_stats

    page = {"stats": {"frames": 10, "frame_pairs": 5, "cache_capacity_bytes": 100, "errors": 1},
            "cameras": {"a": {"frames": 10, "frame_pairs": 5, "cache_capacity_bytes": 100},
                        "b": {"frames": 6, "frame_pairs": 3, "cache_capacity_bytes": 200}}}
    stats = _daemon_stats(page)
    assert (stats["frames"], stats["frame_pairs"], stats["cache_capacity_bytes"], stats["errors"]) == (16, 8, 300, 1)
    one = {"stats": {"frames": 10}, "cameras": {"a": {"frames": 99}}}
    assert _daemon_stats(one)["frames"] == 10 and _daemon_stats({}) == {}


def test_bench_soak_config_is_refused_without_daemon_and_when_wrong(tmp_path, capsys):
    from edgekv.apps.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("cache: {max_tokens: -3}\n")
    assert main(["bench", "soak", "--config", str(bad), "--hours", "0.001"]) == 2
    assert "--config soaks a deployment's daemon; add --daemon" in capsys.readouterr().out
    assert main(["bench", "soak", "--daemon", "--config", str(bad), "--hours", "0.001", "--plot", ""]) == 2
    assert "cache.max_tokens" in capsys.readouterr().out
    assert main(["bench", "soak", "--daemon", "--config", str(tmp_path / "none.yaml"), "--hours", "0.001"]) == 2
    assert "config file not found" in capsys.readouterr().out
