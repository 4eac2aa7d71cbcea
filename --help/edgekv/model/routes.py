"""The rule the CUDA-only routes share (``model.vision_route``, ``model.prefill_route``): "auto", "eager" or the
route's one other choice, which needs a CUDA device; "auto" takes that choice on CUDA once it has run on a GPU."""

from __future__ import annotations

import torch


def cuda_route(option: str, route: str, device: torch.device | str, choice: str, auto_on_cuda: bool,
               needs: str) -> str:
    """``model.<option>`` -> ``choice`` or "eager". ``choice`` asked for off CUDA is a ValueError naming the option
    and ``needs`` (why it needs CUDA); "auto" is ``choice`` on CUDA when ``auto_on_cuda``, "eager" otherwise."""
    if route not in ("auto", "eager", choice):
        raise ValueError(f"model.{option}: unknown route {route!r} (known: auto, eager, {choice})")
    cuda = torch.device(device).type == "cuda"
    if route == choice and not cuda:
        raise ValueError(f"model.{option}: {choice}: {needs} (device {device})")
    return choice if route == choice or (route == "auto" and cuda and auto_on_cuda) else "eager"
