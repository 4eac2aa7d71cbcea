"""Issue 32, decode at the 3B shape on a lent GPU with no checkpoint on disk (writing a 7.5 GB random checkpoint
first costs a minute of device time): the language model is built on the GPU with random weights, a capped cache
of ``--capacity`` slots is filled by a ``--prompt``-token prefill, then

  eager    the runtime's eager decode step (TorchLLM.prefill of one token through CacheAttention), greedy
  graph    edgekv.session.decode_graph.DecodeGraph: one CUDA graph replay a token (per-token host read, and chained)
  hf       transformers' Qwen2_5_VLForConditionalGeneration.generate, random weights of the same shape, same prompt
           length (its own weights: tokens are not compared, only speed)

against the bound ``copy bandwidth / bytes a token reads`` (weights once + the K/V read). Prints a line per figure
and writes JSON to ``--json``. ``--small`` runs a toy shape on the CPU (a check of this script, not a figure).
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--prompt", type=int, default=6000)
    parser.add_argument("--capacity", type=int, default=6144)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", default="decode-3b.json")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--compiled", action="store_true", help="also the graph of the torch.compile'd step")
    parser.add_argument("--int4", action="store_true",
                        help="the layers' seven linears as 4-bit AWQ weights (random integers, group 128), the "
                             "Triton 4-bit kernels on the GPU; embedding and head stay bf16")
    args = parser.parse_args()

    from edgekv.apps.bench.common import bytes_per_token
    from edgekv.apps.bench.decode_gpu import copy_bandwidth, eager_decode, graph_decode
    from edgekv.attention import CacheAttention
    from edgekv.engines.torch_backend import TorchLLM
    from edgekv.cache import CacheSpec, CappedKVCache
    from edgekv.model.language import Qwen2LM
    from edgekv.model.rope import text_position_ids
    from edgekv.model.tiny import PRESETS

    device = torch.device("cpu" if args.small else "cuda")
    config = PRESETS["tiny" if args.small else "3b"].config
    text = config.text
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": "bf16",
                    "prompt": args.prompt, "capacity": args.capacity, "tokens": args.tokens, "rows": []}

    def save() -> None:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)

    started = time.perf_counter()
    with torch.device(device):
        language = Qwen2LM(text)
    language = language.to(torch.bfloat16).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in language.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.02)
    if args.int4:
        quantize_randomly(language, 16 if args.small else 128)
        result["weights"] = "int4 (AWQ GEMM layout, group 128) layers, bf16 embedding and head"
    bandwidth = copy_bandwidth(device, mib=256 if args.small else 2048)
    bound_rate = max(bandwidth.values())
    result.update(copy_tb_s=bandwidth["copy"] / 1e12, read_tb_s=bandwidth["read"] / 1e12)
    print(f"{result['device']}: built in {time.perf_counter() - started:.1f} s; copy {bandwidth['copy'] / 1e12:.2f} "
          f"TB/s (read + write), read {bandwidth['read'] / 1e12:.2f} TB/s", flush=True)
    spec = CacheSpec.uniform(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, torch.bfloat16)
    cache = CappedKVCache(spec, args.capacity, device=device)
    kv_slot = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * 2
    ids = torch.randint(0, text.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():
        hidden = language(language.embed_tokens(ids), text_position_ids(0, args.prompt, device),
                          CacheAttention(cache, 0, args.prompt))
        cache.commit(args.prompt)
        first = int(language.logits(hidden[-1]).argmax())
    del hidden

    def row(route: str, tok_s: float, read: int, **extra) -> None:
        entry = {"route": route, "tok_s": tok_s, "bytes_per_token": read, "bound_tok_s": bound_rate / read,
                 "share_of_bound": tok_s / (bound_rate / read), **extra}
        result["rows"].append(entry)
        more = "".join(f", {k} {v:.1f}" for k, v in extra.items() if isinstance(v, float))
        print(f"{route:8s} {tok_s:8.1f} tok/s = {entry['share_of_bound']:.0%} of the bound "
              f"({entry['bound_tok_s']:.0f} tok/s){more}", flush=True)
        save()

    # eager: the runtime's step (TorchLLM.prefill of one token through CacheAttention)
    eager = eager_decode(TorchLLM(SimpleNamespace(language=language)), cache, first, args.prompt, args.tokens, 2)
    row("eager", eager["tok_s"], bytes_per_token(language, args.prompt + args.tokens // 2, kv_slot))

    # graph: as the session builds it (split attention + fused small work where Triton runs), then the two
    # configurations before it, so each change has its own figure: the split attention alone, SDPA's mask row;
    # with --compiled, the torch.compile'd step of the layers' own ops
    variants = [("graph", {}), ("graph-split", {"fused": False}), ("graph-sdpa", {"split_attention": False, "fused": False})]
    if args.compiled:
        variants.append(("compiled", {"compile": True, "fused": False}))
    for name, options in variants:
        try:
            figures = graph_decode(language, cache, first, args.prompt, args.tokens, 3, profile=True, **options)
        except Exception as exc:  # one route failing on the device must not cost the others' figures
            result[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            print(f"{name:8s} FAILED: {result[f'{name}_error'][:600]}", flush=True)
            save()
            continue
        read = args.prompt + args.tokens // 2 if figures["split_attention"] else args.capacity
        row(name, figures["tok_s"], bytes_per_token(language, read, kv_slot), chained_tok_s=figures["tok_s_chained"],
            build_s=figures["build_s"], tokens_match_eager=figures["tokens"] == eager["tokens"],
            split_attention=figures["split_attention"], fused=figures["fused"])
        profile = result[f"{name}_profile"] = figures["profile"]
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in sorted(profile["by_kind_us_per_token"].items(), key=lambda i: -i[1]))
        print(f"  profile ({profile['profiled']}): {profile['kernels_per_token']:.0f} kernels, "
              f"{profile['device_us_per_token']:.0f} us a token: {kinds}", flush=True)
        for kernel in profile["top"][:6]:
            print(f"   {kernel['us_per_token']:7.1f} us  x{kernel['calls_per_token']:5.0f}  {kernel['name'][:90]}",
                  flush=True)
        save()
    del cache, language
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if args.no_hf:
        return
    from transformers import AutoConfig, LogitsProcessor, LogitsProcessorList, Qwen2_5_VLForConditionalGeneration

    hf_config = AutoConfig.for_model(**{k: v for k, v in config.to_hf_dict().items() if k != "model_type"},
                                     model_type="qwen2_5_vl")
    t0 = time.perf_counter()
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(hf_config, dtype=torch.bfloat16).eval()

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):
            sync()
            self.stamps.append(time.perf_counter())
            return scores

    print(f"transformers model built in {time.perf_counter() - t0:.1f} s", flush=True)
    hf_ids = ids[None]
    rates = []
    for _ in range(2):
        clock = StepClock()
        with torch.inference_mode():
            model.generate(input_ids=hf_ids, attention_mask=torch.ones_like(hf_ids), max_new_tokens=args.tokens,
                           min_new_tokens=args.tokens, do_sample=False, logits_processor=LogitsProcessorList([clock]))
        rates.append((len(clock.stamps) - 1) / (clock.stamps[-1] - clock.stamps[0]))
    weights = bytes_per_token(model.model.language_model, 0, 0) + model.lm_head.weight.numel() * 2 * (
        0 if text.tie_word_embeddings else 1)
    row("hf", max(rates), weights + (args.prompt + args.tokens // 2) * kv_slot)


def quantize_randomly(language: torch.nn.Module, group: int) -> None:
    """Every ``nn.Linear`` of the decoder layers becomes an ``Int4Linear`` of random 4-bit integers (zero point 8,
    scale 0.004: weights within +-0.032), on the layer's device; biases kept."""
    from edgekv.model.int4 import Int4Linear

    device = next(language.parameters()).device
    gen = torch.Generator(device).manual_seed(1)  # drawn and packed on the GPU: 3B of integers take minutes on a CPU
    for layer in language.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if not isinstance(child, torch.nn.Linear):
                    continue
                k, n = child.in_features, child.out_features
                q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8, device=device)
                zeros = torch.full((k // group, n), 8, dtype=torch.uint8, device=device)
                scales = torch.full((k // group, n), 0.004, dtype=torch.float16, device=device)
                bias = None if child.bias is None else child.bias.detach()
                setattr(parent, name, Int4Linear.from_integers(q, zeros, scales, bias).to(device))


if __name__ == "__main__":
    main()
