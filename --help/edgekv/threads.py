"""CPU thread policy (issue 17): how many threads torch computes with, and how idle OpenMP threads wait.

Two settings, two moments:

* **Wait policy, before torch starts.** libgomp reads ``OMP_WAIT_POLICY`` once, when torch loads. With
  spinning waits (libgomp's default for a while after each parallel region) an idle worker burns a core
  that another process, or this one's capture and server threads, needed: on the shared 2-core machine a
  4 MB in-place multiply took 7.99 ms with torch's 2 spinning threads against 0.059 ms passive (issue 17).
  Every entry point (``edgekv``, ``edgekv-camera``) calls ``prepare_process()`` first: ``PASSIVE``
  unless the environment already says otherwise (the environment wins, so an operator can measure).
* **Thread count, when a model is loaded.** ``runtime.threads`` in the config (``--threads`` on the
  commands that run a model): an integer, or ``auto`` = ``default_threads()``. ``Runtime`` applies it;
  a count chosen explicitly in this process first (a bench's or eval's ``--threads``) is kept by ``auto``.

``auto`` rule, from measurement (README "Threads"): one thread per two usable cores, at most 4, at
least 1. On the busy 2-core CPU machine that is 1 thread (2 threads were never faster there and up to
1.9x slower at the tiny shape); decode is a matrix-vector product bound by memory bandwidth, which a
few cores saturate, so on a Jetson's 6-12 cores 3-4 threads reach the bound and leave the other cores
to capture, preprocessing, the HTTP server and the monitor (and the models normally run on the GPU).
"""

from __future__ import annotations

import os

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
DEFAULT_WAIT_POLICY = "PASSIVE"
MAX_AUTO_THREADS = 4

_explicit: int | None = None  # a count this process chose explicitly (apply_threads(int)); auto keeps it


def prepare_process(environ: dict | None = None) -> str:
    """Set the OpenMP wait policy (``PASSIVE`` unless the environment already names one); returns the
    policy in effect. Call it before torch is imported: libgomp reads the variable once, at load, so
    in a process that already imported torch this only affects child processes."""
    env = os.environ if environ is None else environ
    return env.setdefault(WAIT_POLICY_ENV, DEFAULT_WAIT_POLICY)


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads(cpus: int | None = None) -> int:
    """``auto``: one torch thread per two usable cores, between 1 and ``MAX_AUTO_THREADS``."""
    cpus = usable_cpus() if cpus is None else cpus
    return max(1, min(MAX_AUTO_THREADS, cpus // 2))


def parse_threads(value: int | str | None) -> int | str | None:
    """Validate a ``runtime.threads`` / ``--threads`` value: a positive integer, ``auto`` or None."""
    if value is None or value == "auto":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"threads must be a positive integer or 'auto', got {value!r}")
    return value


def apply_threads(threads: int | str | None) -> int:
    """Set torch's intra-op thread count; returns the count in effect.

    An integer is applied and remembered as this process's explicit choice; ``auto`` applies
    ``default_threads()`` unless an explicit choice was made before; None changes nothing."""
    global _explicit
    import torch

    threads = parse_threads(threads)
    if threads == "auto":
        threads = _explicit if _explicit is not None else default_threads()
    elif threads is not None:
        _explicit = threads
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def threads_argument(text: str) -> int | str:
    """argparse ``type`` for ``--threads``: a positive integer or ``auto``."""
    import argparse

    try:
        return parse_threads(text.strip().lower())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
