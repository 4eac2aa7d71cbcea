"""``edgekv-camera --check`` says which recording a restart continues: with ``state.dir`` holding a memory that
stopped in a recording, the check's memory line ends with the line the start then says (``edgekv.state``'s
``recording_goes_on``, the start's own decision): resuming it at its time, read from its start and why, or ended
(a ``note``: the start ingests nothing more). Before, the check said only "resumes snapshot-…" and the operator
learnt at the restart whether the robot would watch the rest of the clip, the clip again, or nothing."""

from __future__ import annotations

import io
from pathlib import Path

import yaml

from edgekv.apps.daemon.camera import main
from edgekv.config import load_config

# 48 frames at 8 fps sampled at 4 fps: 24 frames in, the last at 5.75 s
EVENTS = "synthetic:events?size=112x112&fps=8&frames=48&rate=0.3&seed=3"


def _config_file(root: Path, source: str = EVENTS) -> Path:
    path = root / f"camera-{len(list(root.glob('camera-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        "video": {"source": source, "fps": 4.0, "resolution": [112, 112]},
        "cache": {"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
        "server": {"enabled": False}, "monitor": {"backend": "cpu"}, "generation": {"max_new_tokens": 2},
        "state": {"dir": str(root / "state"), "every_s": 3600},
        "engines": {"engine_dir": str(root / "engines")}}))
    return path


def _run(path: Path, **options) -> str:
    """A one-shot daemon run of the config file to its end: what it said."""
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions

    out = io.StringIO()
    daemon = Daemon(load_config(str(path)), DaemonOptions(no_stdin=True, quiet=True, no_server=True, **options),
                    out=out)
    assert daemon.run() == 0, out.getvalue()
    return out.getvalue()


def _memory_line(path: Path, capsys) -> str:
    assert main(["--config", str(path), "--check"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "state.dir memory:" in line]
    return line


def test_check_says_where_the_recording_goes_on_as_the_start_then_does(tmp_path, capsys):
    path = _config_file(tmp_path)
    _run(path, max_frames=10)
    line = _memory_line(path, capsys)
    said = f"resuming {EVENTS} at 2.25 s where the saved memory stopped (the recording's own time goes on)"
    assert line.startswith("ok    state.dir memory: resumes snapshot-") and line.endswith(f"; {said}")
    assert said in _run(path, max_frames=2)  # the start says the same


def test_check_says_another_recording_is_read_from_its_start_and_why(tmp_path, capsys):
    _run(_config_file(tmp_path), max_frames=4)
    other = EVENTS.replace("seed=3", "seed=4")
    path = _config_file(tmp_path, other)
    said = f"{other} is read from its start: the saved memory last read another source, {EVENTS}"
    assert _memory_line(path, capsys).endswith(f"; {said}")
    assert said in _run(path, max_frames=2)


def test_check_says_a_recording_read_to_its_end_reads_no_more(tmp_path, capsys):
    path = _config_file(tmp_path)
    _run(path, exit_at_end=True)
    line = _memory_line(path, capsys)
    said = f"{EVENTS} ended at 5.75 s in the saved memory: nothing more is read from it"
    assert line.startswith("note  state.dir memory: resumes snapshot-") and said in line
    assert said in _run(path, exit_at_end=True)
