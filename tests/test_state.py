"""Persistent memory (DESIGN invariant 8): a saved and restored session continues bit for bit; snapshots
of another deployment, truncated or damaged files are refused naming the field or the file; the keeper
keeps at most two generations within its byte bound; kill -9 in the middle of a write loses nothing."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import edgekv
from edgekv.config import StateSection
from edgekv.state import SnapshotError, SnapshotMismatchError, StateKeeper, describe_span, read_manifest

RES = (56, 84)  # 2 x 3 merged tokens per frame pair
FPS = 2.0
QUESTION = "What happened?"


def _frame(index: int, shape=(60, 80)) -> np.ndarray:
    return np.random.default_rng(index).integers(0, 256, size=(*shape, 3), dtype=np.uint8)


def _runtime(model_dir, engine_dir, dtype="fp32", resolution=RES, lm_head="as_loaded", **cache) -> edgekv.Runtime:
    cache = {"policy": "statekv", "sinks": 8, "max_tokens": 120, "text_reserve_tokens": 40, "rebase_position": 40,
             **cache}
    return edgekv.Runtime.from_pretrained(model_dir, model={"dtype": dtype, "device": "cpu", "lm_head": lm_head},
                                          video={"resolution": list(resolution) if resolution else None, "fps": FPS}, cache=cache,
                                          engines={"engine_dir": str(engine_dir)})


def _ingest(session, start: int, stop: int) -> None:
    for index in range(start, stop):
        session.ingest(_frame(index), t=index / FPS)


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")  # where the checkpoint's content hash is memoized


@pytest.fixture(scope="module")
def runtime(tiny_checkpoint, engine_dir):
    return _runtime(tiny_checkpoint, engine_dir)


@pytest.fixture(scope="module")
def snapshot(runtime, tmp_path_factory) -> Path:
    session = runtime.session()
    _ingest(session, 0, 21)  # compressions, a re-base, and frame 20 waiting for its partner
    path = tmp_path_factory.mktemp("snap") / "memory.ekv"
    session.save(path)
    return path


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("policy, sinks, kv_dtype", [("statekv", 8, None), ("infinipot_v", 0, None),
                                                     ("statekv", 8, "int8"), ("infinipot_v", 0, "fp8")])
def test_a_restored_session_answers_bit_identically_to_one_that_never_stopped(tiny_checkpoint, engine_dir, tmp_path,
                                                                             policy, sinks, kv_dtype):
    rt = _runtime(tiny_checkpoint, engine_dir, policy=policy, sinks=sinks, kv_dtype=kv_dtype)
    never_stopped = rt.session()
    _ingest(never_stopped, 0, 41)
    assert never_stopped.counters.compressions >= 2 and never_stopped.rebases >= 1
    assert never_stopped.ingestor.pending is not None  # an unpaired frame is part of the state
    info = never_stopped.save(tmp_path / "s.ekv")
    assert info.frames == 41 and info.cache_tokens == never_stopped.cache.length and info.stream_s == 20.0
    restored = rt.restore(tmp_path / "s.ekv")
    assert restored.restored_from.path == tmp_path / "s.ekv"
    for session in (never_stopped, restored):
        _ingest(session, 41, 90)  # more compressions and re-bases after the restart
    assert torch.equal(restored.question_logits(QUESTION), never_stopped.question_logits(QUESTION))
    assert restored.ask(QUESTION, max_new_tokens=6).token_ids == never_stopped.ask(QUESTION, max_new_tokens=6).token_ids
    timing = {"compression_ms_total", "ingest_ms_total", "ingest_ms_last"}
    mine, theirs = restored.stats(), never_stopped.stats()
    assert {k: v for k, v in mine.items() if k not in timing} == {k: v for k, v in theirs.items() if k not in timing}


def test_restore_takes_the_grid_from_the_snapshot_when_the_config_leaves_it_open(tiny_checkpoint, engine_dir,
                                                                                 tmp_path):
    auto = _runtime(tiny_checkpoint, engine_dir, resolution=None)
    session = auto.session()
    _ingest(session, 0, 4)
    session.save(tmp_path / "auto.ekv")
    restored = auto.restore(tmp_path / "auto.ekv")
    assert restored.preprocessor.resolution == session.preprocessor.resolution
    assert torch.equal(restored.question_logits(QUESTION), session.question_logits(QUESTION))


# ---------------------------------------------------------------------------------------------- refusals
def test_a_snapshot_of_other_weights_names_the_model_hash(snapshot, engine_dir, tmp_path):
    from edgekv.model.tiny import make_tiny_checkpoint

    other = _runtime(make_tiny_checkpoint(tmp_path / "other", preset="tiny", seed=1), engine_dir)
    with pytest.raises(SnapshotMismatchError, match=r"memory\.ekv: made for another deployment — model weights"):
        other.restore(snapshot)


@pytest.mark.parametrize("change, field", [
    ({"dtype": "bf16"}, "model.dtype: snapshot has 'fp32', this deployment 'bf16'"),
    ({"resolution": (84, 56)}, r"video.resolution\): snapshot has \[56, 84\], this deployment \[84, 56\]"),
    ({"max_tokens": 200}, r"cache capacity M in tokens .*snapshot has 120, this deployment 200"),
    ({"policy": "infinipot_v", "sinks": 0}, "cache.policy: snapshot has 'statekv'"),
    ({"kv_dtype": "int8"}, r"cache dtype \(cache.kv_dtype, default model.dtype\): snapshot has 'float32', this deployment 'int8'"),
    ({"lm_head": "int8"}, r"model.lm_head \(the weights the tied embedding reads\): snapshot has 'as_loaded', this deployment 'int8'"),
])
def test_a_snapshot_of_another_deployment_is_refused_with_the_field_named(tiny_checkpoint, engine_dir, snapshot,
                                                                          change, field):
    with pytest.raises(SnapshotMismatchError, match=field):
        _runtime(tiny_checkpoint, engine_dir, **change).restore(snapshot)


def test_a_key_from_before_model_lm_head_reads_as_the_head_as_loaded():
    from edgekv.state import key_differences

    old = {"model_hash": "abc", "dtype": "fp32"}  # a snapshot written before the lm_head field existed
    assert key_differences(old, {**old, "lm_head": "as_loaded"}) == []
    assert key_differences(old, {**old, "lm_head": "int8"}) == [
        "model.lm_head (the weights the tied embedding reads): snapshot has 'as_loaded', this deployment 'int8'"]


def _damaged_copy(snapshot: Path, tmp_path: Path, edit) -> Path:
    data = bytearray(snapshot.read_bytes())
    path = tmp_path / "damaged.ekv"
    path.write_bytes(edit(data))
    return path


def test_a_truncated_snapshot_is_refused_with_its_name(runtime, snapshot, tmp_path):
    for keep in (10, 100, len(snapshot.read_bytes()) // 2, len(snapshot.read_bytes()) - 1):
        path = _damaged_copy(snapshot, tmp_path, lambda data: bytes(data[:keep]))
        with pytest.raises(SnapshotError, match=rf"{path}: (truncated|not an edgekv snapshot)"):
            runtime.restore(path)


def test_a_corrupted_snapshot_is_refused_with_its_name_and_the_part(runtime, snapshot, tmp_path):
    manifest = read_manifest(snapshot)
    k_at = manifest["tensors"]["k"]["offset"] + 5

    def flip(at):
        def edit(data):
            data[at] ^= 0x40
            return bytes(data)
        return edit

    with pytest.raises(SnapshotError, match=rf"{tmp_path / 'damaged.ekv'}: damaged: tensor k does not match"):
        runtime.restore(_damaged_copy(snapshot, tmp_path, flip(k_at)))
    last_tensor = max(manifest["tensors"].values(), key=lambda e: e["offset"])
    in_manifest = last_tensor["offset"] + last_tensor["bytes"] + 10
    with pytest.raises(SnapshotError, match=r"damaged.ekv: damaged: the manifest's sha256"):
        runtime.restore(_damaged_copy(snapshot, tmp_path, flip(in_manifest)))
    with pytest.raises(SnapshotError, match=r"nothing.ekv: no such snapshot file"):
        runtime.restore(tmp_path / "nothing.ekv")


# ---------------------------------------------------------------------------------------------- the keeper
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _keeper(folder: Path, said: list, clock=None, **section) -> StateKeeper:
    return StateKeeper(StateSection(dir=str(folder), **{"every_s": 60.0, **section}), say=said.append,
                       clock=clock or _Clock())


def test_an_unchanged_memory_is_not_written_again(runtime, tmp_path):
    """A daemon paused, at the end of its stream, waiting for a lost camera or only answering questions rewrote the
    same cache every state.every_s (224 MiB at the 3B shape: 65 GB of flash a day for nothing). Now only a memory
    that changed is written; answers (their counters only) are no change; a frame is."""
    said, clock = [], _Clock()
    keeper = _keeper(tmp_path / "state", said, clock)
    session = keeper.restore(runtime)
    _ingest(session, 0, 6)
    clock.now += 61.0
    first = keeper.maybe_snapshot(session)
    assert first is not None and len(keeper.generations()) == 1
    for _ in range(3):  # nothing new, then answers only
        clock.now += 61.0
        assert keeper.maybe_snapshot(session) is None
        session.ask(QUESTION, max_new_tokens=2)
    assert session.counters.questions == 3 and keeper.unchanged == 3
    assert [p.name for p in keeper.generations()] == [first.path.name]
    _ingest(session, 6, 8)  # a frame pair: the memory moved
    clock.now += 61.0
    again = keeper.maybe_snapshot(session)
    assert again is not None and again.path != first.path
    said.clear()
    clock = _Clock()
    keeper = _keeper(tmp_path / "state", said, clock)
    resumed = keeper.restore(runtime)
    assert torch.equal(resumed.question_logits(QUESTION), session.question_logits(QUESTION))
    clock.now += 61.0  # a restarted daemon whose camera has not come back: its memory is the file it read
    assert keeper.maybe_snapshot(resumed) is None and keeper.unchanged == 1


def test_the_keeper_resumes_the_newest_snapshot_and_keeps_two_generations(runtime, tmp_path):
    said, clock = [], _Clock()
    keeper = _keeper(tmp_path / "state", said, clock)
    session = keeper.restore(runtime)
    assert said == [f"no snapshot in {tmp_path / 'state'}: starting with an empty memory"]
    for step in range(5):
        _ingest(session, 6 * step, 6 * step + 6)
        assert keeper.maybe_snapshot(session) is None  # every_s has not passed
        clock.now += 61.0
        assert keeper.maybe_snapshot(session) is not None
        assert len(keeper.generations()) == min(step + 1, 2)
    assert [p.name for p in keeper.generations()] == ["snapshot-00000004.ekv", "snapshot-00000005.ekv"]
    (tmp_path / "state" / ".snapshot-00000006.ekv.tmp-999").write_bytes(b"half a snapshot")  # a crashed write
    said.clear()
    keeper = _keeper(tmp_path / "state", said)
    resumed = keeper.restore(runtime)
    assert said[0].startswith(f"resumed 14 s of memory, {session.cache.length:,} tokens (30 frames;")
    assert torch.equal(resumed.question_logits(QUESTION), session.question_logits(QUESTION))
    assert not list((tmp_path / "state").glob(".*tmp*"))
    # a restarted source stamps its first frame 0 again: the stream goes on after the restored clock
    assert 14.5 <= keeper.stream_time(0.0) < 14.5 + 600
    resumed.ingest(_frame(30), t=keeper.stream_time(0.0))
    assert resumed.counters.frames == 31 and resumed.counters.frame_pairs == 15


def test_an_empty_start_names_the_memory_of_the_other_layout_beside_it(runtime, tmp_path):
    """A deployment that went from one camera to several (video.sources: each camera's memory in state.dir/<name>)
    or back started with an empty memory without a word about the snapshots lying beside it."""
    said: list[str] = []
    root = tmp_path / "state"
    session = _keeper(root, said).restore(runtime)
    _ingest(session, 0, 4)
    _keeper(root, said).snapshot(session)  # a one-camera deployment's memory, in state.dir itself
    said.clear()
    camera = _keeper(root / "front", said)
    camera.camera = "front"  # as apps/daemon/cameras.py sets it
    front = camera.restore(runtime)
    assert said[0].startswith(f"no snapshot in {root / 'front'}: starting with an empty memory ({root} itself holds "
                              f"the memory of a one-camera deployment"), said
    _keeper(root / "front", []).snapshot(front)
    for old in root.glob("snapshot-*.ekv"):
        old.unlink()
    said.clear()
    _keeper(root, said).restore(runtime)
    assert said == [f"no snapshot in {root}: starting with an empty memory ({root} holds the memory of cameras front "
                    f"of a deployment with video.sources, each in its own folder; it is not read without "
                    f"video.sources)"]
    said.clear()
    _keeper(tmp_path / "elsewhere", said).restore(runtime)
    assert said == [f"no snapshot in {tmp_path / 'elsewhere'}: starting with an empty memory"]


def test_the_keeper_falls_back_to_the_older_generation_when_the_newest_is_damaged(runtime, tmp_path):
    said, clock = [], _Clock()
    keeper = _keeper(tmp_path, said, clock)
    session = keeper.restore(runtime)
    _ingest(session, 0, 8)
    keeper.snapshot(session)
    _ingest(session, 8, 12)
    newest = keeper.snapshot(session).path
    newest.write_bytes(newest.read_bytes()[:-100])
    said.clear()
    resumed = _keeper(tmp_path, said).restore(runtime)
    assert resumed.counters.frames == 8
    assert said[1].startswith(f"(newer snapshot {newest.name} skipped: {newest}: truncated")
    assert (tmp_path / "set-aside" / newest.name).is_file()


def test_the_keeper_starts_fresh_on_another_deployment_and_sets_the_snapshot_aside(runtime, tiny_checkpoint,
                                                                                   engine_dir, tmp_path):
    said = []
    keeper = _keeper(tmp_path, said)
    session = keeper.restore(runtime)
    _ingest(session, 0, 6)
    old = keeper.snapshot(session).path
    said.clear()
    other = _runtime(tiny_checkpoint, engine_dir, max_tokens=200)
    fresh = _keeper(tmp_path, said).restore(other)
    assert fresh.counters.frames == 0 and fresh.capacity == 200
    assert said[0].startswith(f"starting with an empty memory: {old}: made for another deployment — cache capacity")
    assert said[0].endswith(f"The old snapshot is kept as {tmp_path / 'set-aside' / old.name}")
    assert not _keeper(tmp_path, []).generations()


def test_a_config_changed_and_changed_back_resumes_the_memory_set_aside(runtime, tiny_checkpoint, engine_dir,
                                                                         tmp_path):
    """cache.max_tokens tried at 200 and put back: the start at 200 set the memory aside; the start back at 120 set
    the 200-token memory aside over it, deleting the one it could have resumed, and started empty."""
    keeper = _keeper(tmp_path, [])
    session = keeper.restore(runtime)
    _ingest(session, 0, 8)
    keeper.snapshot(session)
    other = _runtime(tiny_checkpoint, engine_dir, max_tokens=200)
    keeper = _keeper(tmp_path, [])
    tried = keeper.restore(other)
    _ingest(tried, 0, 4)
    tried_path = keeper.snapshot(tried).path
    said = []
    back = _keeper(tmp_path, said).restore(runtime)
    assert back.counters.frames == 8 and back.capacity == 120, said
    assert torch.equal(back.question_logits(QUESTION), session.question_logits(QUESTION))
    assert said[0].startswith("resumed 4 s of memory") and "set aside earlier" in said[0], said
    aside = list((tmp_path / "set-aside").iterdir())
    assert [read_manifest(p)["key"]["cache_capacity"] for p in aside] == [200] and tried_path.name in said[0]
    assert [p.name for p in _keeper(tmp_path, []).generations()] == ["snapshot-00000002.ekv"]
    said.clear()
    again = _keeper(tmp_path, said).restore(other)  # and the other way again: nothing is lost either
    assert again.counters.frames == 4 and again.capacity == 200, said


def test_the_keeper_refuses_a_byte_bound_that_cannot_hold_two_full_snapshots(runtime, tmp_path):
    with pytest.raises(ValueError, match=r"state.max_mib=0.1 cannot hold two snapshots of a full cache"):
        _keeper(tmp_path, [], max_mib=0.1).restore(runtime)


def test_the_keeper_stays_within_its_byte_bound(runtime, tmp_path):
    keeper = _keeper(tmp_path, [], max_mib=1.0)
    session = keeper.restore(runtime)
    for step in range(4):
        _ingest(session, 4 * step, 4 * step + 4)
        assert keeper.snapshot(session) is not None
        used = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
        assert used <= 1.0 * 2**20 and len(keeper.generations()) <= 2


def test_spans_read_like_a_person_would_say_them():
    assert [describe_span(s) for s in (45, 600, 3 * 3600 + 12 * 60 + 5)] == ["45 s", "10 min", "3 h 12 min"]


# ---------------------------------------------------------------------------------------------- kill -9
# The writers are forked, one at a time, by a parent that loaded the model once: each is still a process of its
# own, with its own file handles, killed with SIGKILL mid-way through its writes, but it starts in milliseconds
# instead of the 3 s of an interpreter, torch and the weights (up to 8 of them per test).
WRITERS = """
import os, sys, traceback
import numpy as np
from edgekv.threads import apply_threads
apply_threads(1)  # before torch computes anything: no OpenMP pool in a process that forks
import edgekv
from edgekv.config import StateSection
from edgekv.state import StateKeeper

model, folder, engine_dir, key_file = sys.argv[1:5]
rt = edgekv.Runtime.from_pretrained(model, model={"dtype": "fp32", "device": "cpu"},
                                    video={"resolution": [224, 224], "fps": 2.0},
                                    cache={"policy": "infinipot_v", "max_tokens": 2048, "text_reserve_tokens": 64},
                                    engines={"engine_dir": engine_dir}, privacy={"key_file": key_file or None})


def write_forever():  # what the daemon does, with far more snapshots: a new frame every fourth one
    keeper = StateKeeper(StateSection(dir=folder, every_s=1e-9, max_mib=64), say=lambda line: None)
    session = keeper.restore(rt)
    index = session.counters.frames
    written = 0
    while True:
        if written % 4 == 0:
            session.ingest(np.random.default_rng(index).integers(0, 256, size=(60, 80, 3), dtype=np.uint8), t=index / 2.0)
            index += 1
        keeper.snapshot(session)
        written += 1
        print("saved", index, flush=True)


for _ in sys.stdin:  # a line: fork a writer; say its pid before it writes, and how it ended once it is reaped
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_write)
        os.read(go_read, 1)
        try:
            write_forever()
        except BaseException:
            traceback.print_exc()
        os._exit(1)
    os.close(go_read)
    print("writer", pid, flush=True)
    os.write(go_write, b"go")
    os.close(go_write)
    print("reaped", pid, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class Writers:
    """The parent of WRITERS and what its writers said: ``saved[pid]`` (the frame count after each write they
    announced whole) and ``exits[pid]`` (the exit code, once reaped: every line of that writer is read by then)."""

    def __init__(self, log: Path, *args: str) -> None:
        self.log_path = log
        self._log = open(log, "w")
        self.parent = subprocess.Popen([sys.executable, "-c", WRITERS, *args], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.changed = threading.Condition()
        self.saved: dict[int, list[int]] = {}
        self.exits: dict[int, int] = {}
        self.closed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        current = None
        for line in self.parent.stdout:
            with self.changed:
                # a line torn by the kill ("saved" or "saved 1" of "saved 12", no newline) was never announced
                # whole, and runs into the parent's next line
                if (saved := re.fullmatch(r"saved (\d+)\n", line)) and current is not None:
                    self.saved[current].append(int(saved.group(1)))
                elif started := re.fullmatch(r"writer (\d+)\n", line):
                    current = int(started.group(1))
                    self.saved[current] = []
                elif reaped := re.search(r"reaped (\d+) (-?\d+)\n$", line):
                    self.exits[int(reaped.group(1))] = int(reaped.group(2))
                self.changed.notify_all()
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def wait(self, condition, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: condition() or self.closed, timeout) and condition()

    def start(self) -> int:
        known = set(self.saved)
        self.parent.stdin.write("\n")
        self.parent.stdin.flush()
        assert self.wait(lambda: set(self.saved) - known, 300), self.log_path.read_text()[-4000:]
        (pid,) = set(self.saved) - known
        return pid

    def __enter__(self) -> "Writers":
        return self

    def __exit__(self, *exc) -> None:
        for pid in set(self.saved) - set(self.exits):
            os.kill(pid, signal.SIGKILL)
        self.parent.stdin.close()
        try:
            self.parent.wait(60)
        finally:
            if self.parent.poll() is None:
                self.parent.kill()
                self.parent.wait(10)
            self._reader.join(10)
            self._log.close()


@pytest.mark.slow
@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "encrypted"])
def test_kill_9_during_snapshot_writes_leaves_the_previous_one_loadable(tiny_checkpoint, engine_dir, tmp_path, sealed):
    if sealed:
        pytest.importorskip("cryptography", reason="cryptography not installed (pip install 'edgekv[privacy]')")
    folder = tmp_path / "state"
    key_file = ""
    if sealed:
        key_file = str(tmp_path / "memory.key")
        Path(key_file).write_bytes(os.urandom(32))
    rng = random.Random(12)
    rt = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"dtype": "fp32", "device": "cpu"},
                                        video={"resolution": [224, 224], "fps": 2.0},
                                        cache={"policy": "infinipot_v", "max_tokens": 2048, "text_reserve_tokens": 64},
                                        engines={"engine_dir": str(engine_dir)}, privacy={"key_file": key_file or None})
    interrupted, kills, frames = 0, 0, 0
    most, enough = (6, 2) if sealed else (8, 4)
    with Writers(tmp_path / "writers.log", str(tiny_checkpoint), str(folder), str(engine_dir), key_file) as writers:
        while kills < most and (interrupted < (1 if sealed else 2) or kills < enough):
            child = writers.start()
            deadline = time.monotonic() + 120
            assert writers.wait(lambda: len(writers.saved[child]) >= 2 or child in writers.exits, 120)
            assert len(writers.saved[child]) >= 2, (writers.log_path.read_text()[-4000:] if child in writers.exits
                                                    else "the writer never saved")
            if kills % 2 == 0:  # the moment a write is under way (its temporary file exists) ...
                while not list(folder.glob(".snapshot-*.tmp-*")) and time.monotonic() < deadline:
                    time.sleep(0.0005)
                time.sleep(rng.uniform(0.0, 0.002))
            else:  # ... or anywhere in the loop
                time.sleep(rng.uniform(0.0, 0.15))
            os.kill(child, signal.SIGKILL)
            assert writers.wait(lambda: child in writers.exits, 30)
            assert writers.exits[child] == -signal.SIGKILL  # it was writing until the kill
            saved = writers.saved[child]
            kills += 1
            interrupted += bool(list(folder.glob(".snapshot-*.tmp-*")))  # killed with a write under way
            said: list[str] = []
            session = StateKeeper(StateSection(dir=str(folder), every_s=1.0, max_mib=64), say=said.append).restore(rt)
            assert said[0].startswith("resumed"), said
            assert saved[-1] <= session.counters.frames <= saved[-1] + 1  # the last announced write, or one after
            assert session.counters.frames >= frames  # memory only ever grows across restarts
            assert not (folder / "set-aside").exists() and len(list(folder.glob("snapshot-*.ekv"))) <= 2
            frames = session.counters.frames
    assert interrupted >= 1, f"none of {kills} kills landed during a write"
    if sealed:
        assert all(p.read_bytes().startswith(b"EDGEKV-SNAPSEAL") for p in folder.glob("snapshot-*.ekv"))
    reference = rt.session()
    for index in range(frames):
        reference.ingest(np.random.default_rng(index).integers(0, 256, size=(60, 80, 3), dtype=np.uint8), t=index / 2.0)
    assert torch.equal(session.question_logits(QUESTION), reference.question_logits(QUESTION))
