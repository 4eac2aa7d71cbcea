"""The daemon's figures for ``/metrics`` (Prometheus, through ``prometheus_client``) and the status page.

One ``Telemetry`` per daemon, with its own ``CollectorRegistry`` (two daemons in one process never share
a metric). Units are Prometheus': seconds and bytes. Counters are exported exactly (the client library
writes ``1449984.0``, never a rounded ``1.44998e+06``).

- Histograms are observed as things happen: the daemon calls ``pair_ingested(result)`` after every frame
  pair and ``question_answered(question)`` after every answer from any channel (stdin, HTTP, voice).
- Counters and gauges are read from the session at scrape time (``DaemonCollector``), from a snapshot
  taken under the daemon's lock. The main loop holds that lock for a whole ingest or answer, so a
  scrape waits at most ``SNAPSHOT_WAIT_S`` and otherwise serves the previous snapshot (its age is on the
  status page): neither the page nor Prometheus ever waits for an answer to finish.
- A sampler thread records memory and the frame count once a second (``series``), for the page's
  memory-over-time sparkline and the recent ingest rate.
"""

from __future__ import annotations

import platform
import threading
import time
from collections import deque
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

SNAPSHOT_WAIT_S = 0.25
FRESH_S = 0.5  # a snapshot or an exposition this young is served again: readers hammering the page cost no work
SERIES_POINTS = 600  # ten minutes at one point a second
RATE_WINDOW_S = 10.0
QUESTIONS_KEPT = 64
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Telemetry:
    def __init__(self, daemon: Any, sample_interval_s: float = 1.0) -> None:
        self.daemon = daemon
        self.registry = CollectorRegistry()
        self.ingest = Histogram("edgekv_frame_pair_ingest_seconds", "wall time to ingest one frame pair (vision, "
                                "prefill, compression)", buckets=STEP_BUCKETS, registry=self.registry)
        self.compression = Histogram("edgekv_compression_seconds", "wall time of one cache compression",
                                     buckets=STEP_BUCKETS, registry=self.registry)
        self.ttft = Histogram("edgekv_time_to_first_token_seconds", "question prefill to first answer token",
                              buckets=STEP_BUCKETS, registry=self.registry)
        self.per_token = Histogram("edgekv_time_per_output_token_seconds", "mean decode time per answer token "
                                   "after the first, one observation per answer", buckets=TOKEN_BUCKETS,
                                   registry=self.registry)
        self.registry.register(DaemonCollector(self))
        # process_resident_memory_bytes, process_cpu_seconds_total, open fds, start time: the standard names
        # every Prometheus dashboard knows, from /proc (Linux; nothing where /proc is missing)
        ProcessCollector(registry=self.registry)
        self.series: deque[tuple[float, int, float | None]] = deque(maxlen=SERIES_POINTS)  # (t, frames, rss MiB)
        self.answered: deque[dict] = deque(maxlen=QUESTIONS_KEPT)
        self.last_answer: dict | None = None
        self._snapshot: dict | None = None
        self._snapshot_at = 0.0
        self._expositions: dict[tuple[str, bool], tuple[float, bytes]] = {}  # (type, public) -> (when, body)
        self._interval = sample_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ hooks the daemon calls
    def pair_ingested(self, result: Any) -> None:
        """After ``session.ingest`` returned a result that prefilled a pair (``result.pair_index`` set)."""
        if getattr(result, "pair_index", None) is None:
            return
        self.ingest.observe(result.ms / 1e3)
        if result.compression_ms > 0:
            self.compression.observe(result.compression_ms / 1e3)

    def question_answered(self, question: Any) -> None:
        """After a question from any channel was answered or refused (``question.done`` set or about to be)."""
        answer = question.answer
        record = {"source": question.source, "question": question.text, "asked_at": getattr(question, "asked_at", None),
                  "answered_at": time.time(), "answer": None, "error": None, "tokens": 0, "ttft_s": None,
                  "decode_tok_s": None, "finish_reason": None}
        if question.error is not None or answer is None:
            record["error"] = str(question.error)
        else:
            self.ttft.observe(answer.ttft_s)
            if len(answer.token_ids) > 1 and answer.decode_tok_s > 0:
                self.per_token.observe(1.0 / answer.decode_tok_s)
            # the whole reply, its given start too (continue_final_message), as the console's A: line shows it
            record.update(answer=getattr(question, "answer_prefix", "") + answer.text,
                          tokens=len(answer.token_ids), ttft_s=answer.ttft_s,
                          decode_tok_s=answer.decode_tok_s, finish_reason=answer.finish_reason)
            self.last_answer = record
        self.answered.append(record)

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> dict:
        """Session stats + kept-patch map + monitor + capture figures, at most ``SNAPSHOT_WAIT_S`` old
        when the main loop is between steps, else the last one taken (``age_s`` says how old)."""
        daemon = self.daemon
        if self._snapshot is not None and time.monotonic() - self._snapshot_at < FRESH_S:
            return {**self._snapshot, "age_s": time.monotonic() - self._snapshot_at}
        if daemon.session is not None and daemon.lock.acquire(timeout=SNAPSHOT_WAIT_S):
            try:
                stats, kept = daemon.session.stats(), kept_patch_map(daemon.session)
            finally:
                daemon.lock.release()
            self._snapshot, self._snapshot_at = {"stats": stats, "kept": kept}, time.monotonic()
        if self._snapshot is None:  # the very first step is still running
            return {"stats": None, "kept": {"rows": 0, "cols": 0, "kept": []}, "age_s": None}
        return {**self._snapshot, "age_s": time.monotonic() - self._snapshot_at}

    def snapshot_fresh(self) -> bool:
        """A snapshot younger than ``FRESH_S`` is there (``snapshot()`` returns it without work)."""
        return self._snapshot is not None and time.monotonic() - self._snapshot_at < FRESH_S

    def exposition_fresh(self, accept: str | None = None, public: bool = False) -> bool:
        _, content_type = choose_encoder(accept or "")
        cached = self._expositions.get((content_type, public))
        return cached is not None and time.monotonic() - cached[0] < FRESH_S

    def monitor(self) -> dict:
        return self.daemon.monitor.snapshot() if self.daemon.monitor is not None else {}

    def capture(self) -> dict:
        sampler = self.daemon.sampler
        return sampler.stats() if sampler is not None else {}

    def exposition(self, accept: str | None = None, public: bool = False) -> tuple[bytes, str]:
        """The metrics in the format the scraper asks for (``Accept``: Prometheus text or OpenMetrics); one
        rendered less than ``FRESH_S`` ago is served again (a scraper polls every 15 s; a flood costs nothing).
        ``public``: for a scraper without the token (``server.metrics_public``), without ``PRIVATE_FAMILIES``;
        each kind is kept apart, so a public scrape is never served the one rendered for the token's holder."""
        encoder, content_type = choose_encoder(accept or "")
        cached = self._expositions.get((content_type, public))
        if cached is not None and time.monotonic() - cached[0] < FRESH_S:
            return cached[1], content_type
        body = encoder(PublicRegistry(self.registry) if public else self.registry)
        self._expositions[content_type, public] = (time.monotonic(), body)
        return body, content_type

    # ------------------------------------------------------------------ time series
    def start(self) -> "Telemetry":
        self._thread = threading.Thread(target=self._sample_loop, name="edgekv-telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _sample_loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def sample(self) -> None:
        session = self.daemon.session
        if session is None:
            return
        self.series.append((time.monotonic(), session.counters.frames, self.monitor().get("process_rss_mb")))

    def ingest_fps(self, window_s: float = RATE_WINDOW_S) -> float | None:
        """Frames ingested per second over the last ``window_s`` seconds of samples."""
        points = list(self.series)
        if len(points) < 2:
            return None
        newest = points[-1]
        oldest = next((p for p in points if newest[0] - p[0] <= window_s), points[0])
        span = newest[0] - oldest[0]
        return (newest[1] - oldest[1]) / span if span > 0 else None

    def series_for_page(self) -> dict:
        points = list(self.series)
        now = time.monotonic()
        return {"ago_s": [round(now - t, 1) for t, _, _ in points], "rss_mb": [m for _, _, m in points]}


def _redact(source: Any) -> str:
    """``video.source`` without a camera's password (edgekv.video.sources.redact)."""
    from edgekv.video.sources import redact

    return redact(source)


def _disk_write_bytes() -> int | None:
    """This process's bytes written to storage (psutil's ``io_counters``: /proc/self/io on Linux), or None where
    the platform does not count them."""
    try:
        import psutil

        return int(psutil.Process().io_counters().write_bytes)
    except (AttributeError, OSError, ImportError):
        return None
    except Exception:  # psutil.AccessDenied and the like: the metric is left out, the scrape goes on
        return None


# Left out of a scrape without the token (server.metrics_public): they say by name when the wearer paused the camera
# (``state="paused"``), which /healthz tells only the token's holder. The other figures stay: a monitor needs them,
# and they say that no frame came in for a while (a pause, or a camera out of reach), not which.
PRIVATE_FAMILIES = frozenset({"edgekv_stream_state", "edgekv_camera_stream_state"})


class PublicRegistry:
    """A registry as a scraper without the token sees it: every family but ``PRIVATE_FAMILIES``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Any]:
        return (family for family in self.registry.collect() if family.name not in PRIVATE_FAMILIES)


class DaemonCollector:
    """Counters and gauges read at scrape time (see ``Telemetry.snapshot``)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry

    def describe(self) -> list:
        return []  # names are only known at scrape time (optional power metrics)

    def collect(self) -> Iterator[Any]:
        t = self.telemetry
        daemon = t.daemon
        snap = t.snapshot()
        stats, mon, cap = snap["stats"], t.monitor(), t.capture()
        if stats is None:
            return
        yield _info(daemon, stats)
        counters = [
            ("edgekv_frames", "frames ingested", stats["frames"]),
            ("edgekv_frame_pairs", "frame pairs prefilled", stats["frame_pairs"]),
            ("edgekv_pairs_skipped", "near-duplicate frame pairs skipped before the vision tower",
             stats.get("pairs_skipped", 0)),
            ("edgekv_frames_rejected", "frames refused as bad input", stats["frames_rejected"]),
            ("edgekv_clock_jumps", "timestamps that jumped, taken as bounded gaps (video.max_gap_s)",
             stats.get("clock_jumps", 0)),
            ("edgekv_frames_dropped", "frames the capture dropped (latest frame wins)", cap.get("frames_dropped", 0)),
            ("edgekv_frames_decoded", "frames the capture converted to pixels (only those the sampler may take)",
             cap.get("frames_decoded", 0)),
            ("edgekv_compressions", "cache compressions", stats["compressions"]),
            ("edgekv_tokens_evicted", "cache tokens evicted", stats.get("tokens_evicted", 0)),
            ("edgekv_questions", "questions answered", stats["questions"]),
            ("edgekv_answer_tokens", "answer tokens generated", stats["answer_tokens"]),
        ]
        if mon.get("energy_j") is not None:
            counters.append(("edgekv_energy_joules", "board energy since start", mon["energy_j"]))
        if "archive_pairs" in stats:  # archive: in the YAML (edgekv/archive)
            counters += [
                ("edgekv_archive_dropped", "frame pairs not archived (staging full, or a write that failed)",
                 stats["archive_dropped"]),
                ("edgekv_archive_write_errors", "archive writes that failed (disk full, I/O errors)",
                 stats.get("archive_write_errors", 0)),
                ("edgekv_archive_bad_records", "damaged archive records skipped (failed their checksum)",
                 stats.get("archive_bad_records", 0)),
                ("edgekv_archive_segments_yielded", "oldest archive segments deleted to keep archive.keep_free_gib "
                 "free on the disk", stats.get("archive_segments_yielded", 0)),
                ("edgekv_recalls", "questions answered with recall from the archive", stats["recalls"]),
                ("edgekv_recall_seconds", "time spent recalling (probe + select + read)",
                 stats["recall_ms_total"] / 1e3),
            ]
        frames = getattr(daemon, "frames", None)  # evidence frames on disk (archive.frames_mib)
        frame_stats = frames.stats() if frames is not None else None
        if frame_stats is not None:
            counters += [
                ("edgekv_evidence_frames_written", "evidence frames written to disk", frame_stats["frames_written"]),
                ("edgekv_evidence_frames_dropped", "evidence frames dropped (the writer's queue was full)",
                 frame_stats["frames_dropped"]),
                ("edgekv_evidence_frames_write_errors", "evidence frames that failed to write (disk full, I/O, "
                 "archive.keep_free_gib)", frame_stats["frames_write_errors"]),
            ]
        tls_counts = getattr(getattr(daemon, "server", None), "tls_counts", None)  # server.tls_cert_file: HTTPS
        if tls_counts is not None:
            counters += [
                ("edgekv_tls_handshakes", "HTTPS handshakes completed", tls_counts.done),
                ("edgekv_tls_handshakes_failed", "HTTPS handshakes failed: refused or missing client certificates, "
                 "clients that never finished within server.request_timeout_s, plain HTTP sent to the port",
                 tls_counts.failed),
            ]
        keeper = getattr(daemon, "state", None)  # persistent memory (state.dir)
        if keeper is not None and getattr(keeper, "enabled", False):
            counters += [
                ("edgekv_snapshots_written", "snapshots of the memory written (state.dir)", keeper.written),
                ("edgekv_snapshots_failed", "snapshots that could not be written (disk full, state.max_mib, I/O); "
                 "the previous one stays", keeper.failures),
                ("edgekv_snapshots_unchanged", "periodic snapshots not written: the memory had not changed since the "
                 "last one", keeper.unchanged),
            ]
        written = _disk_write_bytes()
        if written is not None:
            counters.append(("edgekv_disk_write_bytes", "bytes this process caused to be written to storage (Linux "
                             "/proc/self/io write_bytes: archive, snapshots, evidence frames, logs): what wears the "
                             "flash, against its TBW rating (edgekv plan --flash-tbw)", written))
        for name, help_text, value in counters:
            yield CounterMetricFamily(name, help_text, value=value)
        if keeper is not None and getattr(keeper, "enabled", False) and keeper.written_at is not None:
            yield GaugeMetricFamily("edgekv_snapshot_age_seconds", "seconds since the memory on disk was last "
                                    "written or read back (alert when it passes state.every_s by far while frames "
                                    "come in)", value=keeper.clock() - keeper.written_at)
        certificate = getattr(daemon, "certificate", None)
        if certificate is not None and certificate.not_after is not None:
            yield GaugeMetricFamily("edgekv_tls_certificate_not_after_seconds", "the served certificate's expiry, "
                                    "seconds since the epoch (alert on it minus time())",
                                    value=certificate.not_after.timestamp())
        elapsed = max(time.monotonic() - daemon.started, 1e-9)
        recent = t.ingest_fps()
        mib = 2**20
        gauges = [
            ("edgekv_ingest_fps", "frames ingested per second over the last 10 s (since start until then)",
             recent if recent is not None else stats["frames"] / elapsed),
            ("edgekv_cache_tokens", "cache slots in use", stats["cache_tokens"]),
            ("edgekv_cache_capacity_tokens", "the hard cap M, in tokens", stats["cache_capacity_tokens"]),
            ("edgekv_cache_capacity_bytes", "bytes allocated once for the cache", stats["cache_capacity_bytes"]),
            ("edgekv_questions_waiting", "questions queued for the main loop", daemon.questions.qsize()),
            # not edgekv_snapshot_age_seconds: that name is the memory's snapshot on disk (state.dir), above, and
            # a scrape with both carried one name twice (a reader by name saw whichever came last)
            ("edgekv_stats_age_seconds", "age of the figures in this scrape", snap["age_s"]),
            ("edgekv_process_peak_rss_bytes", "process peak resident memory", _scaled(mon.get("peak_rss_mb"), mib)),
            ("edgekv_ram_used_bytes", "system memory in use", _scaled(mon.get("ram_used_mb"), mib)),
            ("edgekv_power_watts", "board power", mon.get("power_w")),
            ("edgekv_joules_per_frame", "energy per ingested frame", mon.get("j_per_frame")),
            ("edgekv_joules_per_answer_token", "energy per answer token", mon.get("j_per_token")),
            ("edgekv_gpu_load_ratio", "GPU load (0..1)", _scaled(mon.get("gpu_load_pct"), 0.01)),
        ]
        if "archive_pairs" in stats:
            gauges += [("edgekv_archive_bytes", "bytes of the archive's segment files", stats["archive_bytes"]),
                       ("edgekv_archive_pairs", "frame pairs in the archive", stats["archive_pairs"]),
                       ("edgekv_archive_disk_full", "1 while archive writes fail for want of space",
                        stats.get("archive_disk_full", 0)),
                       ("edgekv_archive_failing", "1 while archive writes fail (any reason)",
                        stats.get("archive_failing", 0)),
                       ("edgekv_archive_disk_free_bytes", "free space on the archive's disk (statvfs: what an "
                        "unprivileged writer may still take)", _archive_disk_free(daemon))]
        if frame_stats is not None:
            gauges += [("edgekv_evidence_frames_kept", "evidence frames kept on disk", frame_stats["frames_kept"]),
                       ("edgekv_evidence_frames_file_bytes", "bytes of the evidence frames' files (what "
                        "archive.frames_mib bounds)", frame_stats["frames_file_bytes"])]
        for name, help_text, value in gauges:
            if value is not None:
                yield GaugeMetricFamily(name, help_text, value=value)
        fleet = getattr(daemon, "fleet", None)
        if fleet is not None:  # fleet: in the YAML (apps/outputs/mqtt.py)
            yield from fleet_metrics(fleet.stats())
        state = GaugeMetricFamily("edgekv_stream_state", "1 for the stream's current state", labels=["state"])
        current = stream_state(daemon)
        for name in STREAM_STATES:
            state.add_metric([name], 1.0 if name == current else 0.0)
        yield state
        cameras = getattr(daemon, "cameras", None)
        if cameras:  # video.sources: each camera's own figures (the families above are the first camera's)
            yield from camera_metrics(cameras)


def camera_figures(cameras: dict) -> dict[str, dict]:
    """Each camera's figures (several cameras on one model, apps/daemon/cameras.py), read without a lock."""
    out = {}
    for name, daemon in cameras.items():
        session, sampler = daemon.session, daemon.sampler
        if session is None:
            out[name] = {"stream_state": stream_state(daemon)}
            continue
        capture = sampler.capture.stats() if sampler is not None else {}
        out[name] = {
            "stream_state": stream_state(daemon), "source": _redact(daemon.config.video.source),
            "frames": session.counters.frames, "frame_pairs": session.counters.frame_pairs,
            "compressions": session.counters.compressions, "questions": session.counters.questions,
            "cache_tokens": session.cache.length, "cache_capacity_tokens": session.cache.capacity,
            "cache_capacity_bytes": session.cache.capacity_bytes,
            "frames_dropped": capture.get("frames_dropped", 0), "reconnects": capture.get("reconnects", 0),
        }
    return out


def camera_metrics(cameras: dict) -> Iterator[Any]:
    figures = camera_figures(cameras)
    families = [
        ("edgekv_camera_frames", "frames ingested, per camera", "frames", CounterMetricFamily),
        ("edgekv_camera_frame_pairs", "frame pairs prefilled, per camera", "frame_pairs", CounterMetricFamily),
        ("edgekv_camera_compressions", "cache compressions, per camera", "compressions", CounterMetricFamily),
        ("edgekv_camera_questions", "questions answered, per camera", "questions", CounterMetricFamily),
        ("edgekv_camera_frames_dropped", "frames the capture dropped, per camera", "frames_dropped",
         CounterMetricFamily),
        ("edgekv_camera_reconnects", "source reconnects, per camera", "reconnects", CounterMetricFamily),
        ("edgekv_camera_cache_tokens", "cache slots in use, per camera", "cache_tokens", GaugeMetricFamily),
        ("edgekv_camera_cache_capacity_bytes", "bytes allocated once for the camera's cache",
         "cache_capacity_bytes", GaugeMetricFamily),
    ]
    for name, help_text, key, kind in families:
        family = kind(name, help_text, labels=["camera"])
        for camera, values in figures.items():
            if key in values:
                family.add_metric([camera], float(values[key]))
        yield family
    state = GaugeMetricFamily("edgekv_camera_stream_state", "1 for each camera's current state",
                              labels=["camera", "state"])
    for camera, values in figures.items():
        for name in STREAM_STATES:
            state.add_metric([camera, name], 1.0 if name == values["stream_state"] else 0.0)
    yield state


def fleet_metrics(stats: dict) -> Iterator[Any]:
    """The fleet output's figures (``FleetAgent.stats()``): questions by outcome, messages dropped by reason."""
    yield GaugeMetricFamily("edgekv_fleet_connected", "1 while connected to the MQTT broker",
                            value=1.0 if stats["connected"] else 0.0)
    yield CounterMetricFamily("edgekv_fleet_connects", "connections to the MQTT broker", value=stats["connects"])
    yield CounterMetricFamily("edgekv_fleet_connect_refused", "connections the broker refused (credentials)",
                              value=stats["connect_refused"])
    questions = CounterMetricFamily("edgekv_fleet_questions", "fleet questions by outcome", labels=["outcome"])
    for outcome, key in (("answered", "answered"), ("error", "answer_errors"), ("busy", "refused_busy"),
                         ("duplicate", "duplicates")):
        questions.add_metric([outcome], stats[key])
    yield questions
    dropped = CounterMetricFamily("edgekv_fleet_dropped", "fleet messages dropped, by reason", labels=["reason"])
    for reason, key in (("malformed", "dropped_malformed"), ("oversized", "dropped_oversized"),
                        ("queue_full", "outbox_dropped"), ("paho_queue_full", "paho_queue_full")):
        dropped.add_metric([reason], stats[key])
    yield dropped


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _info(daemon: Any, stats: dict) -> InfoMetricFamily:
    import torch

    import edgekv

    model = daemon.config.model.path or ""
    return InfoMetricFamily("edgekv_build", "edgekv version and what this daemon runs", value={
        "version": edgekv.__version__, "python": platform.python_version(), "torch": torch.__version__,
        "policy": str(stats["policy"]), "vision_backend": str(stats["vision_backend"]),
        "llm_backend": str(stats["llm_backend"]), "decode_route": str(stats.get("decode_route", "")),
        "model": model.rstrip("/").split("/")[-1],
    })


STREAM_STATES = ("starting", "running", "reconnecting", "paused", "stalled", "ended", "stopping")


def stream_state(daemon: Any) -> str:
    """The daemon's ``stream_state`` when it has one (starting, running, reconnecting, ended, stopping);
    otherwise derived from what every daemon has (stop flag, ready event, ``ingest_stopped``)."""
    state = getattr(daemon, "stream_state", None)
    if isinstance(state, str):
        return state
    if daemon.stop:
        return "stopping"
    if not daemon.ready.is_set():
        return "starting"
    return "ended" if getattr(daemon, "ingest_stopped", None) else "running"


def stream_detail(daemon: Any) -> str | None:
    detail = getattr(daemon, "stream_detail", None)
    return detail if isinstance(detail, str) else getattr(daemon, "ingest_stopped", None)


def kept_patch_map(session: Any, recent_pairs: int = 4) -> dict:
    """Share of (layer, KV head) slots still holding each merged-grid cell of the last few frame pairs."""
    import torch

    from edgekv.cache import SlotKind

    if session.grid is None:
        return {"rows": 0, "cols": 0, "kept": []}
    cache, n = session.cache, session.cache.length
    rows, cols = session.grid
    latest = session.counters.frame_pairs - 1
    window = min(recent_pairs, latest + 1)
    mask = (cache.kind[:, :, :n] == int(SlotKind.VISION)) & (cache.frame[:, :, :n] > latest - window)
    cell = cache.row[:, :, :n].long() * cols + cache.col[:, :, :n].long()
    counts = torch.bincount(cell[mask].flatten(), minlength=rows * cols).float()
    share = counts / float(cache.num_layers * cache.kv_heads * max(window, 1))
    return {"rows": rows, "cols": cols, "pairs": window, "kept": share.view(rows, cols).tolist()}


def _archive_disk_free(daemon) -> int | None:
    """The free bytes of the file system holding the daemon's archive (None without one, or where it cannot be
    asked)."""
    from edgekv.archive.store import disk_free_bytes

    recall = getattr(getattr(daemon, "session", None), "recall", None)
    return disk_free_bytes(recall.archive.dir) if recall is not None else None
