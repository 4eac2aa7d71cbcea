"""``edgekv bench faults``: what a full disk and flipped bytes cost the archive on flash (issue 26, DESIGN
invariant 13: one bad byte costs one record). Figures only: JSON + PNG.

* ``enospc``: an archive on a small tmpfs (mounted here; root only, as CI runs) filled by a file until writes
  fail with ENOSPC; ``--pairs`` pairs are written one at a time, then the file is removed (space returns) and
  ``--pairs`` more are written. The archive is reopened and every pair it indexes is read back and compared
  with what was written. Reported: pairs the writer wrote, pairs it lost to the full disk, pairs recovered on
  reopen and how many of them check — against the pairs written once space returned.
* ``flips``: an archive of two segments of ``--records`` records each (the first closed, the second the
  newest, whose KV is verified on open); per trial a copy of it gets ``--flips`` byte(s) flipped at random
  offsets (seeded), is reopened, and every indexed pair is read back. Reported per trial and in all: the
  records no flip touched (what must survive) and the records recovered with every layer checking.

The archive's shape is small (``--layers`` x 2 KV heads x head_dim 8 x ``--tokens`` tokens, fp32: ~25 KiB a
record) so that a 2 MiB tmpfs fills after a few dozen; the code path is the one every shape takes.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from edgekv.apps.bench.common import provenance, write_figures


def add_faults_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default="enospc,flips", help="comma-separated: enospc, flips")
    parser.add_argument("--pairs", type=int, default=40, help="enospc: pairs written while full, and again after")
    parser.add_argument("--disk-kib", type=int, default=2048, help="enospc: size of the tmpfs")
    parser.add_argument("--room-records", type=int, default=6, help="enospc: records that fit beside the filler")
    parser.add_argument("--records", type=int, default=10, help="flips: records per segment (two segments)")
    parser.add_argument("--trials", type=int, default=40, help="flips: reopened copies, each with its own flips")
    parser.add_argument("--flips", type=int, default=1, help="flips: bytes flipped per trial")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temporary folder)")
    parser.add_argument("--json", default="bench-faults.json")
    parser.add_argument("--plot", default="bench-faults.png", help="PNG to write ('' to skip)")
    parser.set_defaults(run=run_faults)


def _shape(args: argparse.Namespace):
    from edgekv.archive.store import KVShape

    return KVShape(layers=args.layers, kv_heads=2, head_dim=8, dtype="float32")


def _kv(args: argparse.Namespace, frame: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(frame)
    k = torch.randn(args.layers, 2, args.tokens, 8, generator=g)
    return k, k * 2 + 1


def _archive(folder: Path, args: argparse.Namespace, segment_bytes: int):
    from edgekv.archive.store import FrameArchive

    return FrameArchive(folder, _shape(args), max_bytes=64 * segment_bytes, segment_bytes=segment_bytes,
                        when_full="wait")


def _write(archive, args: argparse.Namespace, frames: range) -> None:
    for frame in frames:
        k, v = _kv(args, frame)
        archive.submit(k, v, frame=frame, t=frame * 0.5, tpos=frame, t_offset=0, rows=8, cols=8, stream=b"b" * 16)
        archive.flush()


def _checking(archive, args: argparse.Namespace) -> list[int]:
    """Frames of the indexed pairs whose every layer reads back and equals what was written."""
    good = []
    for entry in archive.entries():
        k, v = _kv(args, entry.frame)
        layers = [archive.read_layer(entry, layer) for layer in range(args.layers)]
        if all(got is not None and torch.equal(got[0], k[i]) and torch.equal(got[1], v[i])
               for i, got in enumerate(layers)):
            good.append(entry.frame)
    return good


# ---------------------------------------------------------------------------------------------- enospc
def enospc(args: argparse.Namespace, root: Path) -> dict:
    if os.geteuid() != 0:
        return {"skipped": "mounting a tmpfs needs root"}
    mount = root / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.disk_kib}k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return {"skipped": f"cannot mount a tmpfs: {done.stderr.strip()}"}
    try:
        record = _shape(args).record_bytes(args.tokens)
        filler = mount / "filler"
        filler.write_bytes(b"\0" * max(0, args.disk_kib * 1024 - (args.room_records + 1) * record))
        folder = mount / "archive"
        archive = _archive(folder, args, 64 << 20)
        started = time.perf_counter()
        _write(archive, args, range(args.pairs))
        full = dict(archive.stats())
        filler.unlink()
        _write(archive, args, range(args.pairs, 2 * args.pairs))
        stats = dict(archive.stats())
        archive.close()
        reopened = _archive(folder, args, 64 << 20)
        good = _checking(reopened, args)
        after = [f for f in good if f >= args.pairs]
        result = {
            "record_bytes": record, "pairs_each_phase": args.pairs,
            "written": stats["archive_written"], "lost_to_the_full_disk": args.pairs - full["archive_written"],
            "write_errors": stats["archive_write_errors"], "dropped_counted": stats["archive_dropped"],
            "disk_full_reported": full.get("archive_disk_full"),
            "recovered": reopened.pairs, "recovered_that_check": len(good),
            "written_after_space_returned": stats["archive_written"] - full["archive_written"],
            "after_space_returned_that_check": len(after),
            "bad_records_on_reopen": reopened.bad_records, "torn_bytes_on_reopen": reopened.torn_bytes,
            "seconds": time.perf_counter() - started,
        }
        reopened.close()
        return result
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


# ---------------------------------------------------------------------------------------------- flips
def flips(args: argparse.Namespace, root: Path) -> dict:
    shape = _shape(args)
    record = shape.record_bytes(args.tokens)
    source = root / "pristine"
    segment_bytes = args.records * record + record // 2
    archive = _archive(source, args, segment_bytes)
    _write(archive, args, range(2 * args.records))
    extents = {(archive._segment_path(e.segment).name, e.offset): e.frame for e in archive.entries()}
    archive.close()
    segments = sorted(source.glob("seg-*.ekva"))
    rng = random.Random(args.seed)
    trials, intact_total, good_total = [], 0, 0
    for trial in range(args.trials):
        copy = root / f"trial-{trial}"
        shutil.copytree(source, copy)
        touched: set[int] = set()
        where = []
        for _ in range(args.flips):
            number = rng.randrange(len(segments))
            path = copy / segments[number].name
            data = bytearray(path.read_bytes())
            offset = rng.randrange(len(data))
            data[offset] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(data))
            hit = [frame for (name, start), frame in extents.items()
                   if name == path.name and start <= offset < start + record]
            touched.update(hit)
            where.append({"segment": "closed" if number == 0 else "newest", "offset": offset,
                          "in": "record" if hit else "header"})
        reopened = _archive(copy, args, segment_bytes)
        good = set(_checking(reopened, args))
        intact = set(range(2 * args.records)) - touched
        trials.append({"flips": where, "intact": len(intact), "recovered_that_check": len(good & intact),
                       "damaged_recovered_whole": len(good & touched), "bad_records": reopened.bad_records,
                       "torn_bytes": reopened.torn_bytes})
        intact_total += len(intact)
        good_total += len(good & intact)
        reopened.close()
        shutil.rmtree(copy)
    return {"record_bytes": record, "records": 2 * args.records, "trials": trials, "flips_per_trial": args.flips,
            "intact_records": intact_total, "intact_recovered": good_total,
            "intact_lost": intact_total - good_total,
            "trials_losing_an_intact_record": sum(t["recovered_that_check"] < t["intact"] for t in trials)}


# ---------------------------------------------------------------------------------------------- command
def run_faults(args: argparse.Namespace) -> int:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"enospc", "flips"}
    if unknown:
        raise ValueError(f"--parts: unknown part(s) {sorted(unknown)} (known: enospc, flips)")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="edgekv-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    result: dict = {"provenance": provenance(),
                    "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}}
    if "enospc" in parts:
        result["enospc"] = enospc(args, root)
        e = result["enospc"]
        if "skipped" in e:
            print(f"enospc: skipped ({e['skipped']})")
        else:
            print(f"enospc: {e['pairs_each_phase']} pairs while the disk was full, {e['pairs_each_phase']} after: "
                  f"written {e['written']}, lost to the full disk {e['lost_to_the_full_disk']} (counted as dropped: "
                  f"{e['dropped_counted']}, disk_full reported: {e['disk_full_reported']}); on reopen "
                  f"{e['recovered_that_check']} of {e['written']} written pairs check "
                  f"({e['after_space_returned_that_check']} of {e['written_after_space_returned']} written after "
                  f"space returned)")
    if "flips" in parts:
        result["flips"] = flips(args, root)
        f = result["flips"]
        print(f"flips: {args.trials} trials x {f['flips_per_trial']} flipped byte(s) in {f['records']} records "
              f"(two segments): {f['intact_recovered']} of {f['intact_records']} untouched records recovered, "
              f"{f['intact_lost']} lost; {f['trials_losing_an_intact_record']} trial(s) lost an untouched record")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    write_figures(result, args.json, args.plot, _plot)
    return 0


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    e = result.get("enospc", {})
    if e and "skipped" not in e:
        names = ["written", "recovered\nthat check", "written after\nspace returned", "of those,\nthat check"]
        values = [e["written"], e["recovered_that_check"], e["written_after_space_returned"],
                  e["after_space_returned_that_check"]]
        axes[0].bar(names, values, color=["tab:blue", "tab:green", "tab:blue", "tab:green"])
        axes[0].set_title(f"ENOSPC episode: {e['lost_to_the_full_disk']} pairs lost to the full disk", fontsize=9)
    f = result.get("flips", {})
    if f:
        trials = f["trials"]
        axes[1].plot([t["intact"] for t in trials], label="untouched records", color="tab:blue")
        axes[1].plot([t["recovered_that_check"] for t in trials], label="recovered, checking", color="tab:green")
        axes[1].set_xlabel("trial")
        axes[1].set_ylim(0, f["records"] + 1)
        axes[1].legend(fontsize=8)
        axes[1].set_title(f"{f['flips_per_trial']} flipped byte(s) per trial: {f['intact_recovered']} of "
                          f"{f['intact_records']} recovered", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
