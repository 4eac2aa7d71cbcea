"""``edgekv bench archive`` end to end on small settings: it runs, prints and writes JSON + PNG whose figures
are consistent (the run recalls pairs, the no-archive run recalls none, the latency rows cover the sizes)."""

from __future__ import annotations

import json

from edgekv.apps.cli import main


def test_bench_archive_writes_consistent_figures(tmp_path, capsys):
    out_json, out_png = tmp_path / "a.json", tmp_path / "a.png"
    code = main(["bench", "archive", "--length", "80", "--ages", "60,70", "--events", "2", "--streams", "1",
                 "--budget", "512", "--policy", "sliding_window", "--ks", "2", "--modes", "layer",
                 "--scorings", "attention,cosine", "--latency-pairs", "3", "--shape", "4,2,16,8", "--sizes-gib", "0.001,0.01", "--repeats", "1",
                 "--ingest-pairs", "24", "--ingest-repeats", "1", "--dir", str(tmp_path),
                 "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "archive k=2 layer attention" in printed and "ms/pair with the writer" in printed
    results = json.loads(out_json.read_text())["results"]
    summary = results["accuracy"]["summary"]
    runs = {"archive k=2 layer attention", "archive k=2 layer cosine"}
    assert set(summary) == {"full cache", "no archive", *runs}
    assert summary["no archive"]["old_event_recalled"] == 0.0
    for run in runs:
        assert summary[run]["recall_ms_per_question"] > 0
        assert summary[run]["old_n"] == summary["no archive"]["old_n"] > 0
        # sliding_window holds nothing of events older than its window: every one is a recall candidate
        assert summary[run]["old_event_whole_in_cache"] == 0.0
        assert summary[run]["old_event_recalled_if_not_whole"] == summary[run]["old_event_recalled"]
    rows = results["latency"]["rows"]
    sizes = [max(int(s * 2**30 // results["latency"]["record_bytes"]), 1) for s in (0.001, 0.01)]
    assert sorted((r["pairs"], r["scoring"]) for r in rows) == sorted(
        (p, s) for p in sizes for s in ("attention", "cosine"))
    assert all(r["read_cold_ms"] > 0 and r["select_ms"] > 0 for r in rows)
    ingest = results["ingest"]
    assert len(ingest["ms_per_pair"]["on"]) == len(ingest["ms_per_pair"]["off"]) == 1 and ingest["rss_mb_on"]
    assert ingest["compressions"]["on"] == ingest["compressions"]["off"]  # same video room: the writer's cost alone
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_archive_ingest_part_in_bf16(tmp_path, capsys):
    """``--dtype bf16`` (how a 3B-shape checkpoint is measured): the replayed vision tokens are found by the
    pixels the session hands the backend, which are bf16 then."""
    out_json = tmp_path / "a.json"
    code = main(["bench", "archive", "--parts", "ingest", "--dtype", "bf16", "--budget", "256", "--policy", "infinipot_v",
                 "--ingest-pairs", "24", "--ingest-repeats", "1", "--dir", str(tmp_path), "--json", str(out_json),
                 "--plot", ""])
    assert code == 0
    ingest = json.loads(out_json.read_text())["results"]["ingest"]
    assert ingest["compressions"]["on"] == ingest["compressions"]["off"] and ingest["compressions"]["on"][0] > 0


def test_bench_soak_with_an_archive_keeps_disk_under_max_gib(tmp_path, capsys):
    """``bench soak --set archive...``: the long-stream check with the archive on; retention keeps the segments under
    max_gib while the stream goes on, and the archive's counters land in the JSON."""
    out = tmp_path / "soak.json"
    archive = tmp_path / "archive"
    code = main(["bench", "soak", "--pairs", "240", "--model", "builtin:toy", "--resolution", "112", "112",
                 "--max-tokens", "640", "--text-reserve", "64", "--ask-every", "120", "--answer-tokens", "2",
                 "--sample-every-pairs", "80", "--set", f"archive.dir={archive}", "--set", "archive.max_gib=0.002",
                 "--set", "archive.segment_mib=1", "--json", str(out), "--plot", "", "--quiet"])
    assert code == 0
    data = json.loads(out.read_text())
    counters = data["setup"]["archive"]
    assert counters["archive_written"] + counters["archive_dropped"] == 240
    assert counters["archive_segments_deleted"] > 0 and counters["recalls"] == 2
    assert sum(p.stat().st_size for p in archive.iterdir()) <= 0.002 * 2**30
    assert data["summary"]["errors"] == 0 and len(data["summary"]["cache_bytes"]) == 1
    assert main(["bench", "soak", "--pairs", "2", "--set", "archive.max_gib=-1", "--json", str(out)]) == 2
    assert "archive.max_gib: must be > 0" in capsys.readouterr().out
