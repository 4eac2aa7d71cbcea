"""``edgekv rekey``: seal the memory on flash — every snapshot under ``state.dir`` (the set-aside one included), the
standing questions the API added (``state.dir/alerts.json``), every archive segment under ``archive.dir`` and the
evidence frames beside it (``frames.sqlite``) — with the key ``privacy:`` names now, while the daemon is stopped.

Why: the daemon seals each new snapshot and segment with the current key and reads the old ones with
``privacy.previous_key_files``, so without this the old key stays needed until two snapshots have been written and
retention has deleted every older segment — days, on a 16 GiB archive — and frames archived before a key was first
set stay in the clear as long. After a key leaks, or when encryption is turned on for a device that already holds a
memory, ``systemctl stop edgekv; edgekv rekey --config /etc/edgekv/deploy.yaml; systemctl start edgekv``: once it
says so, no file needs the old key (remove it from ``previous_key_files``) and none is in the clear.

Each file is rewritten as the daemon rewrites one (a temporary copy sealed under a new random salt, fsync, rename:
a crash leaves the old file or the new one; ``edgekv.state.reseal_snapshot``, ``FrameArchive.reseal``). It takes
the folders' locks, so a running daemon (or a second rekey) is refused naming its pid. With ``video.sources`` each
camera's folders are done in turn. Segments a newer edgekv wrote (met after a downgrade) are not read, so not
re-sealed either: they are left as they are, named, and the run ends 1 (the old keys may still be needed for them).
What it cannot do: erase the flash blocks the old files used. A key given as a
systemd credential (``privacy.key_credential``) exists only inside a unit: run rekey in one with the same credential
(``systemd-run --pipe --wait -p LoadCredentialEncrypted=NAME:FILE edgekv rekey ...``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_rekey_arguments(parser: argparse.ArgumentParser) -> None:
    from edgekv.config_names import config_help, resolve_config

    parser.add_argument("--config", required=True, type=resolve_config,
                        help=config_help("the daemon's deployment: its privacy:, state: and archive: sections"))
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="any other config key, value in YAML (repeatable), e.g. --set privacy.key_file=/k")
    parser.add_argument("--dry-run", action="store_true", help="say what would be rewritten; change nothing")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from edgekv.apps.daemon.cameras import camera_configs
    from edgekv.config import assignment_sections, load_config
    from edgekv.runtime import deployment_keys

    config = load_config(args.config)
    sections = assignment_sections(args.set)
    if sections:
        config = config.with_overrides(label="command line", **sections)
    keys = deployment_keys(config)
    if keys is None:
        raise ValueError("privacy: no key is set (privacy.key_file, key_env or key_credential): rekey seals the "
                         "memory with that key")
    cameras = camera_configs(config) if config.video.sources else {None: config}
    left = 0
    for name, one in cameras.items():
        say = (lambda line, name=name: print(f"{name}: {line}")) if name else print
        left += _state(one, keys, args.dry_run, say) + _archive(one, keys, args.dry_run, say)
    key = keys.current.id.hex()
    damaged = [path for one in cameras.values() for path in damaged_files(one)]
    if damaged:  # said either way: they are not what "opens with the current key" speaks of
        print(f"{len(damaged)} damaged file(s) set aside earlier are not rewritten (they do not read): "
              f"{', '.join(str(path) for path in damaged[:5])}{' ...' if len(damaged) > 5 else ''}; they may hold "
              f"memory in the clear or under an old key: remove them if it matters")
    if left:
        print(f"{left} snapshot(s) or archive folder(s) left as they were (above, each with why): give the key they "
              f"need in privacy.previous_key_files, or fix what kept them from being written, and run again (or "
              f"remove them); until then keep the old keys")
        return 1
    if not args.dry_run:
        print(f"every snapshot and archive segment opens with the current key ({key}) alone: "
              f"privacy.previous_key_files can be emptied")
    _next_start(cameras, keys, args.config)
    return 0


def _next_start(cameras: dict, keys, config_name: str) -> None:
    """What the next start does with the memory just re-sealed, when it does not resume it whole: an archive it
    refuses (another ``archive.index_keys``, another model's shape) and snapshots it sets aside (a cap, a camera's
    weight, the model or prompt changed), each with the key to change. Said last, so that it is not read past: rekey
    said "done" of an archive the next start then refused."""
    from edgekv.apps.daemon.startup import StartupError, check_archive_shape, one_line
    from edgekv.state import StateKeeper

    lines = []
    for name, one in cameras.items():
        where = f"{name}: " if name else ""
        try:
            check_archive_shape(one)
        except StartupError as exc:
            lines.append(f"{where}{one_line(exc)}")
        plan = StateKeeper(one.state, say=lambda line: None)
        try:
            outlook = plan.plan_restore(one, keys)
        except (ValueError, OSError, KeyError):  # no readable model.path here: not compared (--check says more)
            continue
        if outlook.action == "set_aside":
            lines.append(f"{where}state.dir {plan.dir}: {outlook.text}")
    if lines:
        print(f"the config and the memory disagree: the next start will not resume the memory as it is "
              f"(edgekv-camera --config {config_name} --check says the same before a start):")
        for line in lines:
            print(f"  {line}")


def damaged_files(config) -> list[Path]:
    """The files a damaged read set aside under ``state.dir`` and ``archive.dir`` (``alerts.json.bad``,
    ``alert-events/*.evt.bad``, ``frames.sqlite.bad-<time>``): no key opens them whole, so none is re-sealed, and the
    message that the old keys can go said nothing of them, though what they hold is as it was written."""
    found: list[Path] = []
    for folder in (config.state.dir, config.archive.dir):
        if folder is not None and Path(folder).is_dir():
            found += [path for path in Path(folder).rglob("*") if path.is_file() and (
                path.name.endswith(".bad") or ".bad-" in path.name)]
    return sorted(found)


def _give_back(folder: Path) -> None:
    """Run as root (``sudo edgekv rekey``), the rewritten files would be root's in the service user's folders:
    hand each back to the folder's owner, as the daemon (``User=edgekv``) wrote them."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return
    owner = folder.stat()
    for path in [folder, *folder.rglob("*")]:
        info = path.lstat()
        if (info.st_uid, info.st_gid) != (owner.st_uid, owner.st_gid) and not path.is_symlink():
            os.chown(path, owner.st_uid, owner.st_gid)


def _reason(exc: OSError) -> str:
    """Why a file could not be written, in words (``No space left on device``), and what to do about it."""
    return f"{exc.strerror or exc}; make room or fix the disk and run again, until then keep the old keys"


def _state(config, keys, dry_run: bool, say) -> int:
    """Snapshots under ``state.dir``; returns how many were left as they were."""
    from edgekv.apps.daemon.startup import one_line
    from edgekv.privacy import SealError
    from edgekv.state import SnapshotError, StateKeeper, read_manifest, reseal_snapshot

    keeper = StateKeeper(config.state, say=lambda line: None)
    if not keeper.enabled or not keeper.dir.is_dir():
        say(f"state.dir {config.state.dir or '(not set)'}: no snapshots")
        return 0
    try:
        keeper.hold()  # a running daemon holds it: refused naming its pid
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}; rekey runs while the daemon is stopped (systemctl stop edgekv)") from None
    try:
        if not dry_run:
            keeper._remove_leftovers()  # a crashed write's temporary file: never read, maybe under the old key
        paths = keeper.generations() + keeper.set_aside_files()
        done, current, left = 0, 0, 0
        for path in paths:
            try:
                if dry_run:
                    sealer = read_manifest(path, keys).get("_sealer")
                    changed = sealer is None or sealer.key.id != keys.current.id
                else:
                    changed = reseal_snapshot(path, keys)
            except (SnapshotError, SealError) as exc:
                say(f"left as it is: {one_line(exc)}")
                left += 1
                continue
            except OSError as exc:  # a full or read-only disk: named, and the other files still done
                say(f"left as it is: {path}: could not be rewritten ({_reason(exc)})")
                left += 1
                continue
            done += changed
            current += not changed
        verb = "would be re-sealed" if dry_run else "re-sealed"
        say(f"state.dir {keeper.dir}: {done} snapshot(s) {verb}, {current} already under the current key")
        return left + _rules(keeper.dir, keys, dry_run, say) + _alert_events(keeper.dir, keys, dry_run, say)
    finally:
        keeper.release()
        if not dry_run:
            _give_back(keeper.dir)


def _rules(folder: Path, keys, dry_run: bool, say) -> int:
    """The standing questions the API added (``state.dir/alerts.json``); returns 1 when left as they were."""
    from edgekv.apps.daemon.startup import one_line
    from edgekv.apps.outputs.alerts import RuleStore
    from edgekv.privacy import SealError

    store = RuleStore(folder, keys)
    if not store.path.is_file():
        return 0
    try:
        changed = store.needs_reseal() if dry_run else store.reseal()
    except SealError as exc:
        say(f"left as it is: {one_line(exc)}")
        return 1
    except OSError as exc:
        say(f"left as it is: {store.path}: could not be rewritten ({_reason(exc)})")
        return 1
    state = ("would be re-sealed" if dry_run else "re-sealed") if changed else "already under the current key"
    say(f"{store.path} (the API's standing questions): {state}")
    return 0


def _alert_events(folder: Path, keys, dry_run: bool, say) -> int:
    """The last alerts (``state.dir/alert-events``, apps/outputs/alert_log.py); returns 1 when left as they were."""
    from edgekv.apps.daemon.startup import one_line
    from edgekv.apps.outputs.alert_log import EventLog
    from edgekv.privacy import SealError

    events = EventLog(folder, keys)
    if not events.files():
        return 0
    try:
        count = len(events.needs_reseal()) if dry_run else events.reseal()
    except SealError as exc:
        say(f"left as it is: {one_line(exc)}")
        return 1
    except OSError as exc:  # those rewritten before it are under the current key; the rest as they were
        say(f"left as it is: {events.dir} (the last alerts): could not be rewritten ({_reason(exc)})")
        return 1
    say(f"{events.dir} (the last alerts): {count} {'would be re-sealed' if dry_run else 're-sealed'}, "
        f"{len(events.files()) - count} already under the current key")
    return 0


def _archive(config, keys, dry_run: bool, say) -> int:
    """Segments under ``archive.dir``; returns 1 when the folder was left as it was (a segment no key of the ring
    opens keeps the whole archive from opening: named), else 0."""
    from edgekv.apps.daemon.startup import one_line
    from edgekv.archive.store import ArchiveError, FrameArchive, archived_shape, newer_segments_text

    section = config.archive
    folder = Path(section.dir).expanduser() if section.dir else None
    shape = archived_shape(folder) if folder is not None else None
    if shape is None:
        newer = newer_segments_text(folder) if folder is not None else ""
        say(f"archive.dir {section.dir or '(not set)'}: no segments" + (" this edgekv reads" if newer else ""))
        left = _newer_left(newer, say)
        return left + (_frames(folder, keys, dry_run, say) if folder is not None else 0)
    segment = int(section.segment_mib * 2**20)
    try:
        archive = FrameArchive(folder, shape, max_bytes=max(int(section.max_gib * 2**30), 2 * segment),
                               segment_bytes=segment, keys=keys)
    except ArchiveError as exc:
        say(f"archive.dir {folder}: left as it is: {one_line(exc)}")
        return 1
    try:
        result = archive.reseal(dry_run=dry_run)
        verb = "would be re-sealed" if dry_run else f"re-sealed ({result['bytes']:,} bytes written)"
        say(f"archive.dir {folder}: {result['segments_resealed']} segment(s) {verb}, {result['segments_current']} "
            f"already under the current key")
        left = _newer_left(archive.newer_text(), say)
        return left + _frames(folder, keys, dry_run, say)  # under the archive folder's lock
    finally:
        archive.close()
        if not dry_run:
            _give_back(folder)


def _newer_left(newer: str, say) -> int:
    """Segments a newer edgekv wrote (``newer``: ``newer_segments_text``; empty: none): this one cannot read them, so
    it neither reseals nor touches them, and what they hold may be under an old key or in the clear; returns 1 when
    there are some (the old keys stay needed), else 0."""
    if not newer:
        return 0
    say(f"left as they are: {newer}; this edgekv cannot re-seal them (they may be under an old key or in the clear): "
        f"run the newer edgekv's rekey, or remove them")
    return 1


def _frames(folder: Path, keys, dry_run: bool, say) -> int:
    """The evidence frames beside the archive (``archive.frames_mib``: ``frames.sqlite``), every row sealed with the
    current key; returns 1 when some row no key opens was left (named), else 0."""
    from edgekv.apps.daemon.frame_store import FILE, FrameStore

    if not (folder / FILE).is_file():
        return 0
    store = FrameStore(folder, max_bytes=2**62, keys=keys)
    try:
        counts = store.reseal(dry_run=dry_run)
    finally:
        store.close()
    if store.set_aside is not None:  # damaged: the daemon would have done the same at its next start
        say(f"evidence frames {folder / FILE}: did not check; set aside as {store.set_aside.name} (a forget removes "
            f"it), a new one begun")
    verb = "would be re-sealed" if dry_run else "re-sealed"
    say(f"evidence frames {folder / FILE}: {counts['resealed']} frame(s) {verb}, {counts['current']} already under the "
        f"current key" + (f", {counts['unopened']} no key opens left as they are" if counts["unopened"] else ""))
    return 1 if counts["unopened"] else 0
