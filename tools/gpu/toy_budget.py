"""Size a toy training run to the device time left (tools/gpu/lease_toy.sh, issue 27).

Reads the card of a short calibration run (``edgekv train-toy ... --vision-steps V --steps Q``: its warm-up and
question steps timed on this machine with the same sizes, curriculum and workers) and prints ``VISION_STEPS
QA_STEPS`` that fill ``--seconds`` with ``--vision-share`` of it in the warm-up. A short run of a curriculum walks
all its stages in proportion (a stage is chosen by the step's share of the run), so its mean step time is the
long run's. A step's time is taken between the calibration's last two log lines, after its start-up (workers
spawned, first batches drawn), which ``--overhead`` leaves room for instead.
"""

from __future__ import annotations

import argparse
import json
import sys


def _per_step(records: list[dict], step_key: str, start_s: float) -> float:
    """Seconds a step: between the last two log lines where there are two (the workers' start-up and the first
    batches are before the first), else from ``start_s`` to the last one."""
    if len(records) >= 2:
        (a, b) = records[-2:]
        return max(b["seconds"] - a["seconds"], 1e-3) / max(b[step_key] - a[step_key], 1)
    return max(records[-1]["seconds"] - start_s, 1e-3) / records[-1][step_key]


def budget(card: dict, seconds: float, vision_share: float, overhead_s: float = 30.0,
           minimum: tuple[int, int] = (50, 100)) -> tuple[int, int]:
    vision, questions = card.get("vision_history") or [], card.get("history") or []
    if not vision or not questions:
        raise ValueError("the calibration card has no timed warm-up or question steps (run it with "
                         "--vision-steps and --steps of at least one log interval)")
    vision_s = _per_step(vision, "vision_step", 0.0)
    question_s = _per_step(questions, "step", vision[-1]["seconds"])
    usable = max(seconds - overhead_s, 0.0)
    return (max(minimum[0], int(vision_share * usable / vision_s)),
            max(minimum[1], int((1 - vision_share) * usable / question_s)))


def pick_batch(profile: dict, products: str = "tf32") -> int | None:
    """The batch size whose step trains on the most streams a second in a step profile
    (tools/gpu/toy_step_profile.py's JSON: samples a step over wall ms a step, rows with ``products``), or None
    when it has no such row."""
    rows = [row for row in profile.get("rows", []) if row.get("products", products) == products
            and row.get("wall_ms_per_step", 0) > 0 and row.get("samples", 0) > 0]
    if not rows:
        return None
    return int(max(rows, key=lambda row: (row["samples"] / row["wall_ms_per_step"], -row["batch"]))["batch"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("card", nargs="?", help="card.json of the calibration run")
    parser.add_argument("--seconds", type=float, help="wall time the run may take")
    parser.add_argument("--pick-batch", metavar="PROFILE_JSON",
                        help="instead: print the batch size with the most streams a second in this step profile "
                             "(toy_step_profile.py's JSON; lease_toy.sh's BATCH=auto)")
    parser.add_argument("--fallback", type=int, default=32,
                        help="with --pick-batch: the batch printed when the profile is missing or has no rows")
    parser.add_argument("--vision-share", type=float, default=0.3, help="share of it for the vision warm-up")
    parser.add_argument("--overhead", type=float, default=30.0,
                        help="seconds to leave for the run's start-up (twice: warm-up and question workers) and saving")
    args = parser.parse_args(argv)
    if args.pick_batch is not None:
        try:
            with open(args.pick_batch) as handle:
                picked = pick_batch(json.load(handle))
        except (OSError, ValueError) as exc:
            print(f"toy_budget: {args.pick_batch}: {exc}; batch {args.fallback}", file=sys.stderr)
            picked = None
        print(picked if picked is not None else args.fallback)
        return 0
    if args.card is None or args.seconds is None:
        parser.error("a calibration card and --seconds (or --pick-batch PROFILE_JSON)")
    try:
        with open(args.card) as handle:
            steps = budget(json.load(handle), args.seconds, args.vision_share, args.overhead)
    except (OSError, ValueError, KeyError) as exc:
        print(f"toy_budget: {args.card}: {exc}", file=sys.stderr)
        return 2
    print(*steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
