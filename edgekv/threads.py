"""CPU thread policy (issue 17): how many threads torch uses, and how idle OpenMP threads wait."""

from __future__ import annotations


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (None: leave torch's choice). Returns the count in effect."""
    import torch

    if threads is not None:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()
