"""Every ``edgekv bench`` command builds its options (its module imports), and the benches no other test runs —
``state`` and ``alerts`` — run end to end, small, writing their JSON + PNG. Their figures are measurements and are
not asserted; what is asserted is that they ran on what they say."""

from __future__ import annotations

import argparse
import json

import pytest

from edgekv.apps.cli import build_parser, main


def _bench_names() -> list[str]:
    parser = build_parser(["bench"])
    (bench,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    (benches,) = [a for a in bench.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction)]
    return list(benches.choices)


BENCHES = _bench_names()


def test_the_benches_are_listed():
    assert {"stream", "api", "keepalive", "state", "alerts", "cameras"} <= set(BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_builds_its_options(name):
    """Building a bench's parser imports its module: a name it imports that moved fails here, not in a user's
    hands (``bench keepalive`` failed at import for every run until this test)."""
    parser = build_parser(["bench", name])
    (bench,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    (benches,) = [a for a in bench.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction)]
    options = {s for action in benches.choices[name]._actions for s in action.option_strings}
    assert "--json" in options, f"bench {name} has no --json: {sorted(options)}"
    assert benches.choices[name].get_default("run") is not None


def test_bench_state_writes_and_reads_a_snapshot_a_daemon_would_read(tmp_path, capsys):
    """The snapshot it times carries a whole session state (the reader refused its old manifest: every run
    failed with "the manifest's session state has no 'counters'")."""
    out_json, out_png = tmp_path / "state.json", tmp_path / "state.png"
    code = main(["bench", "state", "--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--tokens", "512",
                 "--dtypes", "fp32,bf16", "--repeats", "2", "--sinks", "--dir", str(tmp_path / "w"),
                 "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    results = json.loads(out_json.read_text())["results"]
    assert set(results) == {"fp32", "bf16"}
    assert results["fp32"]["kv_bytes"] == 2 * results["bf16"]["kv_bytes"] == 2 * 2 * 2 * 512 * 16 * 4
    assert results["fp32"]["bytes"] > results["fp32"]["kv_bytes"] and len(results["bf16"]["write_ms"]) == 2
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "read + verify" in capsys.readouterr().out


def test_bench_state_session_state_is_what_the_reader_checks(tmp_path):
    import torch

    from edgekv.apps.bench.state import bench_session_state, full_cache
    from edgekv.state import FORMAT, cache_views, read_manifest, write_snapshot

    cache = full_cache(1, 1, 8, 300, torch.float32)
    state = bench_session_state(cache)
    assert state["counters"]["frame_pairs"] == 2 and len(state["pair_times"]) == 2  # slots // 256: pairs 0 and 1
    path = tmp_path / "s.ekv"
    write_snapshot(path, {"format": FORMAT, "key": {}, "session": state}, cache_views(cache, cache.length, None))
    assert read_manifest(path)["session"]["cache_length"] == 300


@pytest.mark.slow
def test_bench_alerts_both_parts_run_small(tiny_checkpoint, tmp_path, capsys):
    out_json, out_png = tmp_path / "alerts.json", tmp_path / "alerts.png"
    code = main(["bench", "alerts", "--streams", "1", "--pairs", "20", "--model", str(tiny_checkpoint),
                 "--budget", "1024", "--resolution", "112", "--repeats", "1", "--dtype", "fp32",
                 "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    result = json.loads(out_json.read_text())
    assert {"accuracy", "cost"} <= set(result), sorted(result)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "precision" in printed and "an evaluation after every pair would take" in printed
    accuracy = result["accuracy"]
    assert accuracy["window_s"] is None and accuracy["appearances"] >= accuracy["appearances_alerted"] >= 0
    # rules about now: the same stream with each question reading its last 8 seconds
    assert main(["bench", "alerts", "--parts", "accuracy", "--streams", "1", "--pairs", "20", "--window-s", "8",
                 "--cooldown-s", "0", "--json", str(out_json), "--plot", ""]) == 0
    windowed = json.loads(out_json.read_text())["accuracy"]
    assert windowed["window_s"] == 8 and windowed["appearances"] == accuracy["appearances"]


@pytest.mark.slow
def test_bench_daemon_runs_from_any_folder_with_nothing_made_first(tmp_path, monkeypatch, capsys):
    """Without ``--config`` it used configs/tiny-random.yaml relative to the working folder, whose model
    (../models/tiny) had to be made first: from anywhere else, or from the wheel, it refused to start."""
    monkeypatch.chdir(tmp_path)
    code = main(["bench", "daemon", "--questions", "1", "--answer-tokens", "4", "--load", "2", "--load-tokens", "2",
                 "--window-s", "1", "--json", "d.json", "--plot", "d.png"])
    assert code == 0
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["config"] is None and [mode["backlog"] for mode in data["blind_spot"]] == [True, False]
    assert "a tiny random checkpoint: synthetic:shapes" in capsys.readouterr().out


class _Session:
    """Enough of a session for ``soak``: counts frames; Ctrl-C arrives inside the ingest of frame ``stop_at``."""

    def __init__(self, stop_at: int) -> None:
        self.frames, self.stop_at = 0, stop_at

    def ingest(self, frame, t=None):
        if self.frames == self.stop_at:
            raise KeyboardInterrupt
        self.frames += 1

    def stats(self) -> dict:
        return {"frames": self.frames, "frame_pairs": self.frames // 2, "cache_capacity_bytes": 1024,
                "cache_tokens": 16, "compressions": 0, "questions": 0, "position_max": 0, "position_rebases": 0}


def test_a_soak_stopped_by_ctrl_c_keeps_its_figures():
    """An hours-long soak cut short kept nothing (the interrupt ended the command); now it reports the pairs it
    ran, marked ``interrupted``, with a sample at the stop."""
    import numpy as np

    from edgekv.apps.bench.soak import soak

    frames = [np.zeros((8, 8, 3), np.uint8)]
    try:
        report = soak(_Session(stop_at=101), frames, 2.0, pairs=10_000, sample_every_pairs=20)
    except KeyboardInterrupt:  # (not let through: it would end the test run itself)
        pytest.fail("the interrupt ended the soak and its figures were lost")
    assert report.interrupted and report.pairs == 50  # the pair the interrupt cut is not counted
    assert [s["pairs"] for s in report.samples] == [1, 20, 40, 50]  # the first pair, every 20th, the stop
    assert report.summary()["interrupted"] is True
    done = soak(_Session(stop_at=-1), frames, 2.0, pairs=30, sample_every_pairs=20)
    assert not done.interrupted and done.pairs == 30 and done.summary()["interrupted"] is False
    with pytest.raises(KeyboardInterrupt):  # before the first sample there is nothing to keep
        soak(_Session(stop_at=1), frames, 2.0, pairs=10)


def test_bench_frames_measures_what_the_store_writes(tmp_path, capsys):
    """``edgekv bench frames``: each source's frames through a real FrameStore at each size; the KiB it reports are
    the JPEGs' (each size's thumbnail of that frame), and no write failed."""
    from edgekv.apps.daemon.frame_store import budget_shares, encode_thumbnail
    from edgekv.video import open_source

    source = "synthetic:world?size=96x64&fps=2&frames=20&seed=3"
    out_json, out_png = tmp_path / "new" / "frames.json", tmp_path / "new" / "png" / "frames.png"  # made
    code = main(["bench", "frames", "--sources", source, "--px", "32,64", "--frames", "3", "--frames-mib", "1",
                 "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert [(row["source"], row["px"]) for row in rows] == [(source, 32), (source, 64)]
    frames = [frame for frame, _ in zip((f for f, _ in open_source(source)), range(3))]
    for row in rows:
        sizes = [len(encode_thumbnail(frame, row["px"])) for frame in frames]
        assert row["kib_per_frame"] == pytest.approx(sum(sizes) / 3 / 1024)
        # the hours are the database's share of the budget (less the log's) over the bytes on disk a frame
        assert row["disk_kib_per_frame"] > 0
        assert row["hours_at_one_pair_a_second"] == pytest.approx(
            budget_shares(2**20)[1] / (row["disk_kib_per_frame"] * 1024) / 3600)
        assert row["write_errors"] == 0 and row["writer_ms"]["n"] == 3
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "KiB a frame" in capsys.readouterr().out
    code = main(["bench", "frames", "--px", "8", "--json", str(out_json), "--plot", ""])
    assert code == 2  # a size archive.frames_px refuses, named


def test_bench_capture_runs_both_modes_on_what_it_says(tmp_path, capsys):
    """``edgekv bench capture``: the same clip read with every frame decoded and with only the wanted ones; each run
    says which it was, and the wanted run decoded no more frames than it read (its CPU figures are not asserted)."""
    out_json, out_png = tmp_path / "capture.json", tmp_path / "capture.png"
    code = main(["bench", "capture", "--size", "64", "48", "--fps", "20", "--sample-fps", "4", "--seconds", "0.5",
                 "--repeats", "1", "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    result = json.loads(out_json.read_text())
    runs = {run["mode"]: run for run in result["runs"]}
    assert (runs["every"]["decodes"], runs["wanted"]["decodes"]) == ("every", "wanted")
    # a frame read as the run's first or last figures were taken may not be decoded yet (it waits its time): one each
    every = runs["every"]
    assert abs(every["frames_decoded"] - every["frames_read"]) <= 1 and every["frames_read"] > 0
    assert 0 < runs["wanted"]["frames_decoded"] <= runs["wanted"]["frames_read"] + 1
    assert set(result["saving"]) == {"capture_cpu_ms_per_s", "process_cpu_ms_per_s"}
    assert all(run["age_ms_taken"] >= 0 for run in runs.values())
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "wanted frames only" in capsys.readouterr().out
    assert main(["bench", "capture", "--seconds", "0", "--json", str(out_json), "--plot", ""]) == 2
    assert main(["bench", "capture", "--size", "0", "0", "--json", str(out_json), "--plot", ""]) == 2
    assert main(["bench", "capture", "--source", "synthetic:events?size=112x112", "--json", str(out_json),
                 "--plot", ""]) == 2  # its pixels are made as it is read: nothing to compare
    assert "nothing to compare" in capsys.readouterr().err
