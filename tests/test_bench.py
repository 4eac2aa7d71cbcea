"""`edgekv bench stream`: the figures it reports are computed as documented (hand-made rows), and the
command runs end to end on a tiny checkpoint, writing JSON + PNG. Speed is measured by running the
command, never asserted here."""

from __future__ import annotations

import json

import pytest

from edgekv.apps.bench.stream import steady_state_summary
from edgekv.apps.cli import main


def rows(n: int, first_compression: int, every: int, ingest_ms, cpu_ms=None, rss=100.0) -> list[dict]:
    out = []
    for i in range(n):
        compressed = i >= first_compression and (i - first_compression) % every == 0
        out.append({"pair": i, "ingest_ms": ingest_ms(i), "ingest_cpu_ms": (cpu_ms or ingest_ms)(i),
                    "compression_ms": 2.0 if compressed else 0.0, "rss_mb": rss + (0.5 if i > n // 2 else 0.0)})
    return out


def test_steady_state_summary_by_hand():
    # 500 pairs: 10 ms each before pair 100, then 20 ms; a 2 ms compression every 10th pair from pair 100
    data = rows(500, 100, 10, lambda i: 10.0 if i < 100 else 20.0, cpu_ms=lambda i: 30.0 if i >= 400 else 15.0)
    got = steady_state_summary(data)
    assert got["pairs"] == 500 and got["compressions"] == 40
    assert got["compression_ms_total"] == pytest.approx(80.0)
    assert got["compression_share"] == pytest.approx(80.0 / (100 * 10.0 + 400 * 20.0))
    assert got["compression_share_after_first_compression"] == pytest.approx(80.0 / (400 * 20.0))
    assert got["compression_ms_median"] == 2.0 and got["compression_ms_max"] == 2.0
    assert got["rss_growth_after_first_compression"] == pytest.approx(0.005)
    assert got["late_over_early_median_ingest"] == pytest.approx(1.0)
    # CPU time: the last 200 pairs are pairs 300-499, half at 15 ms and half at 30 ms (median 22.5); the
    # first 200 after the first compression (100-299) are all 15 ms
    assert got["late_over_early_median_ingest_cpu"] == pytest.approx(22.5 / 15.0)


def test_steady_state_summary_short_and_uncompressed_streams():
    short = steady_state_summary(rows(150, 20, 10, lambda i: 5.0))
    assert "late_over_early_median_ingest" not in short  # fewer than 400 pairs after the first compression
    assert short["compression_share_after_first_compression"] == pytest.approx(13 * 2.0 / (130 * 5.0))
    never = steady_state_summary(rows(50, 10**9, 10, lambda i: 5.0))
    assert never["compressions"] == 0 and never["compression_share"] == 0.0
    assert "compression_share_after_first_compression" not in never and "compression_ms_median" not in never


def test_bench_stream_command_writes_figures(tiny_checkpoint, tmp_path, capsys):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    code = main(["bench", "stream", "--model", str(tiny_checkpoint), "--frames", "60", "--resolution", "112", "112",
                 "--policy", "infinipot_v,full", "--max-tokens", "900", "--no-hf", "--threads", "1",
                 "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "[edgekv infinipot_v] 30 pairs" in printed and "% from the first compression on" in printed
    assert "[full] stopped at frame pair" in printed  # full never evicts: it stops with CacheFullError
    data = json.loads(out_json.read_text())
    ipv, full = data["results"]
    assert ipv["policy"] == "infinipot_v" and len(ipv["rows"]) == 30 and ipv["summary"]["compressions"] > 0
    assert all(r["cache_tokens"] <= 900 - 512 for r in ipv["rows"])
    assert all(r["ingest_cpu_ms"] > 0 and r["ingest_ms"] > 0 for r in ipv["rows"])
    assert full["stopped"] and len(full["rows"]) < 30
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
