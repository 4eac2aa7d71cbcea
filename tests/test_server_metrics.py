"""/metrics through prometheus_client: a registry per daemon, seconds not milliseconds, histograms that
saw every frame pair and answer, exact counters, build info."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from edgekv.config import EdgeKVConfig
from helpers_server import RunningDaemon, call, chat, frozen, server_config

parser = pytest.importorskip("prometheus_client.parser")
pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def running(tiny_checkpoint, tmp_path_factory):
    with RunningDaemon(server_config(tiny_checkpoint), tmp_path_factory.mktemp("metrics") / "out.txt") as run:
        yield run


def scrape(port: int) -> dict:
    status, headers, body = call(port, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    return {family.name: family for family in parser.text_string_to_metric_families(body.decode())}


def sample(families: dict, family: str, suffix: str = "", **labels) -> float:
    for s in families[family].samples:
        if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(family + suffix)


def test_counters_are_exact_and_histograms_saw_every_pair(running, monkeypatch):
    with frozen(running, monkeypatch):
        families = scrape(running.port)
        stats = running.daemon.session.stats()
    assert sample(families, "edgekv_frames", "_total") == stats["frames"]
    assert sample(families, "edgekv_frame_pairs", "_total") == stats["frame_pairs"]
    assert sample(families, "edgekv_pairs_skipped", "_total") == stats["pairs_skipped"]
    assert sample(families, "edgekv_cache_capacity_bytes") == stats["cache_capacity_bytes"]
    assert sample(families, "edgekv_cache_tokens") == stats["cache_tokens"]
    # the server started before the first frame: its histogram observed every pair, in seconds
    assert sample(families, "edgekv_frame_pair_ingest_seconds", "_count") == stats["frame_pairs"]
    assert sample(families, "edgekv_frame_pair_ingest_seconds", "_sum") == pytest.approx(
        stats["ingest_ms_total"] / 1e3, rel=1e-9)
    assert sample(families, "edgekv_compression_seconds", "_count") == stats["compressions"]
    assert sample(families, "edgekv_stream_state", state="running") == 1.0
    assert sample(families, "edgekv_stream_state", state="ended") == 0.0
    assert not [name for name in families if name.endswith("_ms")]
    build = families["edgekv_build_info"].samples[0].labels
    assert build["version"] and build["policy"] == "infinipot_v" and build["llm_backend"] == "torch"
    assert build["decode_route"] == stats["decode_route"] in ("eager", "native")


def test_answers_feed_the_ttft_and_decode_histograms(running):
    before = scrape(running.port)
    status, _, _ = chat(running.port, "What moved?", max_tokens=4)
    assert status == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = scrape(running.port)
        if sample(after, "edgekv_time_to_first_token_seconds", "_count") > \
                sample(before, "edgekv_time_to_first_token_seconds", "_count"):
            break
        time.sleep(0.05)
    count = "_count"
    assert sample(after, "edgekv_time_to_first_token_seconds", count) == \
        sample(before, "edgekv_time_to_first_token_seconds", count) + 1
    assert sample(after, "edgekv_time_per_output_token_seconds", count) == \
        sample(before, "edgekv_time_per_output_token_seconds", count) + 1
    assert sample(after, "edgekv_answer_tokens", "_total") >= sample(before, "edgekv_answer_tokens", "_total") + 4


# ---------------------------------------------------------------------------------------------- units
class StubSession:
    grid = None

    def __init__(self, frames: int) -> None:
        self.counters = SimpleNamespace(frames=frames)
        self._frames = frames

    def stats(self) -> dict:
        return {"frames": self._frames, "frame_pairs": self._frames // 2, "frames_rejected": 0, "compressions": 3,
                "questions": 0, "answer_tokens": 0, "cache_tokens": 10, "cache_capacity_tokens": 6144,
                "cache_capacity_bytes": 1449984, "policy": "full", "vision_backend": "torch", "llm_backend": "torch"}


def stub_daemon(frames: int) -> SimpleNamespace:
    ready = threading.Event()
    ready.set()
    return SimpleNamespace(session=StubSession(frames), lock=threading.RLock(), monitor=None, sampler=None,
                           config=EdgeKVConfig(), started=time.monotonic(), stop=False, ready=ready,
                           questions=SimpleNamespace(qsize=lambda: 0))


def test_large_counters_are_written_exactly():
    from edgekv.apps.server.telemetry import Telemetry

    for frames in (1449984, 123456789, 2**53):
        text = Telemetry(stub_daemon(frames)).exposition()[0].decode()
        families = {f.name: f for f in parser.text_string_to_metric_families(text)}
        assert sample(families, "edgekv_frames", "_total") == frames  # every digit kept (Go float notation)
        assert sample(families, "edgekv_cache_capacity_bytes") == 1449984
        assert "1.44998e+06" not in text  # the old %.6g rounding


def test_openmetrics_when_the_scraper_asks(running):
    status, headers, body = call(running.port, "GET", "/metrics",
                                 headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200 and headers["content-type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


def test_each_daemon_has_its_own_registry():
    from edgekv.apps.server.telemetry import Telemetry

    first, second = Telemetry(stub_daemon(10)), Telemetry(stub_daemon(20))
    first.pair_ingested(SimpleNamespace(pair_index=0, ms=250.0, compression_ms=40.0))
    one = {f.name: f for f in parser.text_string_to_metric_families(first.exposition()[0].decode())}
    two = {f.name: f for f in parser.text_string_to_metric_families(second.exposition()[0].decode())}
    assert sample(one, "edgekv_frame_pair_ingest_seconds", "_sum") == 0.25
    assert sample(one, "edgekv_compression_seconds", "_sum") == 0.04
    assert sample(two, "edgekv_frame_pair_ingest_seconds", "_count") == 0
    assert sample(one, "edgekv_frames", "_total") == 10 and sample(two, "edgekv_frames", "_total") == 20
