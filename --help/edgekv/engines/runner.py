"""What every engine runner shares: the backend interface on top of "run graph G with these tensors".

An engine module (onnxruntime, TensorRT) only supplies ``run(graph, inputs, outputs)``: bind the given
torch tensors by pointer as the graph's inputs and outputs and execute — no host copies — and calls
:func:`make_backend`. Everything else lives here and is the same for all engines:

* the LLM's fixed-shape inputs: the capped cache's own ``k``/``v`` buffers ``[L, Hkv, M, D]`` and a
  ``visible`` mask ``[L, Hkv, M]`` built from the session's request (all committed slots, or the StateKV
  prefix+sinks set) in one preallocated buffer;
* writing the returned K/V at slots ``[start, start + P)`` and scattering the returned mass ``[L, Hkv, M+P]``
  into the session's ``mass_out`` (committed slots, then the chunk);
* chunks longer than the engine's largest prefill chunk are run in pieces, each seeing the pieces before
  it (a long question on TensorRT, whose optimization profile bounds P);
* P = 1 is a decode step: runners that keep a separate decode profile (TensorRT) get ``"llm_decode"``,
  the others run the same ``"llm"`` graph;
* the token embedding and the tied ``lm_head`` stay in torch (a lookup and one GEMV: no engine needed, and
  the tied weight is shared with the embedding instead of being stored twice).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from edgekv.cache.capped import CappedKVCache
from edgekv.engines.manifest import EngineError


RunFn = Callable[[str, dict[str, torch.Tensor], dict[str, torch.Tensor]], None]


class GraphVision:
    """VisionBackend over a ``vision`` graph built for one grid."""

    def __init__(self, name: str, run: RunFn, grid_thw: tuple[int, int, int], num_tokens: int, hidden: int,
                 dtype: torch.dtype, device: torch.device, hint: str) -> None:
        self.name, self._run = name, run
        self.grid_thw = tuple(int(v) for v in grid_thw)
        self.num_tokens, self.hidden, self.dtype, self.device = num_tokens, hidden, dtype, device
        self.hint = hint

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid = tuple(int(v) for v in grid_thw.reshape(-1).tolist())
        if grid != self.grid_thw:
            raise EngineError(f"the {self.name} vision engine was built for grid {list(self.grid_thw)} (T, H, W "
                              f"patches) and got {list(grid)}: video.resolution changed since `edgekv build`. "
                              f"{self.hint}")
        out = torch.empty(self.num_tokens, self.hidden, dtype=self.dtype, device=self.device)
        self._run("vision", {"pixel_values": pixel_values.to(self.device, self.dtype).contiguous()}, {"tokens": out})
        return out


class GraphLLM:
    """LLMBackend over the ``llm`` graph built for a cache of ``M`` slots."""

    def __init__(self, name: str, run: RunFn, language, cache_tokens: int, max_chunk_tokens: int,
                 dtype: torch.dtype, device: torch.device, hint: str, decode_profile: bool = False,
                 kv_dtype: str | None = None) -> None:
        self.name, self._run = name, run
        text = language.config
        self.embed_tokens, self.lm_head = language.embed_tokens, language.lm_head
        self.layers, self.heads = text.num_hidden_layers, text.num_key_value_heads
        self.head_dim, self.hidden = text.head_dim, text.hidden_size
        self.capacity, self.max_chunk = cache_tokens, max_chunk_tokens
        self.dtype, self.device, self.hint = dtype, device, hint
        self.decode_profile = decode_profile
        self.kv_dtype = kv_dtype  # "int8": the graph takes the cache's codes, scales and tpos
        self._visible = torch.zeros(self.layers, self.heads, cache_tokens, dtype=torch.bool, device=device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def _check_cache(self, cache: CappedKVCache) -> None:
        if cache.capacity != self.capacity:
            raise EngineError(f"the {self.name} LLM engine was built for a cache of {self.capacity} slots; this "
                              f"session's cache has {cache.capacity} (cache.max_tokens / cache.max_mib changed "
                              f"since `edgekv build`). {self.hint}")
        if self.kv_dtype == "int8":
            if cache.k.dtype != torch.int8:
                raise EngineError(f"cache.kv_dtype: the {self.name} LLM engine was built for an int8 cache, this "
                                  f"session's cache stores {cache.k.dtype} (cache.kv_dtype changed since `edgekv "
                                  f"build`). {self.hint}")
            if cache.compute_dtype != self.dtype:
                raise EngineError(f"the {self.name} LLM engine computes in {self.dtype}, the session in "
                                  f"{cache.compute_dtype} (model.dtype changed since `edgekv build`). {self.hint}")
            return
        if cache.quantized:
            raise EngineError(f"cache.kv_dtype: the {self.name} LLM engine binds a {self.dtype} cache and has no "
                              f"8-bit inputs, this session's cache stores {cache.dtype}; rebuild with cache.kv_dtype: "
                              f"int8 set (`edgekv build`), or use engines.llm: torch. {self.hint}")
        if cache.k.dtype != self.dtype:
            raise EngineError(f"the {self.name} LLM engine takes a {self.dtype} cache, the session's is "
                              f"{cache.k.dtype} (model.dtype changed since `edgekv build`). {self.hint}")

    def prefill(self, embeds: torch.Tensor, position_ids: torch.Tensor, cache: CappedKVCache,
                visible: torch.Tensor | None = None, mass_out: torch.Tensor | None = None) -> torch.Tensor:
        self._check_cache(cache)
        start, total = cache.length, embeds.shape[0]
        if start + total > cache.capacity:
            raise ValueError(f"chunk [{start}, {start + total}) exceeds cache capacity {cache.capacity}")
        if mass_out is not None and total > self.max_chunk:
            raise EngineError(f"a chunk of {total} tokens with attention mass exceeds the engine's largest chunk "
                              f"({self.max_chunk}; engines.max_chunk_tokens). {self.hint}")
        embeds = embeds.to(self.dtype).contiguous()
        position_ids = position_ids.to(torch.long).contiguous()
        hiddens = []
        done = 0
        while done < total:
            num = min(self.max_chunk, total - done)
            at = start + done
            vis = self._visible
            vis.zero_()
            if visible is None:
                vis[:, :, :at] = True
            else:
                vis[:, :, :start] = visible[:, :, :start]
                vis[:, :, start:at] = True  # earlier pieces of this chunk
            outputs = {
                "hidden": torch.empty(num, self.hidden, dtype=self.dtype, device=self.device),
                "new_k": torch.empty(self.layers, self.heads, num, self.head_dim, dtype=self.dtype, device=self.device),
                "new_v": torch.empty(self.layers, self.heads, num, self.head_dim, dtype=self.dtype, device=self.device),
                "mass": torch.empty(self.layers, self.heads, self.capacity + num, dtype=torch.float32, device=self.device),
            }
            inputs = {"embeds": embeds[done:done + num], "position_ids": position_ids[:, done:done + num].contiguous()}
            if self.kv_dtype == "int8":
                inputs.update(k_codes=cache.k, k_scale=cache.k_scale, v_codes=cache.v, v_scale=cache.v_scale,
                              tpos=cache.tpos)
            else:
                inputs.update(k_cache=cache.k, v_cache=cache.v)
            inputs["visible"] = vis
            self._run("llm_decode" if num == 1 and self.decode_profile else "llm", inputs, outputs)
            if cache.quantized:  # quantized as the torch path writes it (time-neutral keys, per-slot scales)
                for layer in range(self.layers):
                    cache.write_layer(layer, at, outputs["new_k"][layer], outputs["new_v"][layer])
            else:
                cache.k[:, :, at:at + num].copy_(outputs["new_k"])
                cache.v[:, :, at:at + num].copy_(outputs["new_v"])
            if mass_out is not None:
                mass = outputs["mass"]
                mass_out[:, :, :at].copy_(mass[:, :, :at])
                mass_out[:, :, at:at + num].copy_(mass[:, :, self.capacity:])
            hiddens.append(outputs["hidden"])
            done += num
        return hiddens[0] if len(hiddens) == 1 else torch.cat(hiddens)


def make_backend(name: str, component: str, run: RunFn, dep, runtime, decode_profile: bool = False):
    """The ``component`` ("vision" | "llm") backend of an engine bundle resolved as ``dep`` (a Deployment)."""
    if component == "vision":
        return GraphVision(name, run, dep.key.grid_thw, dep.tokens_per_pair, dep.model_config.vision.out_hidden_size,
                           runtime.dtype, runtime.device, dep.hint)
    return GraphLLM(name, run, runtime.model.language, dep.key.cache_tokens, dep.key.max_chunk_tokens, runtime.dtype,
                    runtime.device, dep.hint, decode_profile=decode_profile, kv_dtype=dep.key.kv_dtype)
