"""``edgekv`` command line: serve, build, make-tiny-checkpoint, train-toy, average-toy, eval, plan,
quantize, calibrate, bench, bag, ask.

Each command's options are added only when that command is run, and each command imports what it
needs only then: ``edgekv --help`` lists the commands without loading torch (a second, not ten, on a
Jetson). One handler turns a user's mistake (a missing file, a bad value) into one line on stderr and
exit status 2; ``EDGEKV_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from edgekv.apps.args import (
    HelpFormatter,
    add_config_arguments,
    config_from_args,
    first_positional,
    quiet_broken_pipe,
    version_string,
)
from edgekv.config_names import config_help, resolve_config
from edgekv.apps.daemon.camera import add_daemon_arguments, run_daemon
from edgekv.threads import prepare_process


# ---------------------------------------------------------------------------------------------- commands
def _add_serve(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, model_positional=True)
    add_daemon_arguments(parser)
    parser.epilog = ("example: edgekv serve models/tiny --source 'synthetic:shapes?fps=4' --port 8080 "
                     "--policy infinipot_v --max-tokens 2048")
    parser.set_defaults(func=lambda args: run_daemon(args, "edgekv serve"))


def _add_build(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, model_positional=True)
    group = parser.add_argument_group("engines")
    group.add_argument("--backend", choices=["onnxruntime", "tensorrt"], default=None,
                       help="default: the engines the config asks for (onnxruntime if it asks for torch only)")
    group.add_argument("--engine-dir", default=None, help="where bundles go (default: engines.engine_dir of the config)")
    group.add_argument("--force", action="store_true", help="rebuild even if a matching bundle exists")
    group.add_argument("--quiet", action="store_true", help="no progress output")
    parser.epilog = "example: edgekv build models/tiny --resolution 224 224 --max-tokens 2048 --dtype fp32"
    parser.set_defaults(func=_build)


def _build(args: argparse.Namespace) -> int:
    from edgekv.apps.daemon.cameras import engines_config
    from edgekv.engines.build import build

    # several cameras (video.sources) share engines loaded for the first camera's cache, not the whole cache cap
    config = engines_config(config_from_args(args))
    backend = args.backend or _engine_backend(config)
    bundle, manifest = build(config, backend, engine_dir=args.engine_dir, force=args.force, progress=not args.quiet)
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


def _add_make_tiny(parser: argparse.ArgumentParser) -> None:
    from edgekv.model.tiny import PRESETS

    parser.add_argument("dir", help="directory to write (config.json, model.safetensors, tokenizer files)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                        help="tiny for tests and demos; 3b is the real Qwen2.5-VL-3B shape (about 15 GB in fp32)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="dtype of the stored weights (bf16 halves a 3b checkpoint to about 7.5 GB)")
    parser.set_defaults(func=_make_tiny)


def _make_tiny(args: argparse.Namespace) -> int:
    from edgekv.model.tiny import make_tiny_checkpoint

    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    out = make_tiny_checkpoint(Path(args.dir), preset=args.preset, seed=args.seed, dtype=dtype)
    print(f"wrote a random-weight Qwen2.5-VL checkpoint ({args.preset}) to {out}")
    print("random weights give meaningless answers; point model.path at real Qwen2.5-VL weights for real ones")
    return 0


def _add_plan(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device-memory", type=float, default=None,
                        help="device memory in GB (default: this machine's: a Jetson's unified memory, else the "
                             "GPU's for model.device cuda / auto with a GPU, else the RAM)")
    parser.add_argument("--model", default=None, help="model directory (config.json), or builtin:toy; required "
                                                      "without --config")
    parser.add_argument("--config", default=None, type=resolve_config,
                        help=config_help("a deployment: plan for its model, dtype and grid, and check its cache cap"))
    parser.add_argument("--resolution", type=int, nargs=2, default=[448, 448], metavar=("H", "W"),
                        help="video.resolution of the deployment")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "fp16", "bf16"], help="weight and cache dtype")
    parser.add_argument("--weights-gb", type=float, default=None, help="weight bytes of quantized engines, in GB")
    parser.add_argument("--reserve-gb", type=float, default=2.0, help="OS + CUDA context reserve, in GB")
    parser.add_argument("--lm-head", choices=["as_loaded", "int8"], default="as_loaded",
                        help="model.lm_head (without --config; a config's own value is used with it)")
    parser.add_argument("--flash-tbw", type=float, default=None, metavar="TB",
                        help="the flash's endurance rating in terabytes written: the years the memory's writes "
                             "(archive, snapshots, evidence frames) take to reach it")
    parser.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    from edgekv.calibration.plan import check_config, plan
    from edgekv.model.builtin import resolve_model_path

    if args.flash_tbw is not None and not 0 < args.flash_tbw < float("inf"):  # NaN too: it printed "nan years"
        raise ValueError(f"--flash-tbw: the flash's rating must be a positive number of terabytes, got "
                         f"{args.flash_tbw:g}")
    if args.device_memory is None:
        from edgekv.calibration.plan import memory_here
        from edgekv.config import load_config

        device = load_config(args.config).model.device if args.config else "auto"
        args.device_memory, where = memory_here(device)
        args.device_memory = round(args.device_memory, 2)
        print(f"device memory {args.device_memory:.2f} GiB: {where} (--device-memory GB plans for another device)")
    from edgekv.calibration.plan import flash_lines
    from edgekv.config import EdgeKVConfig, load_config

    if args.config:
        result, verdict = check_config(args.config, args.device_memory, model_dir=args.model,
                                       reserve_gb=args.reserve_gb, weights_gb=args.weights_gb)
        print(result.summary())
        print(verdict)
        config = load_config(args.config)
        model_dir = resolve_model_path(str(args.model if args.model is not None else config.model.path))
        print("\n".join(flash_lines(config, model_dir, result.tokens_per_pair, args.flash_tbw)))
        return 0
    if args.model is None:
        raise ValueError("--model: a model directory is needed (or --config)")
    model_dir = resolve_model_path(args.model)
    result = plan(device_memory_gb=args.device_memory, model_dir=model_dir, resolution=tuple(args.resolution),
                  weight_dtype=args.dtype, weights_gb=args.weights_gb, reserve_gb=args.reserve_gb, lm_head=args.lm_head)
    print(result.summary())
    defaults = EdgeKVConfig().with_overrides(model={"dtype": args.dtype})  # the archive's defaults at this shape
    print("\n".join(flash_lines(defaults, model_dir, result.tokens_per_pair, args.flash_tbw)))
    return 0


def _add_calibrate(parser: argparse.ArgumentParser) -> None:
    from edgekv.calibration.calibrate import add_calibrate_arguments, calibrate_main

    add_calibrate_arguments(parser)
    parser.set_defaults(func=calibrate_main)


def _add_train_toy(parser: argparse.ArgumentParser) -> None:
    from edgekv.toy.cli import add_train_arguments

    add_train_arguments(parser)


def _add_average_toy(parser: argparse.ArgumentParser) -> None:
    from edgekv.toy.average import add_average_arguments

    add_average_arguments(parser)


def _add_eval(parser: argparse.ArgumentParser) -> None:
    from edgekv.eval.cli import add_eval_arguments

    add_eval_arguments(parser)
    parser.set_defaults(func=lambda args: args.run(args))


def _add_bag(parser: argparse.ArgumentParser) -> None:
    from edgekv.video.rosbag import add_bag_arguments

    add_bag_arguments(parser)


def _add_ask(parser: argparse.ArgumentParser) -> None:
    from edgekv.apps.ask import add_local_arguments
    from edgekv.apps.outputs.mqtt import add_ask_arguments

    add_ask_arguments(parser)
    add_local_arguments(parser)
    parser.set_defaults(func=_ask)


def _ask(args: argparse.Namespace) -> int:
    """``--fleet``: every device over MQTT; else the daemon at ``--url`` over HTTP."""
    if args.fleet:
        from edgekv.apps.outputs.mqtt import run_ask

        local_only = [option for option, given in (("--url", args.url is not None), ("--stream", args.stream),
                                                   ("--token-env", args.token_env is not None),
                                                   ("--chat", args.chat),
                                                   ("--evidence", args.evidence is not None)) if given]
        if local_only:
            raise ValueError(f"{', '.join(local_only)}: only without --fleet (they ask the daemon on this machine "
                             f"over HTTP; --fleet asks every device over MQTT)")
        if not args.question:
            raise ValueError("--fleet: a question is needed")
        return run_ask(args)
    from edgekv.apps import ask

    fleet_only = [f"--{name.replace('_', '-')}" for name in ("broker", "device", "topic_prefix", "username",
                                                              "password_env")  # TLS files: HTTPS's too
                  if getattr(args, name) is not None]
    if fleet_only:
        raise ValueError(f"{', '.join(fleet_only)}: only with --fleet (without it edgekv ask asks the daemon at "
                         f"--url over HTTP)")
    return ask.run(argparse.Namespace(**{**vars(args), "timeout": 120.0 if args.timeout is None else args.timeout}))


def _add_quantize(parser: argparse.ArgumentParser) -> None:
    from edgekv.calibration.quantize import add_quantize_arguments

    add_quantize_arguments(parser)


def _add_forget(parser: argparse.ArgumentParser) -> None:
    from edgekv.apps.forget import add_forget_arguments

    add_forget_arguments(parser)


def _add_rekey(parser: argparse.ArgumentParser) -> None:
    from edgekv.apps.rekey import add_rekey_arguments

    add_rekey_arguments(parser)


def _add_bench(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    from edgekv.apps.bench import add_arguments

    add_arguments(parser, argv)
    parser.set_defaults(func=lambda args: args.run(args))


COMMANDS: dict[str, tuple[str, Callable]] = {
    "serve": ("watch a video source and answer questions (the daemon; a config file is optional)", _add_serve),
    "build": ("export the deployment's ONNX graphs (and TensorRT engines) with a manifest; same flags as serve",
              _add_build),
    "make-tiny-checkpoint": ("write a random-weight checkpoint with the real Qwen tokenizer", _add_make_tiny),
    "train-toy": ("train the toy Qwen2.5-VL on synthetic event streams", _add_train_toy),
    "average-toy": ("one toy checkpoint whose weights are the mean of several (a model soup)", _add_average_toy),
    "eval": ("answer-accuracy benchmarks (toy needle streams, MLVU / Video-MME)", _add_eval),
    "plan": ("largest cache budget that fits a device's memory (an estimate)", _add_plan),
    "quantize": ("write a checkpoint's language-model linears as 4-bit weights (AutoAWQ GEMM layout)", _add_quantize),
    "calibrate": ("VaN CV thresholds for a model from sample videos", _add_calibrate),
    "bench": ("benchmarks that print and save figures (JSON + PNG)", _add_bench),
    "bag": ("write a ROS 2 bag (MCAP or sqlite3) from a video source (then video.source: rosbag:DIR)", _add_bag),
    "ask": ("ask the daemon here one question over HTTP, or the fleet over MQTT (--fleet) gathering every "
            "device's answer", _add_ask),
    "forget": ("ask the running daemon to forget a window of stream time (cache, snapshots, archive)", _add_forget),
    "rekey": ("seal the memory on flash (snapshots, archive) with privacy's current key now, the daemon stopped",
              _add_rekey),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the command named in ``argv`` gets its options (and imports its modules)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="edgekv", formatter_class=HelpFormatter,
        description="edgekv: a streaming Qwen2.5-VL runtime with a hard KV-cache memory cap.",
        epilog="run 'edgekv COMMAND --help' for a command's options; EDGEKV_DEBUG=1 shows tracebacks of errors")
    parser.add_argument("--version", action="version", version=version_string())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen, rest = first_positional(argv)
    for name, (summary, add) in COMMANDS.items():
        command = sub.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter)
        command.add_argument("--version", action="version", version=version_string())  # README: every command
        if name == chosen:
            add(command, rest) if name == "bench" else add(command)
    return parser


def _check_figure_packages(args: argparse.Namespace) -> None:
    """A bench or eval that ends in a PNG needs matplotlib (``edgekv[bench]``): say so before it runs — an
    hours-long ``eval needle`` used to fail on its last line, at the figure."""
    import importlib.util

    graceful = args.command == "bench" and args.bench == "kernels"  # says "no plot: matplotlib missing" itself
    if args.command in ("bench", "eval") and getattr(args, "plot", None) and not graceful and importlib.util.find_spec(
            "matplotlib") is None:
        raise ImportError(f"--plot {args.plot}: the figure needs matplotlib (pip install 'edgekv[bench]'); "
                          f"--plot '' writes the JSON alone")


def main(argv: list[str] | None = None) -> int:
    # Idle OpenMP threads sleep instead of spinning: on a busy 2-core machine spinning waits dominated
    # (a 4 MB multiply: 7.99 ms spinning vs 0.059 ms passive; a toy training step 5.5 s vs 1.9 s).
    # Read by libgomp when torch loads, so set before any command imports it; the environment wins.
    prepare_process()
    for stream in (sys.stdout, sys.stderr):  # an answer the terminal's encoding cannot show is escaped, not exit 2
        if hasattr(stream, "reconfigure") and (stream.errors or "strict") == "strict":
            stream.reconfigure(errors="backslashreplace")
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(argv).parse_args(argv)
    except KeyboardInterrupt:  # while the command's modules import (torch: seconds) it was a traceback
        print("edgekv: interrupted", file=sys.stderr)
        return 130
    except ImportError as exc:  # the command's modules need an extra not installed ('edgekv eval --help', no OpenCV)
        if os.environ.get("EDGEKV_DEBUG"):
            raise
        from edgekv.apps.daemon.startup import one_line

        print(f"edgekv {first_positional(argv)[0]}: {one_line(exc)}", file=sys.stderr)
        return 2
    try:
        _check_figure_packages(args)
        return args.func(args)
    except KeyboardInterrupt:
        print(f"edgekv {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return quiet_broken_pipe()
    except (ValueError, OSError, RuntimeError, ImportError) as exc:  # a user's mistake or a missing package
        if os.environ.get("EDGEKV_DEBUG"):
            raise
        from edgekv.apps.daemon.startup import one_line

        print(f"edgekv {args.command}: {one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
