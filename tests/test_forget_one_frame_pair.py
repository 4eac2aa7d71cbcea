"""A forget takes from the archive exactly the pairs with a frame in its window, as it takes them from the cache
(``StreamSession.pairs_in``): a record ends at its last frame (``ArchivedPair.t_last``), and a one-frame record (a
recording's odd last frame, archived as a pair of itself) ends where it starts.

Before: the daemon's forget (``Daemon._forget_stretch``) asked the archive for every record stamped from a frame
interval before the window, taking each record to end a frame interval after its stamp: a one-frame record just
before the window went too, though none of its frames was in it."""

from __future__ import annotations

import pytest

from edgekv.archive.store import FrameArchive
from helpers_archive import SHAPE, fill_at

FRAME_S = 0.25  # 4 fps: pairs stamped every 0.5 s, their second frame 0.25 s on
TIMES = [(0, 0.0), (1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0)]  # pair 4: the odd last frame, alone


def _archive(folder) -> FrameArchive:
    archive = FrameArchive(folder, SHAPE, max_bytes=8 << 20, segment_bytes=1 << 20)
    fill_at(archive, TIMES, one_frame=frozenset({4}))
    return archive


@pytest.mark.parametrize(("window", "gone"), [
    ((2.1, 3.0), []),            # after the lone frame: nothing of the archive was seen then
    ((2.0 + 1e-9, 2.2), []),     # the lone frame is not in it by a hair
    ((2.0, 2.0), [4]),           # the lone frame itself
    ((1.75, 1.9), [3]),          # pair 3's second frame (its stamp before the window), not the lone frame after it
    ((1.8, 2.1), [4]),           # between pair 3's second frame and past the lone frame
    ((0.25, 0.5), [0, 1]),       # a pair of two whose second frame is in it, and one stamped in it
    ((-5.0, -1.0), []),
])
def test_a_forget_with_frame_s_takes_the_pairs_with_a_frame_in_the_window(tmp_path, window, gone):
    archive = _archive(tmp_path / "a")
    try:
        result = archive.forget(*window, frame_s=FRAME_S)
        assert result["pairs"] == len(gone)
        kept = [pair for pair, _t in TIMES if pair not in gone]
        assert [e.pair for e in archive.entries()] == kept
    finally:
        archive.close()
    reopened = FrameArchive(tmp_path / "a", SHAPE, max_bytes=8 << 20, segment_bytes=1 << 20)
    try:
        assert [e.pair for e in reopened.entries()] == kept  # the files, not only the index
    finally:
        reopened.close()


def test_a_forget_without_frame_s_takes_the_pairs_stamped_in_the_window_as_before(tmp_path):
    archive = _archive(tmp_path / "a")
    try:
        assert archive.forget(1.75, 2.0)["pairs"] == 1
        assert [e.pair for e in archive.entries()] == [0, 1, 2, 3]
    finally:
        archive.close()


def test_the_daemons_forget_keeps_a_lone_last_frame_just_before_its_window(tiny_checkpoint, tmp_path):
    """A recording of 47 frames: its 47th archived as a pair of itself. A forget from half a frame interval after it
    leaves it in the archive (its evidence and memory are of a frame before the window); one from it takes it; one
    from the second frame of the pair before takes that pair and not the lone one."""
    pytest.importorskip("fastapi")
    from helpers_server import ended_daemon, kept_config

    with ended_daemon(kept_config(tiny_checkpoint, tmp_path, frames=47), tmp_path / "out.txt") as daemon:
        archive = daemon.session.recall.archive
        assert archive.flush(300)
        entries = archive.entries(daemon.session.recall.stream)
        assert [e.frames for e in entries[-2:]] == [2, 1] and len(entries) == 24
        before, lone = entries[-2], entries[-1]
        frame_s = 1.0 / daemon.config.video.fps
        assert lone.t - before.t == pytest.approx(2 * frame_s)

        result = daemon.forget(lone.t + frame_s / 2, lone.t + 10.0)
        assert result["pairs"] == 0 and result["archive"]["pairs"] == 0
        assert [e.frame for e in archive.entries()] == [e.frame for e in entries]

        result = daemon.forget(before.t + frame_s, before.t + frame_s)  # the second frame of the pair before
        assert result["pairs"] == 1 and result["archive"]["pairs"] == 1
        assert [e.frame for e in archive.entries()] == [e.frame for e in entries[:-2]] + [lone.frame]

        result = daemon.forget(lone.t, lone.t)
        assert result["archive"]["pairs"] == 1
        assert [e.frame for e in archive.entries()] == [e.frame for e in entries[:-2]]
