"""Flat for weeks: nothing a session keeps grows with the stream (no per-frame or per-compression list),
and process RSS stays flat over 8,000 frame pairs once warmed up (`edgekv bench soak` runs the hour-long version)."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import edgekv


def _container_sizes(root, prefix: str = "session") -> dict[str, int]:
    """len() of every list, dict, set and deque reachable from ``root`` through edgekv objects."""
    sizes: dict[str, int] = {}
    seen: set[int] = set()

    def walk(value, path: str) -> None:
        if id(value) in seen or isinstance(value, (torch.Tensor, np.ndarray, str, bytes)):
            return
        seen.add(id(value))
        if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
            sizes[path] = len(value)
            for index, item in enumerate(value):
                walk(item, f"{path}[{index}]")
        elif isinstance(value, dict):
            sizes[path] = len(value)
            for key, item in value.items():
                walk(item, f"{path}[{key!r}]")
        elif type(value).__module__.startswith("edgekv") and hasattr(value, "__dict__"):
            for name, item in vars(value).items():
                if name not in ("runtime", "model", "vision", "llm", "tokenizer"):  # shared, loaded once
                    walk(item, f"{path}.{name}")

    walk(root, prefix)
    return sizes


def test_no_container_of_a_session_grows_with_the_stream(tiny_checkpoint):
    rt = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"dtype": "fp32", "device": "cpu"},
                                        video={"resolution": [56, 56], "fps": 2.0},
                                        cache={"policy": "statekv", "sinks": 8, "max_tokens": 96,
                                               "text_reserve_tokens": 32, "rebase_position": 60})
    session = rt.session()
    frames = [np.random.default_rng(i).integers(0, 256, size=(56, 56, 3), dtype=np.uint8) for i in range(16)]

    def stream(start: int, stop: int) -> None:
        for index in range(start, stop):
            session.ingest(frames[index % len(frames)], t=index / 2.0)
            if index % 50 == 49:
                session.ask("What is there?", max_new_tokens=2)

    stream(0, 200)
    warm = _container_sizes(session)
    compressions = session.counters.compressions
    stream(200, 600)
    assert session.counters.compressions > compressions + 10 and session.rebases > 0
    assert session.policy.cv_count == session.counters.compressions
    # the time of each frame pair some slot still holds: bounded by the cache's slots, not by the stream
    # (heads keep different pairs, so the set fills up to its bound over a longer warm-up than the others)
    held = set(torch.unique(session.cache.frame[:, :, :session.cache.length]).tolist())
    assert set(session.pair_times) <= held and len(session.pair_times) <= session.cache.frame.numel()
    assert 0 < len(session.pair_times) < session.counters.frame_pairs  # pairs no slot holds are pruned
    assert set(session.pair_ends) == set(session.pair_times)  # each held pair's second frame's time: the same bound
    grown = {path: (size, _container_sizes(session).get(path)) for path, size in warm.items()
             if _container_sizes(session).get(path) != size and path not in ("session.pair_times", "session.pair_ends")}
    assert not grown, f"containers that grew with the stream: {grown}"
    assert "session.policy.cv_sums" in warm  # the walk reaches the policy's state


SOAK = """
import json, sys
import torch
torch.set_num_threads(1)
import edgekv
from edgekv.apps.bench.soak import frame_pool, soak

rt = edgekv.Runtime.from_pretrained(sys.argv[1], model={"dtype": "fp32", "device": "cpu"},
                                    video={"resolution": [56, 56], "fps": 2.0},
                                    cache={"policy": "infinipot_v", "max_tokens": 256, "text_reserve_tokens": 64})
report = soak(rt.session(), frame_pool((56, 56)), 2.0, pairs=int(sys.argv[2]), ask_every=1000, answer_tokens=8,
              sample_every_pairs=200)
print(json.dumps({"summary": report.summary(), "samples": report.samples}))
"""


@pytest.mark.slow
def test_rss_is_flat_over_8000_frame_pairs(tiny_checkpoint):
    """After warm-up (the first third of the run) RSS grows by at most 0.5 % to the end."""
    out = subprocess.run([sys.executable, "-c", SOAK, str(tiny_checkpoint), "8000"], capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    summary = result["summary"]
    assert summary["pairs"] == 8000 and summary["errors"] == 0, summary["error_messages"]
    assert summary["compressions"] > 400 and summary["questions"] == 8
    assert len(summary["cache_bytes"]) == 1  # allocated once, never changed
    assert summary["warmup_at_pair"] <= 3000
    growth = summary["rss_max_after_warmup_mb"] / summary["rss_after_warmup_mb"] - 1.0
    assert growth <= 0.005, f"RSS grew {100 * growth:.2f} % after warm-up: {summary}"
