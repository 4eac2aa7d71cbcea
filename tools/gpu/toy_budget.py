"""Size a toy training run to the device time left (tools/gpu/lease_toy.sh, issue 27).

Reads the card of a short calibration run (``edgekv train-toy ... --vision-steps V --steps Q``: its warm-up and
question steps timed on this machine with the same sizes, curriculum and workers) and prints ``VISION_STEPS
QA_STEPS`` that fill ``--seconds`` with ``--vision-share`` of it in the warm-up. A short run of a curriculum walks
all its stages in proportion (a stage is chosen by the step's share of the run), so its mean step time is the
long run's. The calibration's seconds include its start-up (workers spawned, first batches drawn): the estimate
errs long per step, so the run ends early rather than late.
"""

from __future__ import annotations

import argparse
import json
import sys


def budget(card: dict, seconds: float, vision_share: float, overhead_s: float = 30.0,
           minimum: tuple[int, int] = (50, 100)) -> tuple[int, int]:
    vision, questions = card.get("vision_history") or [], card.get("history") or []
    if not vision or not questions:
        raise ValueError("the calibration card has no timed warm-up or question steps (run it with "
                         "--vision-steps and --steps of at least one log interval)")
    vision_s = vision[-1]["seconds"] / vision[-1]["vision_step"]
    question_s = max(questions[-1]["seconds"] - vision[-1]["seconds"], 1e-3) / questions[-1]["step"]
    usable = max(seconds - overhead_s, 0.0)
    return (max(minimum[0], int(vision_share * usable / vision_s)),
            max(minimum[1], int((1 - vision_share) * usable / question_s)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("card", help="card.json of the calibration run")
    parser.add_argument("--seconds", type=float, required=True, help="wall time the run may take")
    parser.add_argument("--vision-share", type=float, default=0.3, help="share of it for the vision warm-up")
    parser.add_argument("--overhead", type=float, default=30.0, help="seconds of start-up and saving to leave")
    args = parser.parse_args(argv)
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
