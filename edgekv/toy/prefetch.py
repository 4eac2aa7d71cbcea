"""Training batches drawn one step ahead in a worker process (``edgekv train-toy``, on by default).

Drawing a batch — rendering its scenes, preprocessing the frames, laying out the token sequences and
masks — is single-threaded numpy and Python: ~0.25 s of each ~1.1 s question-answering step and most of a
vision warm-up step, during which one of the two cores the model's matmuls use sits idle. A spawned
worker process draws the next batches while the model trains on this one (the batches cross in shared
memory through ``torch.multiprocessing``).

The worker owns a copy of the trainer's random generator and draws exactly what the trainer would have
drawn in the same order, then hands the generator's final state back, so a run with prefetching is the
same run as one without (tested: equal batches).
"""

from __future__ import annotations

import queue as queue_module
from typing import Any, Callable, Iterator

import numpy as np
import torch

_POLL_S = 5.0  # how often a waiting trainer checks that the worker is still alive


def _worker(out, done, make: Callable[..., Iterator[Any]], rng: np.random.Generator, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        for item in make(rng, *args):
            out.put(("item", item))
        out.put(("end", rng.bit_generator.state))
    except BaseException as exc:  # reported to the trainer, which raises it
        out.put(("error", f"{type(exc).__name__}: {exc}"))
    # A tensor crosses as a file descriptor this process serves on request: stay until the trainer has
    # taken every batch, or the last ones could no longer be rebuilt.
    done.wait()


def batches(make: Callable[..., Iterator[Any]], rng: np.random.Generator, *args: Any, prefetch: bool = True,
            depth: int = 2) -> Iterator[Any]:
    """Yield ``make(rng, *args)``'s items; with ``prefetch`` they are drawn ``depth`` ahead in a worker
    process (``make`` must be a module-level generator function). Either way ``rng`` ends in the state the
    draws left it in."""
    if not prefetch:
        yield from make(rng, *args)
        return
    context = torch.multiprocessing.get_context("spawn")
    channel, done = context.Queue(maxsize=depth), context.Event()
    process = context.Process(target=_worker, args=(channel, done, make, rng, args), daemon=True,
                              name="edgekv-train-prefetch")
    process.start()
    try:
        while True:
            try:
                kind, item = channel.get(timeout=_POLL_S)
            except queue_module.Empty:
                if not process.is_alive():
                    raise RuntimeError(f"the batch worker died (exit code {process.exitcode})") from None
                continue
            if kind == "item":
                yield item
            elif kind == "end":
                rng.bit_generator.state = item
                return
            else:
                raise RuntimeError(f"the batch worker failed: {item}")
    finally:
        done.set()
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
