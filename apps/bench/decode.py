"""``edgekv bench decode``: decode tok/s against the measured memory-bandwidth bound, per dtype, beside
transformers' ``generate`` on the same checkpoint and prompt length.

One decode token reads every language-model weight once (the tied embedding in full, as ``lm_head``)
plus the K/V cache so far, so on a CPU it cannot beat ``read bandwidth / bytes read per token``. The
bench measures that bandwidth here (the faster of a streaming fp32 sum and an fp32 matrix-vector product
over a buffer far larger than the caches, with
the bench's thread count, just before and just after each figure — the bound uses the higher — since a
shared machine's bandwidth moves with the other tenants' load), counts the bytes, and reports tok/s and its share of the bound for:

* ``edgekv``: the runtime's decode step — ``TorchLLM.prefill`` of one token into a ``CappedKVCache``
  through ``CacheAttention`` (the fast path), greedy, as ``StreamSession.ask`` runs it; ``--routes``
  picks weight routes (``edgekv.model.decode_routes``, which records the routes measured and dropped);
* ``transformers``: ``Qwen2_5_VLForConditionalGeneration.generate`` (greedy, ``min_new_tokens`` so random
  weights cannot stop early); a logits processor stamps each step: the tokens after the first, over the
  time between the first and the last stamp (prefill excluded), as edgekv's figure is taken.

``int4`` (issue 29) is the 4-bit model with bf16 activations (W4A16): ``--int4-model DIR``, or ``--model``
quantized by ``edgekv quantize`` into the scratch directory first; its bound counts the 4-bit weights, their
scales and zero points, the bf16 embedding and norms (transformers cannot load it here: it needs gptqmodel).

Models are loaded one at a time (a 3B fp32 model is ~12 GB). Prints and saves JSON + PNG; figures only.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch

from edgekv.apps.bench.common import bytes_per_token, device_argument, hf_decode  # noqa: F401 - bytes_per_token re-exported
from edgekv.threads import threads_argument

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int4": torch.bfloat16}


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint dir, or builtin:toy (default: a fresh tiny random checkpoint)")
    parser.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma-separated: fp32, bf16, fp16, int4")
    parser.add_argument("--int4-model", default=None, help="the 4-bit checkpoint for int4 (default: --model quantized)")
    parser.add_argument("--int4-group-size", type=int, default=128, help="group size when --model is quantized here")
    parser.add_argument("--int4-routes", default="native",
                        help="routes for int4 (eager dequantizes every weight per token: minutes per token at 3B)")
    parser.add_argument("--routes", default="eager,native",
                        help="comma-separated edgekv weight routes: eager, native (bf16 only; see decode_routes)")
    parser.add_argument("--lm-heads", default="as_loaded",
                        help="comma-separated model.lm_head values for edgekv's rows: as_loaded, int8 (issue 29)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens before decoding")
    parser.add_argument("--tokens", type=int, default=16, help="tokens decoded per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (the median is reported)")
    parser.add_argument("--threads", type=threads_argument, default="auto", help="torch CPU threads, or auto")
    parser.add_argument("--bandwidth-mib", type=int, default=512, help="buffer size of the bandwidth measurement")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    parser.add_argument("--device", type=device_argument, default="cpu", help="cpu, or cuda / cuda:N: the GPU figures (eager, CUDA graph, "
                                                        "compiled graph; apps/bench/decode_gpu.py)")
    parser.add_argument("--cuda-routes", default="eager,graph,compiled", help="with --device cuda: comma-separated "
                                                                              "eager, graph, compiled")
    parser.add_argument("--capacity", type=int, default=None,
                        help="cache slots (default: prompt + tokens + 1); the graph reads all of them")
    parser.add_argument("--profile", action="store_true", help="with --device cuda: the top kernels of a graph token")
    parser.add_argument("--json", default="bench-decode.json")
    parser.add_argument("--plot", default="bench-decode.png", help="PNG to write ('' to skip)")
    parser.set_defaults(run=run_decode)


def read_bandwidth(mib: int, repeats: int = 5) -> float:
    """Bytes per second of a streaming read of ``mib`` MiB: the fastest of ``repeats`` rounds of two
    readers, an fp32 sum and an fp32 matrix-vector product over the same buffer as a [rows, 2048]
    matrix (the kind of read decode does: on a quiet machine transformers' fp32 decode streamed 13 %
    faster than the sum alone, which made the sum a bound that could be beaten). On a shared machine the
    other tenants only ever slow a sample down, so the fastest sample is the bound's."""
    if mib < 64:
        raise ValueError(f"--bandwidth-mib must be >= 64 (well above the caches), got {mib}")
    buffer = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    matrix, vector = buffer.view(-1, 2048), torch.ones(2048, dtype=torch.float32)
    readers = (buffer.sum, lambda: torch.mv(matrix, vector))
    rates = []
    for read in readers:
        read()
    for _ in range(repeats):
        for read in readers:
            started = time.perf_counter()
            read()
            rates.append(buffer.numel() * 4 / (time.perf_counter() - started))
    return max(rates)


