"""What the benches share: provenance of a figure, the JSON + PNG writer, choice lists, a scratch model, a
daemon in a child process (its own interpreter: the clients of a bench never share its GIL), the bytes a decode
token reads."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import threading

    import torch


def sync_device(device) -> None:
    """Wait for a device's queued work before a host clock is read (a no-op on CPU, where every op runs in the caller)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def device_argument(text: str) -> str:
    """argparse ``type`` for a bench's ``--device``: cpu, cuda, cuda:N or auto (checked against the machine later)."""
    import argparse

    name = text.strip().lower()
    if name in ("cpu", "cuda", "auto") or (name.startswith("cuda:") and name[5:].isdigit()):
        return name
    raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or auto, got {text!r}")


def provenance() -> dict:
    """What a figure was measured with: versions, the git commit of this checkout, the date (UTC)."""
    import datetime
    import importlib.metadata
    import subprocess

    import edgekv

    versions = {"edgekv": edgekv.__version__, "python": platform.python_version()}
    for package in ("torch", "numpy", "transformers", "onnxruntime", "opencv-python-headless", "triton"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=5).stdout.strip()) if commit else None
    except (OSError, subprocess.TimeoutExpired):
        commit = dirty = None
    return {"versions": versions, "commit": commit, "dirty": dirty,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def comma_choices(text: str, known, flag: str, what: str) -> list[str]:
    """``"a, b, a"`` -> ``["a", "b"]``, each checked against ``known``: an unknown one, or none at all, is a
    ValueError naming the flag (the command's one line and exit 2; a SystemExit with text exited 1), and one given
    twice is measured once (not a second row under the same name)."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    for name in names:
        if name not in known:
            raise ValueError(f"{flag}: unknown {what} {name!r} (known: {', '.join(known)})")
    if not names:
        raise ValueError(f"{flag}: give at least one {what} (known: {', '.join(known)})")
    return names


def check_outputs(json_path: str | None, plot_path: str | None) -> None:
    """Before a run, not at its end: the JSON and the PNG are two files (one path for both wrote the figure over
    the JSON and said 'wrote' twice), and their folders exist (a soak of hours stopped by Ctrl-C lost its figures
    to a folder not yet there)."""
    if json_path and plot_path and Path(json_path).resolve() == Path(plot_path).resolve():
        raise ValueError(f"--json and --plot are the same file {json_path!r}: the figure would replace the JSON")
    for path in (json_path, plot_path):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)


def write_figures(result: dict, json_path: str, plot_path: str | None, plot, indent: int = 2) -> None:
    """Every bench's last step: the JSON, then the PNG through ``plot(result, path)`` unless ``plot_path`` is empty;
    their folders made first (a run of minutes is not lost at its end to a folder not yet there)."""
    check_outputs(json_path, plot_path)
    Path(json_path).write_text(json.dumps(result, indent=indent))
    print(f"wrote {json_path}")
    if plot_path:
        plot(result, plot_path)
        print(f"wrote {plot_path}")


def model_or_tiny(model: str | None, scratch: str | Path) -> str:
    """The ``--model`` given, or a fresh tiny random checkpoint under ``scratch``."""
    if model is not None:
        return model
    from edgekv.model.tiny import make_tiny_checkpoint

    return str(make_tiny_checkpoint(Path(scratch) / "tiny", preset="tiny", seed=0))


def serve_daemon(sections: dict, log_path: str, port_queue) -> None:
    """Child process: the daemon of ``sections`` (config overrides, on top of the file ``sections["_config"]`` when
    given) paced like a camera, or replaying its source at full speed when ``sections["_replay"]``; its HTTP port goes
    back through ``port_queue``."""
    import argparse
    import sys
    import threading

    from edgekv.apps.daemon.loop import Daemon
    from edgekv.config import EdgeKVConfig, load_config

    sections = dict(sections)
    replay = sections.pop("_replay", False)
    file = sections.pop("_config", None)  # a deployment's config file, the overrides on top
    config = (EdgeKVConfig() if file is None else load_config(file)).with_overrides(**sections)
    args = argparse.Namespace(ask=[], ask_every=0, max_frames=None, no_server=False, no_stdin=True, quiet=True,
                              realtime=not replay, exit_at_end=False, voice_wav=None)
    with open(log_path, "w") as out:
        if config.video.sources:  # several cameras on one model, as edgekv-camera runs them
            from edgekv.apps.daemon.cameras import CameraSet

            runner = CameraSet(config, args, out=out)
            first = runner.first
        else:
            runner = first = Daemon(config, args, out=out)

        def report_port() -> None:
            runner.ready.wait(300)
            port_queue.put(first.server.port if first.server is not None else None)

        threading.Thread(target=report_port, daemon=True).start()
        sys.exit(runner.run())


def daemon_port(child, port_queue, limit_s: float = 300.0) -> int | None:
    """The child daemon's port once it listens; None when the child died first (its log says why)."""
    import queue
    import time

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            return port_queue.get(timeout=1.0)
        except queue.Empty:
            if not child.is_alive():
                return None
    return None


class ClientThreads:
    """Client threads of a bench load (``threads``), started together and stopped through ``_stop``."""

    threads: list
    _stop: "threading.Event"
    join_s = 60.0

    def start(self):
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self.threads:
            thread.join(self.join_s)


def bytes_per_token(language: torch.nn.Module, kv_slots: int, kv_bytes_per_slot: int) -> int:
    """Weight bytes one decode step reads (each parameter and buffer once — 4-bit weights, their scales and
    zero points are buffers; the tied embedding once, in full, as the lm_head) plus the K/V of ``kv_slots`` slots."""
    seen, total = set(), 0
    for parameter in [*language.parameters(), *language.buffers()]:
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        total += parameter.numel() * parameter.element_size()
    return total + kv_slots * kv_bytes_per_slot


def hf_decode(model_dir: str, dtype: "torch.dtype", prompt: int, tokens: int, repeats: int,
              device: "torch.device | str" = "cpu") -> dict:
    """tok/s of transformers' greedy ``generate``, same prompt: a logits processor stamps the time at each
    step, so a token's time is the gap between consecutive stamps (prefill excluded, one run suffices)."""
    import gc
    import statistics
    import time

    import torch
    from transformers import LogitsProcessor, LogitsProcessorList, Qwen2_5_VLForConditionalGeneration

    from edgekv.model.builtin import resolve_model_path

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if device.type == "cuda":  # the step's kernels done: the stamp is the token's, not its launch's
                torch.cuda.synchronize(device)
            self.stamps.append(time.perf_counter())
            return scores

    device = torch.device(device)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(resolve_model_path(model_dir)), dtype=dtype)
    model = model.to(device).eval()
    vocab = model.config.text_config.vocab_size if hasattr(model.config, "text_config") else model.config.vocab_size
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    rates, generated = [], []
    for _ in range(repeats):
        clock = StepClock()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False, logits_processor=LogitsProcessorList([clock]))
        generated = out[0, prompt:].tolist()
        rates.append((len(clock.stamps) - 1) / (clock.stamps[-1] - clock.stamps[0]))
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"tok_s": statistics.median(rates), "tok_s_runs": rates, "tokens": generated}
