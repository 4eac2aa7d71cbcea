"""``edgekv forget``: ask a running daemon to forget a window of stream time (``POST /v1/memory/forget``): the
live cache, the snapshots and the archive. The window is in stream seconds (what ``/v1/edgekv/status`` and the
answers' evidence times show), in wall times (what was seen between 14:00 and 14:10), or the last so many
seconds."""

from __future__ import annotations

import argparse
import json
import os
import sys

from edgekv.apps.ask import daemon_request
from edgekv.apps.wall_times import cli_bound, cli_window, wall_text


def add_forget_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the daemon's HTTP address")
    window = parser.add_mutually_exclusive_group(required=True)
    window.add_argument("--last", type=float, metavar="SECONDS", help="forget the last so many seconds")
    window.add_argument("--from", dest="t_from", type=cli_bound, metavar="T0",
                        help="window start: stream seconds, or a wall time: 14:00 (today, local time), "
                             "2026-12-04T14:00:00+01:00")
    parser.add_argument("--to", dest="t_to", type=cli_bound, metavar="T1", help="window end, with --from")
    parser.add_argument("--token-env", default="EDGEKV_TOKEN",
                        help="environment variable holding the daemon's server.token (when it has one)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the rewrite")
    parser.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.last is not None:
        body = {"last_s": args.last}
    else:
        if args.t_to is None:
            raise ValueError("--from needs --to (stream seconds or wall times)")
        t_from, t_to = cli_window(args.t_from, args.t_to)  # wall times read together, sent with this machine's offset
        body = {"from": t_from, "to": t_to}
    with daemon_request(args.url, "/v1/memory/forget", body,
                        os.environ.get(args.token_env) if args.token_env else None, args.timeout) as response:
        result = json.loads(response.read())
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    cameras = result.get("cameras")  # a daemon with several cameras forgets on each: a line per camera
    for name, one in (cameras.items() if cameras else [(None, result)]):
        print(("" if name is None else f"{name}: ") + _summary(one), file=sys.stdout)
    return 0


def _summary(result: dict) -> str:
    """One camera's forget result (``Daemon.forget``) as a line."""
    archive, snapshots = result.get("archive"), result.get("snapshots") or {}
    if result.get("from") is None:  # a wall-clock window this camera saw nothing in
        return result.get("note") or "nothing to forget"
    wall = result.get("wall")
    when = (f" (seen {wall_text(wall['from'])} to {wall_text(wall['to'])})" if wall else "")
    spans = result.get("stretches") or [[result["from"], result["to"]]]  # several: the clock was set back between
    return (f"forgot t={', '.join(f'{a:g}..{b:g}' for a, b in spans)} s{when}: {result['pairs']} frame pair(s) from "
            f"the cache "
            f"({result['cache_slots']} slots)"
            + (f", {archive['pairs']} archived pair(s) ({archive['bytes']} bytes freed)"
               if archive and "pairs" in archive else ", no archive")
            + (f", {archive['frames']} evidence frame(s) overwritten" if archive and "frames" in archive else "")
            + (f", snapshot {snapshots['snapshot']} rewritten, {len(snapshots.get('removed', []))} older removed"
               if snapshots.get("snapshot") else ", no snapshots"))
