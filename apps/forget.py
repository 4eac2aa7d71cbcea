"""``edgekv forget``: ask a running daemon to forget a window of stream time (``POST /v1/memory/forget``): the
live cache, the snapshots and the archive. The window is in stream seconds (what ``/v1/edgekv/status`` and the
answers' evidence times show), in wall times (what was seen between 14:00 and 14:10), or the last so many
seconds."""

from __future__ import annotations

import argparse
import json
import sys

from edgekv.apps.ask import daemon_request
from edgekv.apps.questions import printable
from edgekv.apps.wall_times import cli_bound, cli_window, wall_text
from edgekv.config_names import config_help, resolve_config


def add_forget_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None,
                        help="the daemon's address (https://... when it serves HTTPS: server.tls_cert_file; default: "
                             "server.host:port of --config, else http://127.0.0.1:8080)")
    window = parser.add_mutually_exclusive_group(required=True)
    window.add_argument("--last", type=float, metavar="SECONDS", help="forget the last so many seconds")
    window.add_argument("--from", dest="t_from", type=cli_bound, metavar="T0",
                        help="window start: stream seconds, or a wall time: 14:00 (today, local time), "
                             "2026-12-04T14:00:00+01:00")
    parser.add_argument("--to", dest="t_to", type=cli_bound, metavar="T1", help="window end, with --from")
    parser.add_argument("--token-env", default=None,
                        help="environment variable holding the daemon's token (default: --config's server.token or "
                             "server.token_env, else EDGEKV_TOKEN)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds to wait for the rewrite (default: 120; with --fleet, 30 for every answer)")
    parser.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    fleet = parser.add_argument_group("--fleet: every device of an MQTT fleet (each where fleet.accept_forget is on)")
    fleet.add_argument("--fleet", action="store_true",
                       help="ask every device to forget what it saw between two wall times (--from/--to) or in "
                            "its last --last seconds, and list what each removed or why it did not")
    fleet.add_argument("--broker", default=None, help="mqtt://host[:port] or mqtts://... (default: --config's)")
    parser.add_argument("--config", default=None, type=resolve_config,
                        help=config_help("a daemon's deployment: without --fleet its server: section gives the "
                                         "daemon's address, token and certificate (as edgekv ask's); with it, its "
                                         "fleet: section the broker, topic prefix, credentials and TLS files"))
    fleet.add_argument("--device", default=None, help="this device only")
    fleet.add_argument("--camera", default=None, help="this camera of devices with several (default: each)")
    for name in ("--topic-prefix", "--username", "--password-env"):
        fleet.add_argument(name, default=None)
    tls = parser.add_argument_group("TLS: an https:// --url, or an mqtts:// broker with --fleet")
    tls.add_argument("--ca-file", default=None, help="the CA (PEM) that signed the daemon's or the broker's "
                                                     "certificate (a self-signed one is its own CA)")
    tls.add_argument("--cert-file", default=None, help="a client certificate (PEM), with --key-file, for a daemon "
                                                       "(server.tls_client_ca_file) or broker that requires one")
    tls.add_argument("--key-file", default=None)
    parser.set_defaults(func=run)


def run_fleet(args: argparse.Namespace) -> int:
    """``edgekv forget --fleet``: a line per device and camera (what it removed, or why not), then the devices online
    that did not answer; exit 0 when every device that answered forgot, 1 otherwise (or when none answered)."""
    from edgekv.apps.outputs.mqtt import FleetError, connection_from_args, fleet_summary, forget_fleet

    if args.t_from is not None:
        if args.t_to is None:
            raise ValueError("--from needs --to")
        if not isinstance(args.t_from, str) or not isinstance(args.t_to, str):
            raise ValueError("--fleet: --from and --to are wall times (14:00, 2026-12-04T14:00:00+01:00); stream "
                             "seconds are each device's own")
        wall = cli_window(args.t_from, args.t_to, forget=True)
    else:
        wall = None
    try:
        result = forget_fleet(connection_from_args(args), 30.0 if args.timeout is None else args.timeout, args.device,
                              args.camera, args.last, wall)
    except FleetError as exc:
        raise RuntimeError(str(exc)) from None
    if args.json:
        print(json.dumps({**result.to_json(), "results": [
            {"device": a.device, "camera": a.camera, "result": a.raw.get("result"), "error": a.error}
            for a in result.answers]}, indent=2))
    else:
        for answer in result.answers:
            where = answer.device + (f" ({answer.camera})" if answer.camera else "")
            outcome = answer.raw.get("result")
            line = (f"error: {answer.error}" if answer.error else
                    _summary(outcome) if isinstance(outcome, dict) and "cache_slots" in outcome and "from" in outcome
                    else f"forgot {outcome.get('pairs')} frame pair(s)" if isinstance(outcome, dict) else "no result")
            print(printable(f"{where}: {line}"))
        print(fleet_summary(result, f"{len(result.answers)} answer(s)"))
    return 0 if result.answers and all(a.error is None for a in result.answers) else 1


FLEET_ONLY = ("broker", "device", "camera", "topic_prefix", "username", "password_env")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "fleet", False):
        return run_fleet(args)
    given = [f"--{name.replace('_', '-')}" for name in FLEET_ONLY if getattr(args, name, None) is not None]
    if given:  # not silently ignored: the daemon at --url would forget, the fleet would not
        raise ValueError(f"{', '.join(given)}: only with --fleet (without it edgekv forget asks the daemon at --url)")
    if args.last is not None:
        body = {"last_s": args.last}
    else:
        if args.t_to is None:
            raise ValueError("--from needs --to (stream seconds or wall times)")
        t_from, t_to = cli_window(args.t_from, args.t_to, forget=True)  # read together, sent with our UTC offset
        body = {"from": t_from, "to": t_to}
    from edgekv.apps.ask import daemon_certificate, daemon_target
    from edgekv.apps.server.tls import client_context

    url, token = daemon_target(args.config, args.token_env)  # the daemon of --config, as edgekv ask finds it
    pinned = daemon_certificate(args.config) if args.url is None else None
    url = args.url or url
    context = client_context(url, getattr(args, "ca_file", None), getattr(args, "cert_file", None),
                             getattr(args, "key_file", None), pinned)
    with daemon_request(url, "/v1/memory/forget", body, token,
                        120.0 if args.timeout is None else args.timeout, context) as response:
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
    # not cache_slots (--json has it): it counts a token once in every layer and KV head, so the toy's 6 pairs (96
    # tokens) read "768 slots" of a cache that held 335 tokens; tokens are what a cap is set in (a daemon older than
    # cache_tokens_freed: the tokens the cache holds now)
    freed = f"{result['cache_tokens_freed']} tokens freed, " if "cache_tokens_freed" in result else ""
    held = f" ({freed}{result['cache_tokens']} held now)" if "cache_tokens" in result else ""
    return (f"forgot t={', '.join(f'{a:g}..{b:g}' for a, b in spans)} s{when}: {result['pairs']} frame pair(s) from "
            f"the cache{held}"
            + (f", {archive['pairs']} archived pair(s) ({archive['bytes']} bytes freed)"
               if archive and "pairs" in archive else ", no archive")
            + (f", {archive['frames']} evidence frame(s) overwritten" if archive and "frames" in archive else "")
            + (f", snapshot {snapshots['snapshot']} rewritten, {len(snapshots.get('removed', []))} older removed"
               if snapshots.get("snapshot") else f", {snapshots.get('note') or 'no snapshots'}"))
