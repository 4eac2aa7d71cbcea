"""A forget cut short by power lost part way is finished at the next start (apps/daemon/forget_journal.py).

Before the journal: the archive and the evidence frames were rewritten first and the snapshots last, so a crash in
between left the older snapshot on disk, and the next start restored the forgotten window into the cache."""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest

from edgekv.apps.daemon.forget_journal import ForgetJournal, JournalError


class PowerCut(BaseException):
    """The process ends here: nothing after this point in the forget runs (not an Exception: no handler sees it)."""


def _config(tiny_checkpoint, root):
    from helpers_server import kept_config

    return kept_config(tiny_checkpoint, root, max_tokens=800)


@pytest.mark.parametrize("cut", ["archive", "snapshots"])
def test_a_forget_cut_short_by_a_crash_is_finished_at_the_next_start(tiny_checkpoint, tmp_path, cut):
    """The disk is copied as the power goes — before the archive's rewrite, or after everything but the snapshots —
    and a daemon started on the copy has the window nowhere: not in the restored cache, the archive, the evidence
    frames or a snapshot, and the journal is struck off."""
    pytest.importorskip("fastapi")
    from helpers_server import ended_daemon

    first, crashed = tmp_path / "first", tmp_path / "crashed"
    with ended_daemon(_config(tiny_checkpoint, first), tmp_path / "out1.txt") as daemon:
        assert daemon.frames.flush() and daemon.session.recall.archive.flush()
        with daemon.lock:
            daemon.state.snapshot(daemon.session)  # a snapshot that holds the window
        stream, frame_stream = daemon.session.recall.stream, daemon._frame_stream()
        t = daemon.session.pair_times[5]
        assert any(e.pair == 5 for e in daemon.session.recall.archive.entries(stream))

        def power_cut(*args, **kwargs):
            shutil.copytree(first, crashed)
            raise PowerCut()

        if cut == "archive":
            daemon.session.recall.archive.forget = power_cut
        else:
            daemon.state.rewrite_after_forget = power_cut
        with pytest.raises(PowerCut):
            daemon.forget(t, t)
        noted = json.loads((crashed / "state" / ForgetJournal.NAME).read_text())["pending"]
        assert len(noted) == 1 and noted[0]["stretches"] == [[t, t]] and noted[0]["archive_stream"] == stream.hex()
    # the process that crashed wrote nothing more; the copy is the disk as the power went
    with ended_daemon(_config(tiny_checkpoint, crashed), tmp_path / "out2.txt") as daemon:
        said = (tmp_path / "out2.txt").read_text()
        assert "resumed" in said and f"forget cut short by the last stop (t={t:g}..{t:g} s) done again" in said, said
        assert daemon.session.recall.stream == stream  # the same stream, resumed
        assert 5 not in daemon.session.pair_times and 4 in daemon.session.pair_times and 6 in daemon.session.pair_times
        assert not any(e.pair == 5 for e in daemon.session.recall.archive.entries(stream))
        assert any(e.pair == 6 for e in daemon.session.recall.archive.entries(stream))
        assert not daemon.frames.has(frame_stream, 5) and daemon.frames.has(frame_stream, 6)
        assert not (crashed / "state" / ForgetJournal.NAME).exists()


def test_a_forget_that_ends_leaves_no_note_and_one_that_fails_part_way_stays_noted(tiny_checkpoint, tmp_path):
    pytest.importorskip("fastapi")
    import errno

    from helpers_server import ended_daemon

    journal = tmp_path / "state" / ForgetJournal.NAME
    with ended_daemon(_config(tiny_checkpoint, tmp_path), tmp_path / "out.txt") as daemon:
        times = dict(daemon.session.pair_times)
        daemon.forget(times[3], times[3])
        assert 3 not in daemon.session.pair_times and not journal.exists()
        archive_forget = daemon.session.recall.archive.forget

        def failing(*args, **kwargs):
            raise OSError(errno.EIO, "Input/output error")

        daemon.session.recall.archive.forget = failing
        with pytest.raises(OSError, match="archive"):
            daemon.forget(times[7], times[7])
        assert json.loads(journal.read_text())["pending"][0]["stretches"] == [[times[7], times[7]]]
        daemon.session.recall.archive.forget = archive_forget
        daemon.forget(times[9], times[9])  # strikes off its own note only
        assert [e["stretches"] for e in json.loads(journal.read_text())["pending"]] == [[[times[7], times[7]]]]


def test_the_journal_is_private_survives_rereading_and_names_a_damaged_file(tmp_path):
    journal = ForgetJournal(tmp_path / "state")
    assert journal.pending() == []
    a = journal.add([(1.0, 2.0)], 0.5, "ab" * 8, None)
    b = journal.add([(3.0, 4.0), (5.0, 6.0)], 0.5, None, "cd")
    assert stat.S_IMODE(os.stat(journal.path).st_mode) == 0o600
    assert [e["id"] for e in ForgetJournal(tmp_path / "state").pending()] == [a["id"], b["id"]]
    journal.done(a["id"])
    assert [e["stretches"] for e in journal.pending()] == [[[3.0, 4.0], [5.0, 6.0]]]
    journal.done(b["id"])
    assert not journal.path.exists() and journal.pending() == []
    assert not [p for p in (tmp_path / "state").iterdir()]  # no temporary file left either
    for damaged in (b"{\"pending\": [", b"[1, 2]", b'{"pending": [{"id": "x", "stretches": [[1, "2"]]}]}'):
        journal.path.write_bytes(damaged)
        with pytest.raises(JournalError, match=ForgetJournal.NAME):
            journal.pending()
    c = journal.add([(7.0, 8.0)], 0.5, None, None)  # a damaged journal is replaced (and said), not kept failing
    assert [e["id"] for e in journal.pending()] == [c["id"]]
    assert ForgetJournal(None).pending() == []
