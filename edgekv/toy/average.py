"""``edgekv average-toy OUT_DIR DIR DIR [...]``: one toy checkpoint whose weights are the mean of several.

Rounds of ``train-toy --init`` that go on from one checkpoint stay in one basin of the loss, where the element-wise
mean of their weights is a model of its own that often keeps what each learned (a "model soup": Wortsman et al.,
*Model soups: averaging weights of multiple fine-tuned models improves accuracy without increasing inference time*,
ICML 2022, the uniform soup of their Section 3). Issue 27: two rounds of ``world-mild-exposed`` from W12a (then the
shipped 112 x 112 toy) learned the over-exposed backgrounds it took for white things and lost some of its long
memory; the mean of W12a and the second round got most of the long memory back and half of the held-out gain, and
one diluted round from that mean kept both (X112c, shipped until X112L, a lured round from it, replaced it;
docs/measurements.md, "The toys take near-white background for white things"). The shipped toy since, AVW, is such a
mean too: X112L and X112W, a lured round from X112L that read look-alikes better and lost `where`; the mean kept every
target and most of the lured gain (docs/measurements.md, "Look-alikes in the tower"). The mean is taken in fp32 and
written as ``train-toy`` writes a checkpoint (fp16), with a card that names every checkpoint averaged and its lineage,
and the held-out accuracy measured as ``train-toy``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Callable

import torch

from edgekv.toy.card import write_model_card
from edgekv.toy.model import RESOLUTION, save_checkpoint, set_max_positions, with_max_positions


def _resolution(path: Path) -> tuple[int, int]:
    config = json.loads((path / "config.json").read_text())
    side = (config.get("edgekv_toy") or {}).get("resolution") or list(RESOLUTION)
    return int(side[0]), int(side[1])


def average(out_dir: str | Path, inputs: list[str | Path], weights: list[float] | None = None,
            heldout_streams: int = 200, log: Callable[[str], None] = print) -> dict:
    """Write the weighted mean of the toy checkpoints ``inputs`` (same widths, depths and resolution) to
    ``out_dir`` and return its card. ``weights`` (default equal) are normalized to sum to 1. Toys trained over
    different temporal ranges (``max_position_embeddings``) can be averaged: the mean takes the widest, which is
    what a session re-bases a capped cache at (its half); the card lists the inputs' ranges when they differ."""
    from edgekv.toy.train import _from_checkpoint, _lineage, _machine

    if len(inputs) < 2:
        raise ValueError(f"average-toy needs at least two checkpoints, got {len(inputs)}")
    weights = [1.0] * len(inputs) if weights is None else list(weights)
    if len(weights) != len(inputs) or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"--weights: one non-negative weight per checkpoint ({len(inputs)}), not all zero; "
                         f"got {weights}")
    paths = [Path(p) for p in inputs]
    for path in paths:
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: no config.json there (give toy checkpoint directories)")
    started = time.perf_counter()
    total = sum(weights)
    model, width, layers = _from_checkpoint(paths[0])
    resolution = _resolution(paths[0])
    mean = {name: param.detach().double() * (weights[0] / total) for name, param in model.named_parameters()}
    positions = [int(model.config.text.max_position_embeddings)]
    for path, weight in zip(paths[1:], weights[1:]):
        other, _, _ = _from_checkpoint(path)
        positions.append(int(other.config.text.max_position_embeddings))
        if with_max_positions(other.config, positions[0]) != model.config:
            raise ValueError(f"{path}: its config differs from {paths[0]}'s (only toys of one shape can be averaged)")
        if _resolution(path) != resolution:
            raise ValueError(f"{path}: trained at {_resolution(path)}, {paths[0]} at {resolution}")
        for name, param in other.named_parameters():
            mean[name] += param.detach().double() * (weight / total)
        del other
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(mean[name].to(param.dtype))
    if max(positions) != positions[0]:
        set_max_positions(model, max(positions))
    parents = [_lineage(path) for path in paths]
    first = json.loads((paths[0] / "card.json").read_text()) if (paths[0] / "card.json").is_file() else {}
    command = f"edgekv average-toy {out_dir} {' '.join(str(p) for p in paths)}"
    if any(w != weights[0] for w in weights):
        command += " --weights " + ",".join(f"{w:g}" for w in weights)
    card = {"command": command, "averaged": parents, "weights": [w / total for w in weights], "steps": 0,
            "width": width, "layers": layers, "vision_width": model.config.vision.hidden_size,
            "vision_depth": model.config.vision.depth, "curriculum": first.get("curriculum", "full"),
            "world": first.get("world"), "aux_weight": first.get("aux_weight"), "machine": _machine(),
            "threads": torch.get_num_threads(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__, "parameters": sum(p.numel() for p in model.parameters()), "history": [],
            "fps": first.get("fps", 2.0), "resolution": list(resolution),
            "max_position_embeddings": model.config.text.max_position_embeddings}
    if len(set(positions)) > 1:
        card["averaged_positions"] = positions
    save_checkpoint(model, out_dir, card, resolution=resolution)
    card["wall_time_s"] = round(time.perf_counter() - started, 1)
    if heldout_streams:
        from edgekv.eval.toy_accuracy import evaluate as heldout_accuracy

        card["heldout_accuracy"] = heldout_accuracy(str(out_dir), heldout_streams)
        log(json.dumps({"heldout_accuracy": card["heldout_accuracy"]["accuracy"]}))
    write_model_card(out_dir, card)
    return card


def add_average_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", help="where the averaged checkpoint goes")
    parser.add_argument("inputs", nargs="+", metavar="DIR",
                        help="toy checkpoint directories of one shape (best: rounds from a common --init)")
    parser.add_argument("--weights", default=None,
                        help="comma-separated weight per checkpoint (normalized; default equal)")
    parser.add_argument("--heldout-streams", type=int, default=200,
                        help="held-out streams for the model card's accuracy (edgekv eval toy); 0 = skip")
    parser.set_defaults(func=run_average)


def run_average(args: argparse.Namespace) -> int:
    try:
        weights = None if args.weights is None else [float(w) for w in args.weights.split(",")]
    except ValueError:
        print(f"edgekv average-toy: --weights takes comma-separated numbers, got {args.weights!r}")
        return 2
    if args.heldout_streams < 0:
        print(f"edgekv average-toy: --heldout-streams must be at least 0, got {args.heldout_streams}")
        return 2
    try:
        card = average(args.out_dir, args.inputs, weights, args.heldout_streams,
                       log=lambda line: print(line, flush=True))
    except ValueError as exc:
        print(f"edgekv average-toy: {exc}")
        return 2
    print(json.dumps({"wrote": args.out_dir, "averaged": len(args.inputs),
                      "heldout": (card.get("heldout_accuracy") or {}).get("accuracy", {})}))
    return 0