def edgekv_decode(model_dir: str, dtype: torch.dtype, route: str, prompt: int, tokens: int, repeats: int,
                  lm_head: str = "as_loaded") -> dict:
    """tok/s of the runtime's decode step (median over ``repeats`` runs of ``tokens`` steps)."""
    from edgekv.cache import CacheSpec, CappedKVCache
    from edgekv.engines.torch_backend import TorchLLM
    from edgekv.model import load_pretrained
    from edgekv.model.decode_routes import prepare_decode, quantize_lm_head
    from edgekv.model.rope import text_position_ids
    from edgekv.model.builtin import resolve_model_path

    model = load_pretrained(resolve_model_path(model_dir), dtype=dtype, skip=("visual",)).eval()
    text = model.config.text
    route_info = {**quantize_lm_head(model.language, lm_head), **prepare_decode(model.language, route)}
    llm = TorchLLM(model)
    spec = CacheSpec.uniform(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, dtype)
    cache = CappedKVCache(spec, prompt + tokens + 1)
    ids = torch.randint(0, text.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0))
    rates, generated = [], []
    with torch.inference_mode():
        for _ in range(repeats):
            cache.truncate(0)
            hidden = llm.prefill(llm.embed(ids), text_position_ids(0, prompt), cache)
            cache.commit(prompt)
            token = int(llm.logits(hidden[-1]).argmax())
            out = [token]
            started = time.perf_counter()
            for step in range(tokens - 1):
                hidden = llm.prefill(llm.embed(torch.tensor([token])), text_position_ids(prompt + step, 1), cache)
                cache.commit(1)
                token = int(llm.logits(hidden[-1]).argmax())
                out.append(token)
            rates.append((tokens - 1) / (time.perf_counter() - started))
            generated = out
    kv_slot = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * torch.empty((), dtype=dtype).element_size()
    read = bytes_per_token(model.language, prompt + tokens // 2, kv_slot)
    del llm, model, cache
    gc.collect()
    return {"tok_s": statistics.median(rates), "tok_s_runs": rates, "bytes_per_token": read, "tokens": generated,
            **route_info}


def run_decode(args: argparse.Namespace) -> int:
    from edgekv.apps.bench.common import comma_choices, model_or_tiny, provenance, write_figures
    from edgekv.model.decode_routes import ROUTES
    from edgekv.threads import apply_threads

    threads = apply_threads(args.threads)
    dtypes = comma_choices(args.dtypes, _DTYPES, "--dtypes", "dtype")
    routes = comma_choices(args.routes, ROUTES, "--routes", "route")
    from edgekv.model.decode_routes import LM_HEADS

    heads = comma_choices(args.lm_heads, {h: h for h in LM_HEADS}, "--lm-heads", "lm_head")
    if args.prompt < 1 or args.tokens < 2:
        raise ValueError(f"--prompt must be >= 1 and --tokens >= 2, got {args.prompt} and {args.tokens}")
    if args.repeats < 1:  # 0 was 'no median for empty data' after the bandwidth measurement
        raise ValueError(f"--repeats: at least 1, got {args.repeats}")
    # The machine may be shared: bandwidth is measured around each figure, which carries its own bound.
    bandwidths = []

    def measured() -> float:
        bandwidths.append(read_bandwidth(args.bandwidth_mib))
        print(f"read bandwidth {bandwidths[-1] / 1e9:.1f} GB/s ({threads} thread(s))", flush=True)
        return bandwidths[-1]

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device != "cpu":
        from edgekv.apps.bench.decode_gpu import run_decode_cuda

        with tempfile.TemporaryDirectory(prefix="edgekv-bench-decode-") as tmp:
            result = {"bench": "decode", "model": str(args.model or "tiny random"), "prompt": args.prompt,
                      "tokens": args.tokens, **run_decode_cuda(args, model_or_tiny(args.model, tmp)), **provenance()}
        write_figures(result, args.json, args.plot, plot)
        return 0
    with tempfile.TemporaryDirectory(prefix="edgekv-bench-decode-") as tmp:
        model = model_or_tiny(args.model, tmp)
        rows = []
        for dtype_name in dtypes:
            dtype = _DTYPES[dtype_name]
            source = model
            if dtype_name == "int4":
                from edgekv.calibration.quantize import bench_int4_checkpoint

                source = args.int4_model or bench_int4_checkpoint(model, Path(tmp) / "int4", args.int4_group_size)
            for route in (comma_choices(args.int4_routes, ROUTES, "--int4-routes", "route") if dtype_name == "int4"
                          else routes):
                if route == "native":
                    from edgekv.model.decode_routes import native_unavailable

                    reason = native_unavailable(dtype, "cpu", quantized=dtype_name == "int4")
                    if reason:
                        print(f"edgekv native {dtype_name}: skipped ({reason})", flush=True)
                        continue
                for head in heads:
                    if head != "as_loaded" and route != "native":
                        continue  # the int8 head is the native route's (its C kernel)
                    before = measured()
                    row = {"engine": "edgekv", "route": route, "dtype": dtype_name,
                           **edgekv_decode(source, dtype, route, args.prompt, args.tokens, args.repeats, head)}
                    rows.append(_with_bound(row, before, measured()))
            if not args.no_hf and dtype_name != "int4":
                before = measured()
                eager = [r for r in rows if r["dtype"] == dtype_name and r["route"] == "eager"]
                row = {"engine": "transformers", "route": "generate", "dtype": dtype_name,
                       "bytes_per_token": eager[0]["bytes_per_token"] if eager else None,
                       **hf_decode(model, dtype, args.prompt, args.tokens, args.repeats)}
                rows.append(_with_bound(row, before, measured()))
    result = {"bench": "decode", "model": str(args.model or "tiny random"), "prompt": args.prompt,
              "tokens": args.tokens, "threads": threads, "read_bandwidth_gb_s": [b / 1e9 for b in bandwidths],
              "rows": rows,
              **provenance()}
    write_figures(result, args.json, args.plot, plot)
    return 0


def _with_bound(row: dict, before: float, after: float) -> dict:
    """The bound of a figure from the bandwidth measured just before and just after it (the higher)."""
    bandwidth = max(before, after)
    row["read_bandwidth_gb_s"] = bandwidth / 1e9
    row["read_bandwidth_before_after_gb_s"] = [before / 1e9, after / 1e9]
    read = row.get("bytes_per_token")
    if read:
        row["bound_tok_s"] = bandwidth / read
        row["share_of_bound"] = row["tok_s"] / row["bound_tok_s"]
    share = f" = {row['share_of_bound']:.0%} of the bound ({row['bound_tok_s']:.2f} tok/s)" if read else ""
    head = " h8" if row.get("lm_head") == "int8" else ""
    print(f"{row['engine']:12s} {row['route']:10s} {row['dtype'] + head:8s} {row['tok_s']:9.2f} tok/s{share}", flush=True)
    return row


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = [f"{r['engine'][:2]} {r['route']}\n{r['dtype']}{' h8' if r.get('lm_head') == 'int8' else ''}" for r in rows]
    ax.bar(range(len(rows)), [r["tok_s"] for r in rows], color=["C0" if r["engine"] == "edgekv" else "C1" for r in rows])
    for i, r in enumerate(rows):
        if "bound_tok_s" in r:
            ax.hlines(r["bound_tok_s"], i - 0.4, i + 0.4, colors="k", linestyles="dashed")
            ax.text(i, r["tok_s"], f"{r['share_of_bound']:.0%}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("decode tok/s (dashed: bandwidth bound)")
    low, high = min(result["read_bandwidth_gb_s"]), max(result["read_bandwidth_gb_s"])
    ax.set_title(f"{Path(result['model']).name}, prompt {result['prompt']}, {result['threads']} thread(s), "
                 f"read {low:.1f}-{high:.1f} GB/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
