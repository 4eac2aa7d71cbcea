"""The library as a robot's Python code uses it: re-entrant callbacks, dropped sessions, argument types. Each test
is a probe that once misbehaved (a corrupted session, a folder locked for the process's life, an error that named
no argument); the shipped toy model at 112x112 keeps each one well under a second."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

import edgekv
from edgekv.config import ConfigError

RES = [112, 112]


def _frames(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(*RES, 3), dtype=np.uint8) for _ in range(count)]


def _runtime(**sections) -> edgekv.Runtime:
    return edgekv.Runtime.from_pretrained("builtin:toy", cache={"max_tokens": 1024}, video={"resolution": RES},
                                          runtime={"threads": 1}, **sections)


@pytest.fixture(scope="module")
def runtime() -> edgekv.Runtime:
    torch.set_num_threads(1)
    return _runtime()


def _session(runtime, frames: int = 8):
    session = runtime.session()
    for i, frame in enumerate(_frames(frames)):
        session.ingest(frame, t=i * 0.5)
    return session


def _memory(session) -> tuple:
    stats = session.stats()
    return (session.cache.length, stats["frames"], stats["frame_pairs"], sorted(session.pair_times))


def _ask_calling(session, call):
    """Ask with an ``on_token`` that calls ``call(session)`` at the first token."""
    calls = []

    def on_token(token: int) -> None:
        if not calls:
            calls.append(token)
            call(session)

    return session.ask("What is there?", max_new_tokens=3, on_token=on_token)


def test_on_token_ingest_is_refused_and_the_frames_go_in_after(runtime):
    """An ingest from inside an answer wrote its pair after the question's tokens; the answer's cleanup cut it
    off, yet the frames, the pair and its time were counted: memory said 5 pairs, the cache held 4."""
    session = _session(runtime)
    before = _memory(session)
    late = _frames(2, seed=1)
    with pytest.raises(RuntimeError, match="ingest: called while this session is answering"):
        _ask_calling(session, lambda s: s.ingest(late[0], t=4.0))
    assert _memory(session) == before
    session.ingest(late[0], t=4.0)
    result = session.ingest(late[1], t=4.5)
    assert result.pair_index == 4 and 4 in session.pair_times
    assert session.cache.length == before[0] + result.tokens_added
    assert session.ask("What is there?", max_new_tokens=2).token_ids


def test_on_token_save_is_refused_so_no_snapshot_holds_the_question(runtime, tmp_path):
    """A snapshot saved from inside an answer held the question's tokens as part of the stream's memory."""
    session = _session(runtime)
    path = tmp_path / "s.snap"
    with pytest.raises(RuntimeError, match="save"):
        _ask_calling(session, lambda s: s.save(path))
    assert not path.exists()
    session.save(path)
    restored = runtime.restore(path)
    assert restored.cache.length == session.cache.length
    restored.close()


@pytest.mark.parametrize("call", [lambda s: s.forget(0.0, 1.0), lambda s: s.reset(),
                                  lambda s: s.ask("Again?", max_new_tokens=1), lambda s: s.probe("Red?"),
                                  lambda s: s.finish_pair()], ids=["forget", "reset", "ask", "probe", "finish_pair"])
def test_on_token_calls_that_change_the_cache_are_refused(runtime, call):
    """A forget or reset inside an answer broke its cleanup ("cannot truncate a cache of 56 slots to 79")."""
    session = _session(runtime)
    before = _memory(session)
    with pytest.raises(RuntimeError, match="while this session is answering"):
        _ask_calling(session, call)
    assert _memory(session) == before
    frames = []
    _ask_calling(session, lambda s: frames.append(s.stats()["frames"]))  # reading stays allowed
    assert frames == [before[1]]


def test_a_dropped_session_lets_go_of_its_archive_folder(tmp_path):
    """Dropped without close(), a session's archive kept archive.dir locked (and its writer thread running) for
    the life of the process: the writer thread held the archive. Its queued pairs are written when it goes."""
    def writers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "edgekv-archive-writer" and t.is_alive()}

    others = writers()  # another test's in this process (a session it never closed) are not this one's
    runtime = _runtime(archive={"dir": str(tmp_path / "archive")})
    session = _session(runtime, frames=4)
    del session
    gc.collect()
    again = runtime.session()
    try:
        assert again.stats()["archive_pairs"] == 2
    finally:
        again.close()
    assert not writers() - others


def test_seed_takes_numpy_integers_and_names_itself_when_wrong(runtime):
    session = _session(runtime)
    sampled = dict(max_new_tokens=3, temperature=1.0)
    assert (session.ask("What?", seed=np.int64(7), **sampled).token_ids
            == session.ask("What?", seed=7, **sampled).token_ids)
    for seed in (1.5, "1", True, 2**70):
        with pytest.raises(ValueError, match="seed"):
            session.ask("What?", seed=seed, **sampled)


@pytest.mark.parametrize("name", ["temperature", "top_p"])
def test_sampling_numbers_given_as_strings_are_refused_by_name(runtime, name):
    """``float("0.5")`` passed the range check; the string then failed in sampling, naming nothing."""
    session = _session(runtime, frames=2)
    before = _memory(session)
    with pytest.raises(ValueError, match=name):
        session.ask("What?", max_new_tokens=2, **{"temperature": 1.0, name: "0.5"})
    assert _memory(session) == before


def test_from_config_takes_a_dict_and_names_a_wrong_type():
    runtime = edgekv.Runtime.from_config({"model": {"path": "builtin:toy"}, "cache": {"max_tokens": 1024},
                                          "runtime": {"threads": 1}})
    assert runtime.config.cache.max_tokens == 1024
    with pytest.raises(ConfigError, match=r"cache\.max_token: unknown key"):
        edgekv.Runtime.from_config({"model": {"path": "builtin:toy"}, "cache": {"max_token": 1024}})
    with pytest.raises(TypeError, match="from_config"):
        edgekv.Runtime.from_config(3)
    with pytest.raises(ConfigError, match="model: expected a mapping"):
        edgekv.Runtime.from_pretrained("builtin:toy", model="fp32")


def test_save_to_a_folder_is_refused_before_writing(runtime, tmp_path):
    session = _session(runtime, frames=3)
    with pytest.raises(IsADirectoryError, match="save takes the snapshot file's path"):
        session.save(tmp_path)
    assert list(tmp_path.parent.glob(f".{tmp_path.name}.tmp-*")) == []
    assert session.save(tmp_path / "s.snap").frames == 3


def test_recall_must_be_a_bool(runtime):
    """``ask(recall="no")`` was truthy: a session with an archive recalled, one without said it needs an archive."""
    session = _session(runtime, frames=2)
    for recall in ("no", 0, 1):
        with pytest.raises(ValueError, match="recall must be True, False or None"):
            session.ask("What?", max_new_tokens=2, recall=recall)
    assert session.ask("What?", max_new_tokens=2, recall=np.False_).text == session.ask(
        "What?", max_new_tokens=2, recall=False).text
