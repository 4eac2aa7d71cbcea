"""Training batches drawn one step ahead in a worker process (``edgekv train-toy``, on by default).

Drawing a batch — rendering its scenes, preprocessing the frames, laying out the token sequences and
masks — is single-threaded numpy and Python: ~0.25 s of each ~1.1 s question-answering step and most of a
vision warm-up step, during which one of the two cores the model's matmuls use sits idle. A spawned
worker process draws the next batches while the model trains on this one (the batches cross in shared
memory through ``torch.multiprocessing``).

The worker owns a copy of the trainer's random generator and draws exactly what the trainer would have
drawn in the same order, then hands the generator's final state back, so a run with prefetching is the
same run as one without (tested: equal batches).

On a GPU one drawing process is the bottleneck (a world-long batch takes ~0.25 s to draw, the model's step
milliseconds). ``sharded`` spreads the steps over several workers, worker ``i`` drawing steps ``i, i + n, ...``:
for that the draw of each step must not depend on the steps before it (``edgekv.toy.train``'s ``*_sharded``
generators seed each step's own generators), and the batches come back in step order, the same for any ``n``.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import signal
from typing import Any, Callable, Iterator

import numpy as np
import torch

_POLL_S = 5.0  # how often a waiting trainer checks that the worker is still alive
_PUT_S = 0.5  # how often a worker blocked on a full queue checks that its trainer still wants batches


def _worker_signals() -> None:
    """A worker ignores SIGINT: a Ctrl-C at a terminal (or ``timeout -s INT``) reaches the whole process group, and
    it is the trainer's to act on — it stops taking batches and tells its workers (``done``). A worker that took
    the KeyboardInterrupt itself would report it as a failed draw and wait on a full queue to say so."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _trainer_gone() -> bool:
    """True in a worker whose trainer has died. A trainer killed by a signal (``kill``, the OOM killer) runs no exit
    handler that would end its daemon workers: they are the ones that must notice."""
    parent = multiprocessing.parent_process()
    return parent is not None and not parent.is_alive()


def _send(out, done, message) -> bool:
    """Put ``message`` for the trainer, waiting while the queue is full; False once the trainer is gone or has
    stopped taking batches (``done``: it finished, or a Ctrl-C ended its loop). A worker blocked on a full queue
    would otherwise wait for ever, holding its memory — or, its trainer alive and joining it, hold the trainer
    up until the join gives up (seen: a `train-toy --workers 12` stopped by `timeout -s INT` took ~50 s to
    exit, ten seconds a worker blocked here)."""
    while True:
        if done.is_set():
            out.cancel_join_thread()  # nobody reads the pipe any more: do not wait at exit to flush it
            return False
        try:
            out.put(message, timeout=_PUT_S)
            return True
        except queue_module.Full:
            if _trainer_gone():
                out.cancel_join_thread()
                return False


def _wait_done(done) -> None:
    """Stay until the trainer says it took every batch, or is gone."""
    while not done.wait(_POLL_S):
        if _trainer_gone():
            return


def _worker(out, done, make: Callable[..., Iterator[Any]], rng: np.random.Generator, args: tuple) -> None:
    _worker_signals()
    torch.set_num_threads(1)
    try:
        for item in make(rng, *args):
            if not _send(out, done, ("item", item)):
                return
        if not _send(out, done, ("end", rng.bit_generator.state)):
            return
    except BaseException as exc:  # reported to the trainer, which raises it
        if not _send(out, done, ("error", f"{type(exc).__name__}: {exc}")):
            return
    # A tensor crosses as a file descriptor this process serves on request: stay until the trainer has
    # taken every batch, or the last ones could no longer be rebuilt.
    _wait_done(done)


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
            kind, item = _take(channel, process)
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


def _take(channel, process) -> tuple[str, Any]:
    """The worker's next message; a worker that died without one is an error, not a hang."""
    while True:
        try:
            return channel.get(timeout=_POLL_S)
        except queue_module.Empty:
            if not process.is_alive():
                raise RuntimeError(f"the batch worker died (exit code {process.exitcode})") from None


def _shard_worker(out, done, make: Callable[..., Iterator[Any]], args: tuple, shard: int, shards: int) -> None:
    _worker_signals()
    torch.set_num_threads(1)
    try:
        for item in make(*args, shard=shard, shards=shards):
            if not _send(out, done, ("item", item)):
                return
        if not _send(out, done, ("end", None)):
            return
    except BaseException as exc:  # reported to the trainer, which raises it
        if not _send(out, done, ("error", f"{type(exc).__name__}: {exc}")):
            return
    _wait_done(done)  # as in _worker: the trainer may still be rebuilding this worker's last tensors


def sharded(make: Callable[..., Iterator[Any]], steps: int, *args: Any, workers: int, depth: int = 2
            ) -> Iterator[Any]:
    """Yield the ``steps`` items of ``make(*args, shard=0, shards=1)`` in order; with ``workers`` > 0 they are
    drawn by that many spawned processes, worker ``i`` running ``make(*args, shard=i, shards=workers)`` up to
    ``depth`` items ahead. ``make`` (module-level) must draw each step from generators of its own, so that
    the items do not depend on how the steps are shared."""
    if workers <= 0:
        yield from make(*args, shard=0, shards=1)
        return
    context = torch.multiprocessing.get_context("spawn")
    done = context.Event()
    channels = [context.Queue(maxsize=depth) for _ in range(workers)]
    processes = [context.Process(target=_shard_worker, args=(channel, done, make, args, shard, workers), daemon=True,
                                 name=f"edgekv-train-draw-{shard}")
                 for shard, channel in enumerate(channels)]
    for process in processes:
        process.start()
    try:
        for step in range(steps):
            shard = step % workers
            kind, item = _take(channels[shard], processes[shard])
            if kind == "item":
                yield item
            elif kind == "end":
                raise RuntimeError(f"batch worker {shard} ended before step {step}")
            else:
                raise RuntimeError(f"batch worker {shard} failed: {item}")
    finally:
        done.set()
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
