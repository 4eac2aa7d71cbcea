"""``edgekv`` command line: make-tiny-checkpoint, train-toy, eval, build, plan, calibrate, bench."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _make_tiny(args: argparse.Namespace) -> int:
    from edgekv.model.tiny import make_tiny_checkpoint

    out = make_tiny_checkpoint(Path(args.dir), preset=args.preset, seed=args.seed)
    print(f"wrote a random-weight Qwen2.5-VL checkpoint ({args.preset}) to {out}")
    print("random weights give meaningless answers; point model.path at real Qwen2.5-VL weights for real ones")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from edgekv.calibration.plan import plan

    result = plan(device_memory_gb=args.device_memory, model_dir=args.model, resolution=tuple(args.resolution),
                  weight_dtype=args.dtype, weights_gb=args.weights_gb, reserve_gb=args.reserve_gb)
    print(result.summary())
    return 0


def _build(args: argparse.Namespace) -> int:
    from edgekv.config import load_config
    from edgekv.engines.build import build
    from edgekv.engines.manifest import EngineError

    try:
        config = load_config(args.config)
        backend = args.backend or _engine_backend(config)
        bundle, manifest = build(config, backend, model_dir=args.model, engine_dir=args.engine_dir, force=args.force,
                                 progress=not args.quiet)
    except (EngineError, ValueError) as exc:
        print(f"edgekv build: {exc}", file=sys.stderr)
        return 2
    print(f"engines: {bundle}")
    for name, entry in manifest.files.items():
        print(f"  {name:12s} {entry['file']:20s} {entry['bytes'] / 2 ** 20:9.2f} MiB")
    print(f"  manifest     {bundle / 'manifest.json'}")
    return 0


def _engine_backend(config) -> str:
    """The engine backend a config asks for (``engines.llm`` first); onnxruntime when it asks for torch only."""
    for name in (config.engines.llm, config.engines.vision):
        if name != "torch":
            return name
    return "onnxruntime"


def _bench(args: argparse.Namespace) -> int:
    from edgekv.apps import bench

    return bench.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgekv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny-checkpoint", help="write a random-weight checkpoint with the real Qwen tokenizer")
    tiny.add_argument("dir")
    tiny.add_argument("--preset", default="tiny", help="tiny (default), or 3b for the real shape (large)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny)

    plan = sub.add_parser("plan", help="largest cache budget that fits a device's memory")
    plan.add_argument("--device-memory", type=float, required=True, help="device memory in GB")
    plan.add_argument("--model", required=True, help="model directory (config.json)")
    plan.add_argument("--resolution", type=int, nargs=2, default=[448, 448], metavar=("H", "W"))
    plan.add_argument("--dtype", default="bf16", choices=["fp32", "fp16", "bf16"])
    plan.add_argument("--weights-gb", type=float, default=None, help="weight bytes of quantized engines, in GB")
    plan.add_argument("--reserve-gb", type=float, default=2.0, help="OS + CUDA context reserve, in GB")
    plan.set_defaults(func=_plan)

    build = sub.add_parser("build", help="export the deployment's ONNX graphs (and TensorRT engines) with a manifest")
    build.add_argument("--config", required=True, help="deployment YAML (grid, cache capacity, dtype, engines)")
    build.add_argument("--model", default=None, help="checkpoint dir (default: model.path of the config)")
    build.add_argument("--backend", choices=["onnxruntime", "tensorrt"], default=None,
                       help="default: the engines the config asks for (onnxruntime if it only asks for torch)")
    build.add_argument("--engine-dir", default=None, help="default: engines.engine_dir of the config")
    build.add_argument("--force", action="store_true", help="rebuild even if a matching bundle exists")
    build.add_argument("--quiet", action="store_true", help="no progress output")
    build.set_defaults(func=_build)

    from edgekv.toy.cli import add_train_arguments

    add_train_arguments(sub.add_parser("train-toy", help="train the toy Qwen2.5-VL on synthetic event streams"))

    from edgekv.eval.cli import add_eval_arguments

    evaluate = sub.add_parser("eval", help="answer-accuracy benchmarks (toy needle streams, MLVU / Video-MME)")
    add_eval_arguments(evaluate)
    evaluate.set_defaults(func=lambda args: args.run(args))

    from edgekv.calibration.calibrate import add_calibrate_arguments, calibrate_main

    calibrate = sub.add_parser("calibrate", help="VaN CV thresholds for a model from sample videos")
    add_calibrate_arguments(calibrate)
    calibrate.set_defaults(func=calibrate_main)

    from edgekv.apps.bench import add_arguments

    bench = sub.add_parser("bench", help="benchmarks that print and save figures (JSON + PNG)")
    add_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Idle OpenMP threads sleep instead of spinning: on a busy 2-core machine spinning waits dominated
    # (a 4 MB multiply: 7.99 ms spinning vs 0.059 ms passive; a toy training step 5.5 s vs 1.9 s).
    # Read by libgomp when torch loads, so set before any command imports it; the environment wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
