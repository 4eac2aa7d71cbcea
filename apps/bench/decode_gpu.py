"""``edgekv bench decode --device cuda``: decode on a CUDA GPU — eager, one CUDA graph a token, and the graph of a
``torch.compile``d step — against the GPU's measured bandwidth bound, transformers' ``generate`` beside them.

The bound: a token reads every language-model weight once (the tied embedding in full, as ``lm_head``) and
the K/V it attends over, so it cannot beat ``bandwidth / bytes``. Bandwidth is measured here, on this GPU,
just before the figures: a device-to-device copy of a 2 GiB buffer counting the bytes read and written
(the issue's "measured copy bandwidth"), and a streaming read (an fp32 sum of the same buffer); the bound
uses the higher. Bytes: the weights, plus the K/V of the slots each route reads — the valid prefix, or all
``--capacity`` slots for a graph whose attention is SDPA with a mask row (no Triton;
``edgekv.session.decode_graph``). The cache is filled by a ``--prompt``-token prefill first, so a prompt near
the capacity fills it as a running stream's cache is filled when a question comes.

Rates: ``tok_s`` synchronizes on every token (the host reads each token to stream the answer out, as
``StreamSession.ask`` does); ``tok_s_chained`` (graph routes) replays the greedy chain and synchronizes once at
the end — the device's own rate. ``--profile`` adds the top CUDA kernels of eight graph replays (torch's
profiler) and their time grouped by kind: where a token's time goes.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time

import torch

from edgekv.apps.bench.common import sync_device as _sync

CUDA_ROUTES = ("eager", "graph", "compiled")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def copy_bandwidth(device: torch.device, mib: int = 2048, repeats: int = 10) -> dict:
    """Bytes/s of a device-to-device copy (read + write counted) and of an fp32 sum (read), median of ``repeats``
    (each synchronized; at 2 GiB a copy takes ~1 ms on an H200, far above the host timer's resolution)."""
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    rates = {"copy": [], "read": []}
    for name, op, moved in (("copy", functools.partial(dst.copy_, src), 2 * src.numel() * 4),
                            ("read", src.sum, src.numel() * 4)):
        op()
        for _ in range(repeats):
            _sync(device)
            started = time.perf_counter()
            op()
            _sync(device)
            rates[name].append(moved / (time.perf_counter() - started))
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {name: statistics.median(values) for name, values in rates.items()}


def _prefilled(model_dir: str, dtype: torch.dtype, device: torch.device, capacity: int, prompt: int):
    from edgekv.cache import CacheSpec, CappedKVCache
    from edgekv.engines.torch_backend import TorchLLM
    from edgekv.model import load_pretrained
    from edgekv.model.builtin import resolve_model_path
    from edgekv.model.rope import text_position_ids

    model = load_pretrained(resolve_model_path(model_dir), dtype=dtype, device=device, skip=("visual",)).eval()
    text = model.config.text
    llm = TorchLLM(model)
    spec = CacheSpec.uniform(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, dtype)
    cache = CappedKVCache(spec, capacity, device=device)
    ids = torch.randint(0, text.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():
        hidden = llm.prefill(llm.embed(ids), text_position_ids(0, prompt, device), cache)
    cache.commit(prompt)
    first = int(llm.logits(hidden[-1]).argmax())
    return model, llm, cache, first


def eager_decode(llm, cache, first: int, prompt: int, tokens: int, repeats: int) -> dict:
    """tok/s of the runtime's eager decode step (``TorchLLM.prefill`` of one token), greedy, median of ``repeats``."""
    from edgekv.model.rope import text_position_ids

    rates, out = [], []
    with torch.inference_mode():
        for _ in range(repeats):
            cache.truncate(prompt)
            token, out = first, [first]
            _sync(cache.device)
            started = time.perf_counter()
            for step in range(tokens - 1):
                hidden = llm.prefill(llm.embed(torch.tensor([token], device=cache.device)),
                                     text_position_ids(prompt + step, 1, cache.device), cache)
                cache.commit(1)
                token = int(llm.logits(hidden[-1]).argmax())
                out.append(token)
            rates.append((tokens - 1) / (time.perf_counter() - started))
    cache.truncate(prompt)
    return {"tok_s": statistics.median(rates), "tok_s_runs": rates, "tokens": out}


def graph_decode(language, cache, first: int, prompt: int, tokens: int, repeats: int, profile: bool,
                 **options) -> dict:
    """tok/s of ``DecodeGraph(language, cache, **options)``: with a host read of every token, and chained."""
    from edgekv.session.decode_graph import DecodeGraph

    started = time.perf_counter()
    graph = DecodeGraph(language, cache, **options)
    _sync(cache.device)
    build_s = time.perf_counter() - started
    rates, chained, out = [], [], []
    for _ in range(repeats):
        cache.truncate(prompt)
        graph.feed(first, prompt)
        out = [first]
        _sync(cache.device)
        started = time.perf_counter()
        for _ in range(tokens - 1):
            graph.step()
            out.append(int(graph.next_token))  # one host read a token, as an answer streams out
        rates.append((tokens - 1) / (time.perf_counter() - started))
        cache.truncate(prompt)
        graph.feed(first, prompt)
        _sync(cache.device)
        started = time.perf_counter()
        for _ in range(tokens - 1):
            graph.step()
        _sync(cache.device)
        chained.append((tokens - 1) / (time.perf_counter() - started))
    row = {"tok_s": statistics.median(rates), "tok_s_runs": rates, "tok_s_chained": statistics.median(chained),
           "tok_s_chained_runs": chained, "tokens": out, "build_s": build_s, "split_attention": graph.split_attention,
           "fused": graph.fused}
    if profile:
        row["profile"] = _profile(graph, cache, first, prompt)
    cache.truncate(prompt)
    del graph
    return row


def kernel_kind(name: str) -> str:
    """A CUDA kernel's kind, from its name: where a decode token's time goes."""
    lowered = name.lower()
    if any(key in lowered for key in ("fmha", "flash", "attention", "efficient", "sdpa", "softmax")):
        return "attention"
    if lowered.startswith("triton"):
        return "fused (Triton)"
    if any(key in lowered for key in ("gemv", "gemm", "cutlass", "sm90_xmma", "cublas", "nvjet", "splitk", "addmm",
                                      "aten::mm", "aten::linear", "matmul")):
        return "matrix products"
    if any(key in lowered for key in ("index", "scatter", "gather", "copy")):
        return "copies and index writes"
    return "elementwise and reductions"


def _profile(graph, cache, first: int, prompt: int, steps: int = 8) -> dict:
    cuda = cache.device.type == "cuda"
    result = _profile_steps(graph, cache, first, prompt, steps, cuda, replay=True)
    if not result["top"] and graph.graph is not None:  # a profiler that sees no kernels inside graph replays
        result = _profile_steps(graph, cache, first, prompt, steps, cuda, replay=False)
        result["profiled"] = "the static step launched eagerly (no kernels were seen inside the graph replays)"
    cache.truncate(prompt)
    return result


def _profile_steps(graph, cache, first: int, prompt: int, steps: int, cuda: bool, replay: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cache.truncate(prompt)
    graph.feed(first, prompt)
    _sync(cache.device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            if replay:
                graph.step()
            else:
                with torch.inference_mode():
                    graph._advance(graph._step()[1])
                cache.commit(1)
        _sync(cache.device)
    kernels = []
    for event in prof.key_averages():
        if cuda:
            total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        else:  # the CPU path of the tests: top-level aten operators only
            total = event.self_cpu_time_total if event.key.startswith("aten::") else 0.0
        if total:
            kernels.append({"name": event.key[:120], "calls_per_token": event.count / steps,
                            "us_per_token": total / steps, "kind": kernel_kind(event.key)})
    kernels.sort(key=lambda k: -k["us_per_token"])
    kinds: dict[str, float] = {}
    for kernel in kernels:
        kinds[kernel["kind"]] = kinds.get(kernel["kind"], 0.0) + kernel["us_per_token"]
    return {"steps": steps, "kernels_per_token": sum(k["calls_per_token"] for k in kernels),
            "device_us_per_token": sum(kinds.values()), "by_kind_us_per_token": kinds, "top": kernels[:20],
            "profiled": "graph replays" if replay and graph.graph is not None else "the static step"}


def run_decode_cuda(args: argparse.Namespace, model_dir: str, allow_cpu: bool = False) -> dict:
    """The CUDA figures of ``edgekv bench decode`` (``--device cuda``); returns the result dict. ``allow_cpu``
    (tests only): the same code on the CPU, where the graph routes run their static step eagerly."""
    from edgekv.apps.bench.common import bytes_per_token, comma_choices, hf_decode

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA GPU is visible to torch")
    if device.type != "cuda" and not allow_cpu:
        raise SystemExit(f"run_decode_cuda: --device {args.device} is not a CUDA device")
    dtypes = comma_choices(args.dtypes, _DTYPES, "--dtypes", "dtype")
    routes = comma_choices(args.cuda_routes, {r: r for r in CUDA_ROUTES}, "--cuda-routes", "route")
    capacity = args.capacity or args.prompt + args.tokens + 1
    if args.prompt + args.tokens > capacity:
        raise ValueError(f"--capacity {capacity} holds fewer than --prompt + --tokens = {args.prompt + args.tokens} "
                         f"slots")
    bandwidth = copy_bandwidth(device)
    bound_rate = max(bandwidth.values())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}: copy {bandwidth['copy'] / 1e12:.2f} TB/s (read + write), "
          f"read {bandwidth['read'] / 1e12:.2f} TB/s", flush=True)
    rows = []
    for dtype_name in dtypes:
        dtype = _DTYPES[dtype_name]
        model, llm, cache, first = _prefilled(model_dir, dtype, device, capacity, args.prompt)
        text = model.config.text
        kv_slot = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * cache.k.element_size()
        for route in routes:
            if route == "eager":
                row = eager_decode(llm, cache, first, args.prompt, args.tokens, args.repeats)
                read = bytes_per_token(model.language, args.prompt + args.tokens // 2, kv_slot)
            else:
                row = graph_decode(model.language, cache, first, args.prompt, args.tokens, args.repeats,
                                   profile=args.profile, compile=route == "compiled")
                # the split kernel reads the visible slots; SDPA with a mask row reads all of them
                read = bytes_per_token(model.language, args.prompt + args.tokens // 2 if row["split_attention"]
                                       else capacity, kv_slot)
            row = {"engine": "edgekv", "route": route, "dtype": dtype_name, **row, "bytes_per_token": read,
                   "bound_tok_s": bound_rate / read}
            row["share_of_bound"] = row["tok_s"] / row["bound_tok_s"]
            _print(row)
            rows.append(row)
        if "eager" in routes:  # the same greedy tokens on every route (fp rounding may split a near-tie)
            reference = next(r["tokens"] for r in rows[-len(routes):] if r["route"] == "eager")
            for row in rows[-len(routes):]:
                row["tokens_match_eager"] = row["tokens"] == reference
        weights = bytes_per_token(model.language, 0, kv_slot)
        del model, llm, cache
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not args.no_hf:
            row = {"engine": "transformers", "route": "generate", "dtype": dtype_name,
                   **hf_decode(model_dir, dtype, args.prompt, args.tokens, min(args.repeats, 2), device)}
            row["bytes_per_token"] = weights + (args.prompt + args.tokens // 2) * kv_slot
            row["bound_tok_s"] = bound_rate / row["bytes_per_token"]
            row["share_of_bound"] = row["tok_s"] / row["bound_tok_s"]
            _print(row)
            rows.append(row)
    return {"device": name, "capacity": capacity,
            "copy_bandwidth_tb_s": bandwidth["copy"] / 1e12, "read_bandwidth_tb_s": bandwidth["read"] / 1e12,
            "read_bandwidth_gb_s": [bound_rate / 1e9], "threads": torch.get_num_threads(), "rows": rows}


def _print(row: dict) -> None:
    chained = f", chained {row['tok_s_chained']:.1f}" if "tok_s_chained" in row else ""
    build = f", built in {row['build_s']:.1f} s" if "build_s" in row else ""
    print(f"{row['engine']:12s} {row['route']:9s} {row['dtype']:5s} {row['tok_s']:8.1f} tok/s{chained} = "
          f"{row['share_of_bound']:.0%} of the bound ({row['bound_tok_s']:.0f} tok/s){build}", flush=True)
    if "profile" in row:
        profile = row["profile"]
        kinds = ", ".join(f"{kind} {us:.0f}" for kind, us in sorted(profile["by_kind_us_per_token"].items(),
                                                                    key=lambda item: -item[1]))
        print(f"    profile: {profile['kernels_per_token']:.0f} kernels, {profile['device_us_per_token']:.0f} us "
              f"of kernels a token: {kinds}", flush=True)
