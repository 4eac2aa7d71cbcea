"""``edgekv-camera`` (and ``edgekv serve``): watch a camera, file, RTSP stream, GStreamer pipeline or
synthetic video and answer questions about anything seen so far, inside the hard cache cap.

The command line; ``edgekv.apps.daemon.loop`` holds the main loop.
"""

from __future__ import annotations

import argparse
import sys

from edgekv.apps.args import HelpFormatter, add_config_arguments, config_from_args, version_string
from edgekv.threads import prepare_process


def add_daemon_arguments(parser: argparse.ArgumentParser) -> None:
    """How the daemon runs (not part of the deployment config)."""
    group = parser.add_argument_group("running")
    group.add_argument("--ask", action="append", default=[], metavar="QUESTION",
                       help="question to answer when the stream ends, or every --ask-every pairs (repeatable)")
    group.add_argument("--ask-every", type=int, default=0, metavar="N", help="ask the --ask questions every N frame pairs")
    group.add_argument("--voice-wav", metavar="FILE", help="ask the questions spoken in this audio file (any WAV format and rate), like --ask: "
                            "when the stream ends, or every --ask-every pairs")
    group.add_argument("--speak-wav", metavar="FILE",
                       help="speak the answers into this WAV file (voice.speak, e.g. for a headless test) instead of "
                            "the audio device")
    group.add_argument("--max-frames", type=int, metavar="N",
                       help="ingest N frames, answer the --ask questions, then exit (one-shot)")
    group.add_argument("--exit-at-end", action="store_true",
                       help="exit when the stream ends (default: keep answering questions about what was seen)")
    group.add_argument("--realtime", action="store_true",
                       help="play a file or synthetic video at its own frame rate, as a camera would deliver it "
                            "(default: every frame, as fast as it is ingested)")
    group.add_argument("--no-server", action="store_true", help="do not start the HTTP API")
    group.add_argument("--no-stdin", action="store_true", help="do not read questions from stdin")
    group.add_argument("--quiet", action="store_true", help="no per-pair lines")
    group.add_argument("--check", action="store_true",
                       help="run every start-up check (config, files, folders, port, certificates, fleet, one frame "
                            "of the video source) without loading the model, say each, and exit: 0 when the daemon "
                            "would start, 2 when it would not; beside a running daemon, before a restart")
    group.add_argument("--quiz", type=int, default=0, metavar="N",
                       help="when a synthetic:events stream ends, ask N questions about the events seen and grade "
                            "each answer against the scene's ground truth (the toy model's demo)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgekv-camera", formatter_class=HelpFormatter,
        description="Watch a camera (or file, RTSP stream, GStreamer pipeline, synthetic video) and answer questions "
                    "about anything seen so far,\ninside a hard KV-cache memory cap. Questions come from --ask, stdin, "
                    "the HTTP API (OpenAI-compatible) and the microphone.",
        epilog="example: edgekv-camera --config cpu-demo --no-stdin --exit-at-end --quiz 10 "
               "--ask 'Which shape was red?'\n"
               "(cpu-demo: a config shipped with edgekv, found by name wherever it is installed; configs/cpu-demo.yaml "
               "in the source tree)")
    parser.add_argument("--version", action="version", version=version_string())
    add_config_arguments(parser, model_positional=False)
    add_daemon_arguments(parser)
    return parser


def run_daemon(args: argparse.Namespace, prog: str) -> int:
    """Load the deployment and run the daemon; a configuration mistake is one line and exit 2."""
    from edgekv.apps.daemon.startup import one_line

    try:
        config = config_from_args(args)
    except ValueError as exc:  # ConfigError: names the file and the key
        print(f"{prog}: cannot start: {one_line(exc)}", file=sys.stderr, flush=True)
        return 2
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions

    if config.video.sources:  # several cameras on one model (apps/daemon/cameras.py)
        from edgekv.apps.daemon.cameras import CameraSet

        try:
            cameras = CameraSet(config, DaemonOptions.from_namespace(args), prog=prog)
        except ValueError as exc:
            print(f"{prog}: cannot start: {one_line(exc)}", file=sys.stderr, flush=True)
            return 2
        if getattr(args, "check", False):
            return _check(cameras.daemons, args, config)
        return cameras.run()
    daemon = Daemon(config, DaemonOptions.from_namespace(args), prog=prog)
    if getattr(args, "check", False):
        return _check({"": daemon}, args, config)
    return daemon.run()


def _check(daemons: dict, args: argparse.Namespace, config) -> int:
    from edgekv.apps.daemon.check import run_check

    return run_check(daemons, sys.stdout, getattr(args, "config", None) or "defaults and flags", deployment=config)


def main(argv: list[str] | None = None) -> int:
    prepare_process()  # the OpenMP wait policy, before anything imports torch (edgekv/threads.py)
    args = build_parser().parse_args(argv)
    if not args.config and not args.model_flag:
        print("edgekv-camera: cannot start: give --config FILE (or --model DIR)", file=sys.stderr)
        return 2
    return run_daemon(args, "edgekv-camera")


if __name__ == "__main__":
    sys.exit(main())
