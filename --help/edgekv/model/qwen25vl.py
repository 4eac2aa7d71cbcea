"""Qwen2.5-VL = vision tower + Qwen2 language model, for one-shot calls with processor-shaped inputs.

A prompt holds ``<|vision_start|><|image_pad|> * n<|vision_end|>`` (or ``<|video_pad|>``) per image / video,
``n = T * H * W / merge**2``. The merged visual tokens replace the pad tokens' embeddings in order
(images fill image pads, videos fill video pads), and positions come from :func:`get_rope_index`.
The streaming runtime calls ``visual`` and ``language`` directly; ``forward`` / ``generate`` here are the
reference path that tests hold against transformers.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from edgekv.model.config import ModelConfig
from edgekv.model.language import DenseKVCache, Qwen2LM, dense_causal_attend
from edgekv.model.rope import get_rope_index
from edgekv.model.vision import VisionTower


class Qwen25VL(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = VisionTower(config.vision)
        self.language = Qwen2LM(config.text)
        self.quantization = None  # the checkpoint's 4-bit format (edgekv.model.int4.QuantConfig), set on loading

    @property
    def dtype(self) -> torch.dtype:
        return self.language.norm.weight.dtype  # not the embedding's: it may be int8 (model.lm_head)

    @property
    def device(self) -> torch.device:
        return self.language.norm.weight.device

    def encode_video(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C*2*14*14], grid_thw [n, 3] -> merged tokens [N/4, d], slice-major, row-major."""
        return self.visual(pixel_values.to(self.device, self.dtype), grid_thw)

    def encode_image(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Same tower; an image is a single temporal slice (T = 1) of a frame written twice."""
        return self.visual(pixel_values.to(self.device, self.dtype), grid_thw)

    def embed(self, input_ids: torch.Tensor, pixel_values_videos: torch.Tensor | None = None,
              video_grid_thw: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
              image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [1, S] -> inputs_embeds [S, d] with visual tokens scattered into the pad positions."""
        ids = input_ids[0].to(self.device)
        embeds = self.language.embed_tokens(ids)  # [S, d]
        for name, token_id, pixels, grid in (("image", self.config.image_token_id, pixel_values, image_grid_thw),
                                             ("video", self.config.video_token_id, pixel_values_videos,
                                              video_grid_thw)):
            slots = torch.nonzero(ids == token_id).flatten()
            if pixels is None:
                if slots.numel():
                    raise ValueError(f"the prompt has {slots.numel()} {name} pad tokens but no {name} pixels")
                continue
            if grid is None:
                raise ValueError(f"{name} pixels given without {name}_grid_thw")
            tokens = self.visual(pixels.to(self.device, self.dtype), grid)  # [n, d]
            if tokens.shape[0] != slots.numel():
                raise ValueError(f"{name}: {tokens.shape[0]} visual tokens for {slots.numel()} pad tokens "
                                 "in the prompt")
            embeds = embeds.index_copy(0, slots, tokens.to(embeds.dtype))
        return embeds

    def position_ids(self, input_ids: torch.Tensor, video_grid_thw: torch.Tensor | None = None,
                     second_per_grid_ts: torch.Tensor | Sequence[float] | None = None,
                     image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """[3, S] M-RoPE positions of the prompt (transformers' ``get_rope_index``)."""
        return get_rope_index(self.config, input_ids, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                              second_per_grid_ts=second_per_grid_ts)[:, 0].to(self.device)

    def forward(self, input_ids: torch.Tensor, pixel_values_videos: torch.Tensor | None = None,
                video_grid_thw: torch.Tensor | None = None,
                second_per_grid_ts: torch.Tensor | Sequence[float] | None = None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """One-shot logits [1, S, V] for a whole prompt."""
        embeds = self.embed(input_ids, pixel_values_videos, video_grid_thw, pixel_values, image_grid_thw)
        positions = self.position_ids(input_ids, video_grid_thw, second_per_grid_ts, image_grid_thw)
        hidden = self.language(embeds, positions, dense_causal_attend)
        return self.language.logits(hidden)[None]

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *,
                 pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                 second_per_grid_ts: torch.Tensor | Sequence[float] | None = None,
                 pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                 stop_ids: Sequence[int] | None = None) -> list[int]:
        """Greedy decoding with a dense cache; returns the new token ids (the stop token included).

        Decode positions continue each row of the last prompt position by +1, as transformers' ``generate``
        does (it extends the prompt's position ids, not ``rope_deltas``); a prompt ending in text has equal rows.
        """
        stop = set(self.config.eos_token_ids if stop_ids is None else stop_ids)
        embeds = self.embed(input_ids, pixel_values_videos, video_grid_thw, pixel_values, image_grid_thw)
        positions = self.position_ids(input_ids, video_grid_thw, second_per_grid_ts, image_grid_thw)
        cache = DenseKVCache(self.config.text, embeds.shape[0] + max_new_tokens, dtype=self.dtype, device=self.device)
        hidden = self.language(embeds, positions, cache)
        cache.commit()
        next_position = positions[:, -1:] + 1  # [3, 1], per row as transformers extends position_ids
        out: list[int] = []
        for step in range(max_new_tokens):
            token = int(torch.argmax(self.language.logits(hidden[-1])))
            out.append(token)
            if token in stop or step == max_new_tokens - 1:
                break
            embed = self.language.embed_tokens(torch.tensor([token], device=self.device))
            hidden = self.language(embed, next_position + step, cache)
            cache.commit()
        return out
