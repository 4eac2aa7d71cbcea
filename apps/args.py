"""The command-line arguments the ``edgekv`` commands share: where a deployment comes from (a YAML file and
flags that override its keys), the help formatter and the version line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from edgekv.config_names import resolve_config, shipped_names
from edgekv.helpformat import HelpFormatter  # noqa: F401 (the apps import it from here)
from edgekv.threads import threads_argument


def add_config_arguments(parser: argparse.ArgumentParser, model_positional: bool) -> None:
    """Where the deployment comes from: an optional YAML file, then flags that override its keys."""
    from edgekv.config import POLICIES, EdgeKVConfig

    group = parser.add_argument_group("deployment (a YAML file, and flags that override its keys)")
    if model_positional:
        group.add_argument("model_dir", nargs="?", metavar="MODEL_DIR",
                           help="Qwen2.5-VL checkpoint directory (model.path); optional with --config")
    group.add_argument("--config", type=resolve_config,
                       help="deployment YAML, or the name of one shipped with edgekv (" +
                            shipped_names() + "); defaults apply without one")
    group.add_argument("--model", dest="model_flag", metavar="DIR", help="checkpoint directory (model.path)")
    group.add_argument("--source", help="video.source: camera index, file, rtsp://..., gst:..., csi:N or synthetic:...")
    group.add_argument("--fps", type=float, help="video.fps: frames sampled per second")
    group.add_argument("--resolution", type=int, nargs=2, metavar=("H", "W"), help="video.resolution (multiples of 28)")
    group.add_argument("--loop", action="store_true", default=None, help="video.loop: play a file again at its end")
    group.add_argument("--policy", choices=POLICIES, help="cache.policy")
    group.add_argument("--max-tokens", type=int, help="cache.max_tokens: the hard cache cap M in tokens")
    group.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], help="model.dtype")
    group.add_argument("--device", help="model.device: auto, cpu, cuda or cuda:N")
    group.add_argument("--host", help="server.host: address the HTTP API binds")
    group.add_argument("--port", type=int, help="server.port (0: any free port)")
    group.add_argument("--max-new-tokens", type=int, help="generation.max_new_tokens: answer length")
    group.add_argument("--served-model-name", nargs="+", metavar="NAME",
                       help="server.served_model_name: the names the API serves the model under (answers carry the "
                            "first; requests may name any)")
    group.add_argument("--threads", type=threads_argument, metavar="N|auto",
                       help="runtime.threads: torch CPU threads")
    group.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="any other config key, value in YAML (repeatable), e.g. --set cache.sinks=1024 (a nested "
                            "section's key: --set voice.speak.enabled=true)")
    defaults = EdgeKVConfig().to_dict()
    for action in group._group_actions:  # say what applies when neither the flag nor the file sets the key
        key = _FLAG_KEYS.get(action.dest)
        if key is not None:
            section, name = key.split(".")
            action.help += f" (default: {_flow(defaults[section][name])} unless --config sets it)"


def _flow(value) -> str:
    return " ".join(str(v) for v in value) if isinstance(value, list) else str(value).lower() \
        if isinstance(value, bool) else str(value)


_FLAG_KEYS = {"source": "video.source", "fps": "video.fps", "resolution": "video.resolution", "loop": "video.loop",
              "policy": "cache.policy", "max_tokens": "cache.max_tokens", "dtype": "model.dtype",
              "device": "model.device", "host": "server.host", "port": "server.port",
              "max_new_tokens": "generation.max_new_tokens", "threads": "runtime.threads",
              "served_model_name": "server.served_model_name"}


def config_from_args(args: argparse.Namespace):
    """The deployment: ``--config`` (or the defaults), then the flags, then ``--set``; ConfigError names
    the key. Paths given on the command line are relative to the current directory."""
    from edgekv.config import ConfigError, EdgeKVConfig, assignment_sections, load_config

    config = load_config(args.config) if getattr(args, "config", None) else EdgeKVConfig()
    sections: dict[str, dict] = {}
    model_dir = getattr(args, "model_dir", None) or getattr(args, "model_flag", None)
    if model_dir:
        builtin = str(model_dir).startswith("builtin:")  # the shipped toy (edgekv/toy), not a folder here
        sections["model"] = {"path": model_dir if builtin else str(Path(model_dir).expanduser().resolve())}
    for flag, key in _FLAG_KEYS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if flag == "source" and not value.strip().isdigit() and Path(value).expanduser().is_file():
            value = str(Path(value).expanduser().resolve())
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = list(value) if isinstance(value, list) else value
    for section, values in assignment_sections(getattr(args, "set", None) or []).items():
        sections.setdefault(section, {}).update(values)
    if sections:  # one validation over flags and --set together (max_tokens and text_reserve_tokens go in pairs)
        config = config.with_overrides(label="command line", **sections)
    if config.model.path is None:
        raise ConfigError("model.path: no model directory: give MODEL_DIR (or --model DIR, or model.path in --config)")
    return config


def version_string() -> str:
    from edgekv import __version__

    return f"edgekv {__version__}"


def first_positional(argv: list[str]) -> tuple[str | None, list[str]]:
    """The first word that is not an option, and the words after it (the chosen subcommand)."""
    for index, word in enumerate(argv):
        if not word.startswith("-"):
            return word, argv[index + 1:]
    return None, []


def quiet_broken_pipe() -> int:
    """The reader of our output went away (``edgekv plan ... | head``): not an error of the command. Point
    stdout at /dev/null so the interpreter's final flush does not raise again, and exit 0."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 0
