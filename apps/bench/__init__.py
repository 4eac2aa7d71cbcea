"""``edgekv bench``: commands that measure and print figures, and save them (JSON + PNG). One module per
bench (``edgekv bench NAME`` runs ``edgekv.apps.bench.NAME``); what they share is in ``common``. Nothing here
asserts a speed: tests assert behaviour, benches measure it.
"""

from __future__ import annotations

import argparse
import importlib

from edgekv.apps.args import HelpFormatter


def add_arguments(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> None:
    """``stream``, ``kernels``, ``engines``, ``daemon``, ``soak``, ``state``, ``api``, ``archive``, ``memory``,
    ``decode``, ``threads``, ``compression``, ``fleet``, ``faults``, ``cameras``, ``frames``,
    ``capture``; with ``argv`` only the chosen one gets its options
    (the others' modules, and torch, are not imported for ``--help``)."""
    from edgekv.apps.args import first_positional

    chosen = first_positional(argv)[0] if argv is not None else None
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    benches = {
        "stream": ("ingest a long stream; edgekv vs transformers, per frame pair", _lazy("stream", "add_stream_arguments")),
        "kernels": ("each kernel vs its eager torch reference", _lazy("kernels", "add_kernel_arguments")),
        "engines": ("vision + prefill ms and decode tok/s per backend, repeated",
                    _lazy("engines", "add_engine_arguments")),
        "daemon": ("frames lost while answering, answer latency, ingest fps under question load",
                   _lazy("daemon", "add_daemon_bench_arguments")),
        "soak": ("hours-long stream: RSS, cache bytes, fps and errors over time", _lazy("soak", "add_soak_arguments")),
        "state": ("snapshot write/read ms and bytes at the 3B cache shape", _lazy("state", "add_state_arguments")),
        "api": ("ingest rate and /healthz latency under 50 concurrent chats", _lazy("api", "add_api_arguments")),
        "alerts": ("standing questions: alert precision/recall on the toy, one evaluation's cost at the 3B shape",
                   _lazy("alerts", "add_alerts_arguments")),
        "keepalive": ("/healthz and chat latency on one kept-alive connection against fresh ones",
                      _lazy("keepalive", "add_keepalive_arguments")),
        "archive": ("recall from the archive: toy accuracy beyond the cap, 3B-shape latency, ingest overhead",
                    _lazy("archive", "add_archive_arguments")),
        "memory": ("toy-model accuracy at equal cache bytes: kv_dtype x policy x skip_static; 3B logits error",
                   _lazy("memory", "add_memory_arguments")),
        "decode": ("decode tok/s against the measured memory-bandwidth bound, per dtype, beside transformers",
                   _lazy("decode", "add_decode_arguments")),
        "threads": ("per-pair vision / prefill ms per torch thread count and OpenMP wait policy",
                    _lazy("threads", "add_threads_arguments")),
        "compression": ("one CKV compression's select ms per cache dtype at the 3B cache shape",
                        _lazy("compression", "add_compression_arguments")),
        "fleet": ("one fleet question over MQTT answered by many simulated devices: latency, overhead",
                  _lazy("fleet", "add_fleet_arguments")),
        "faults": ("the archive after a full disk and flipped bytes: pairs recovered against pairs that check",
                   _lazy("faults", "add_faults_arguments")),
        "cameras": ("several cameras on one model: memory, each camera's share of the loop, answers",
                    _lazy("cameras", "add_cameras_arguments")),
        "frames": ("evidence frames on disk: KiB a frame, hours a budget holds, the writer's ms a frame",
                   _lazy("frames", "add_frames_arguments")),
        "capture": ("a camera's capture thread: CPU with every frame decoded against only those sampled",
                    _lazy("capture", "add_capture_arguments")),
    }
    for name, (summary, add) in benches.items():
        bench = sub.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter)
        if argv is None or name == chosen:
            add(bench)


def _lazy(module: str, function: str):
    """The ``add`` of a bench whose module (and torch) is imported only when that bench is chosen."""

    def add(parser: argparse.ArgumentParser) -> None:
        getattr(importlib.import_module(f"edgekv.apps.bench.{module}"), function)(parser)
        run = parser.get_default("run")
        if run is not None and parser.get_default("json") is not None:
            parser.set_defaults(run=_outputs_checked(run))

    return add


def _outputs_checked(run):
    """``run`` after ``common.check_outputs`` of its ``--json`` / ``--plot``: a bench of hours learns of a bad
    output path at its start."""

    def checked(args: argparse.Namespace) -> int:
        from edgekv.apps.bench.common import check_outputs

        check_outputs(getattr(args, "json", None), getattr(args, "plot", None))
        return run(args)

    return checked
