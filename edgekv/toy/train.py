"""Train the toy Qwen2.5-VL on synthetic event streams (``edgekv train-toy OUT_DIR``).

The model trained is the runtime's own ``Qwen25VL`` (the modules the session runs), with autograd on:
a batch of samples (``edgekv.toy.data``) is laid out as the session lays out a stream — the chat
prefix, each kept frame pair's 16 vision tokens at its M-RoPE positions
(``vision_block_position_ids``), then one branch per question (``<|vision_end|>question<|im_end|>\\n
<|im_start|>assistant\\n`` + answer + ``<|im_end|>``) starting at the session's ``text_start`` — and a
per-sample boolean mask says who sees whom (causal inside a pair and a branch; evicted tokens invisible
from their eviction on; sinks only, in StateKV samples; branches never see each other). The loss is the
cross-entropy of the answer word and the closing ``<|im_end|>``.

Frames go through ``FramePreprocessor`` (the session's pixels, bit for bit) and the real vision tower,
all pairs of a batch in one call. AdamW, linear warm-up then cosine decay, gradient clipping at 1.
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from edgekv.model.rope import vision_block_position_ids
from edgekv.preprocess import FramePreprocessor
from edgekv.tokenizer import ChatLayout
from edgekv.toy.card import write_model_card
from edgekv.toy.data import CELL, CURRICULA, SHAPE_COVER, Sample, batch_pairs, draw_sample, event_tokens, stage_at
from edgekv.toy.model import (MAX_POSITIONS, RESOLUTION, ROPE_THETA, init_model, save_checkpoint, set_max_positions,
                              set_rope_theta, toy_config)
from edgekv.toy.prefetch import batches, sharded
from edgekv.toy.questions import ALL_FAMILIES, region_of
from edgekv.toy.vocab import build_tokenizer
from edgekv.video.events import COLORS, SHAPES, Event, EventScene, SceneStyle, place_event


@dataclass
class Batch:
    ids: torch.Tensor          # [B, S] token ids (video slots hold 0, replaced by vision tokens)
    positions: torch.Tensor    # [B, 3, S]
    mask: torch.Tensor         # [B, S, S] bool, True = query (row) sees key (column)
    video_index: torch.Tensor  # [N, 2] (b, s) of every video token
    video_source: torch.Tensor  # [N] row of the vision output feeding it
    pixel_values: torch.Tensor  # [R * 64, 1176]
    grid_thw: torch.Tensor     # [R, 3]
    target_index: torch.Tensor  # [T, 2] (b, s) whose next token is supervised
    targets: torch.Tensor      # [T] token ids
    families: list[str]        # [T] family of each target (answers and closing tokens)
    is_answer: torch.Tensor    # [T] bool: the answer word (not the closing <|im_end|>)
    # Diluted samples (``Sample.multiplicity``; None when the batch has none): log of the multiplicity at the
    # video tokens of background pairs, 0 elsewhere, added to the attention logits of every later pair's and
    # question's query — exactly as if each such key and value were there that many times.
    key_bias: torch.Tensor | None = None  # [B, S] float
    slot: torch.Tensor | None = None      # [B, S] long: -1 prefix and padding, the slot of a video token, K a branch
    # Where each answer should look (auxiliary batches): per question about events, the index in ``targets`` of its
    # answer word and the keys [A, S] holding the tokens of those events that its query sees (``attention_loss``).
    attend_rows: torch.Tensor | None = None  # [A] long
    attend_keys: torch.Tensor | None = None  # [A, S] bool
    # Where no answer should look (auxiliary batches of lured samples, ``avoid_loss``): per question of a sample
    # with lures on screen, the index in ``targets`` of its answer word and the lures' tokens [Q, S] its query sees.
    avoid_rows: torch.Tensor | None = None  # [Q] long
    avoid_keys: torch.Tensor | None = None  # [Q, S] bool
    # The same lured samples for a teacher that does not see the lures (``forward_logits(hide_lures=...)``): per
    # sample the lures' tokens [B, S] and the rows of its questions' branches [B, S] (every question token, answer
    # and closing token), whose queries are kept off them.
    lure_keys: torch.Tensor | None = None  # [B, S] bool
    branch_rows: torch.Tensor | None = None  # [B, S] bool
    # The batch as drawn, on the host (set by ``to``): what the step decides from (which targets are auxiliary, which
    # answer words to read) is read here, never from the device copy, so that a step queues its kernels without
    # waiting for the GPU (``host_rows``; issue 27: the GPU step's profile, docs/measurements.md "A toy trained on
    # the GPU").
    host: "Batch | None" = None

    def to(self, device: torch.device | str) -> "Batch":
        """The batch with its tensors on ``device`` (``grid_thw`` stays on the host: the tower reads it there).

        On a GPU the tensors are pinned first, so that their copies are queued behind the step before (a copy from
        pageable memory makes the host wait for the GPU to drain: 20-44 copies a step, 3-11 ms, in the toy step's
        profile of 2026-12-04)."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        pin = device.type == "cuda"
        moved = {name: ((value.pin_memory() if pin else value).to(device, non_blocking=True)
                        if isinstance(value, torch.Tensor) and name != "grid_thw" else value)
                 for name, value in self.__dict__.items() if name != "host"}
        return Batch(**moved, host=self.host or self)


def host_rows(flags: np.ndarray, device: torch.device) -> torch.Tensor:
    """The indices of ``flags``' True entries as a long tensor on ``device``, made on the host: no device sync.

    Boolean indexing of a device tensor (``logits[mask]``), ``.any()`` in a condition and ``.item()`` each make the
    host wait for the GPU; the toy step's profile on an H200 (2026-12-04) found ~25 such waits a step and the host
    and the device then taking turns (wall 100 ms a step, device 53 ms, at batch 32)."""
    return _queued_to(torch.from_numpy(np.flatnonzero(flags)), device)


def _queued_to(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without the host waiting for the GPU: pinned, then copied behind the kernels
    queued before (``Batch.to``)."""
    if device.type == "cpu":
        return values
    return (values.pin_memory() if device.type == "cuda" else values).to(device, non_blocking=True)


@contextmanager
def tf32_products(device: torch.device | str, enabled: bool = True):
    """fp32 matrix products on a CUDA GPU's tensor cores (TF32: inputs rounded to a 10-bit mantissa, fp32 sums) for
    the block, as the GPU toy rounds train (``edgekv train-toy --device cuda``; ``--fp32-products`` keeps them fp32).
    The toy step's profile on an H200 (2026-12-04) found its products and their backward in fp32 FFMA kernels
    (``sm80_xmma_gemm_f32f32...ffma``), the tensor cores idle. Nothing changes on the CPU."""
    if torch.device(device).type != "cuda" or not enabled:
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _on_host(batch):
    """The batch's host copy (``Batch.host``), or the batch itself when it was never moved."""
    return getattr(batch, "host", None) or batch


class Encoder:
    """Lays samples out as token sequences, positions and visibility masks."""

    def __init__(self, aux: bool = False, seed: int = 0, size: int = RESOLUTION[0], aux_where: bool = False) -> None:
        tokenizer, special = build_tokenizer()
        self.size = size
        # where-words as auxiliary targets too (a third of an event's tokens name the event's region of the
        # frame): the ViT has no absolute position embedding, so "where" must be learned into the tokens
        self.aux_where = aux_where
        self.grid = size // CELL  # merged tokens per side
        self.tokens = self.grid * self.grid
        # Auxiliary targets at the video tokens (training only): the colour or shape word of the event a
        # token shows (drawn at random, so the best prediction encodes both), "no" on the background.
        self.aux = aux
        self.aux_rng = np.random.default_rng((seed, 3))
        self.tokenizer = tokenizer
        self.im_end = special["<|im_end|>"]
        self.no = self.ids("no")[0]
        self.layout = ChatLayout()
        self.prefix = tokenizer.encode(self.layout.stream_prefix(), add_special_tokens=False).ids
        self.preprocessor = FramePreprocessor(resolution=(size, size))

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode(self, samples: list[Sample]) -> Batch:
        rows = [self._encode_one(sample) for sample in samples]
        longest = max(len(r["ids"]) for r in rows)
        count = len(rows)
        ids = torch.zeros(count, longest, dtype=torch.long)
        positions = torch.zeros(count, 3, longest, dtype=torch.long)
        mask = torch.zeros(count, longest, longest, dtype=torch.bool)
        mask[:] = torch.eye(longest, dtype=torch.bool)  # padding rows see themselves (no empty softmax)
        diluted = any(sample.multiplicity != 1.0 for sample in samples)
        key_bias = torch.zeros(count, longest) if diluted else None
        slot_of = torch.full((count, longest), -1, dtype=torch.long) if diluted else None
        video_index, video_source, pixels, target_index, targets, families, is_answer = [], [], [], [], [], [], []
        attend_rows: list[int] = []
        attend_keys: list[np.ndarray] = []
        avoid_rows: list[int] = []
        avoid_keys: list[np.ndarray] = []
        lure_keys = branch_rows = None
        pair_offset = 0
        for b, (row, sample) in enumerate(zip(rows, samples)):
            n = len(row["ids"])
            ids[b, :n] = torch.tensor(row["ids"])
            positions[b, :, :n] = row["positions"]
            mask[b, :n, :n] = torch.from_numpy(row["mask"])
            if diluted:
                slot_of[b, :n] = torch.from_numpy(row["slot_of"])
                background = sample.background_slots()
                for slot, at in enumerate(row["slot_positions"]):
                    if background[slot] and at:
                        key_bias[b, at] = math.log(sample.multiplicity)
            for first, second in sample.pairs:
                pixels.append(self.preprocessor.pair(first, second)[0])
            for slot, pair in enumerate(sample.slot_pair):
                for token, position in zip(row["slot_tokens"][slot], row["slot_positions"][slot]):
                    video_index.append((b, position))
                    video_source.append((pair_offset + pair) * self.tokens + token)
                    if self.aux:
                        shown = int(sample.carried[slot, token])
                        if shown < 0:
                            label = self.no
                        else:  # a sliver of a shape shows its colour, not which shape it is
                            event = sample.events[shown]
                            shows = (sample.cover[slot, token] >= SHAPE_COVER if sample.shows_shape is None
                                     else sample.shows_shape[slot, token])
                            region = region_of(event.center, self.size, self.size) if self.aux_where else None
                            if region is not None and self.aux_rng.random() < 1 / 3:
                                label = self.ids(region)[0]
                            else:
                                shows_shape = shows and self.aux_rng.random() < 0.5
                                label = self.ids(event.shape if shows_shape else event.color)[0]
                        target_index.append((b, position))
                        targets.append(label)
                        families.append("aux")
                        is_answer.append(False)
            pair_offset += len(sample.pairs)
            for local, keys in row["attend"]:
                attend_rows.append(len(targets) + local)
                attend_keys.append(keys)
            for local, keys in row["avoid"]:
                avoid_rows.append(len(targets) + local)
                avoid_keys.append(keys)
            if row["lure_at"] is not None and len(row["lure_at"]):
                if lure_keys is None:
                    lure_keys = torch.zeros(count, longest, dtype=torch.bool)
                    branch_rows = torch.zeros(count, longest, dtype=torch.bool)
                lure_keys[b, torch.from_numpy(row["lure_at"])] = True
                branch_rows[b, :n] = torch.from_numpy(row["branch"])
            for s, target, family, answer in row["targets"]:
                target_index.append((b, s))
                targets.append(target)
                families.append(family)
                is_answer.append(answer)
        grid = torch.tensor([[1, 2 * self.grid, 2 * self.grid]] * pair_offset)
        rows_at, keys_at = _marked_keys(attend_rows, attend_keys, longest)
        avoid_at, avoid_keys_at = _marked_keys(avoid_rows, avoid_keys, longest)
        return Batch(ids, positions, mask, torch.tensor(video_index), torch.tensor(video_source), torch.cat(pixels),
                     grid, torch.tensor(target_index), torch.tensor(targets), families, torch.tensor(is_answer),
                     key_bias, slot_of, rows_at, keys_at, avoid_at, avoid_keys_at, lure_keys, branch_rows)

    def _encode_one(self, sample: Sample) -> dict:
        slots = sample.slots
        s0 = len(self.prefix)
        present = np.ones((slots, self.tokens), dtype=bool) if sample.present is None else sample.present
        ids = list(self.prefix)
        pos = [torch.arange(s0).expand(3, s0)]
        # token attributes for the mask: kind 0 prefix, 1 video, 2 + b for question branch b
        kind, slot_of, order, evict = [0] * s0, [-1] * s0, list(range(s0)), [slots + 1] * s0
        sink = [True] * s0
        slot_tokens, slot_positions = [], []
        for slot in range(slots):
            tokens = np.flatnonzero(present[slot])
            slot_tokens.append(tokens.tolist())
            slot_positions.append(list(range(len(ids), len(ids) + len(tokens))))
            ids.extend([0] * len(tokens))
            pos.append(vision_block_position_ids(s0, sample.tpos[slot], self.grid, self.grid)[:, torch.from_numpy(tokens)])
            kind.extend([1] * len(tokens))
            slot_of.extend([slot] * len(tokens))
            order.extend(tokens.tolist())
            evict.extend(sample.evict_at[slot, tokens].tolist())
            sink.extend((sample.sink[slot, tokens] if sample.sink is not None else np.ones(len(tokens), bool)).tolist())
        text_start = max(s0 + max(sample.tpos), s0 + self.grid - 1) + 1
        targets = []
        looks: list[tuple[int, int, list[int]]] = []  # (local target index, query row, events asked about)
        queries: list[tuple[int, int]] = []  # (local target index, query row) of every question
        for branch, qa in enumerate(sample.qas):
            question = self.ids(self.layout.question_suffix(qa.question))
            answer = self.ids(qa.answer)
            tokens = question + answer + [self.im_end]
            first = len(ids)
            if self.aux and qa.about:  # where the answer should look (``attention_loss``): training batches only
                about = [index for index, event in enumerate(sample.events) if any(event is e for e in qa.about)]
                looks.append((len(targets), first + len(question) - 1, about))
            queries.append((len(targets), first + len(question) - 1))
            ids.extend(tokens)
            pos.append(torch.arange(text_start, text_start + len(tokens)).expand(3, len(tokens)))
            kind.extend([2 + branch] * len(tokens))
            slot_of.extend([slots] * len(tokens))
            order.extend(range(len(tokens)))
            for k, token in enumerate(answer + [self.im_end]):
                targets.append((first + len(question) - 1 + k, token, qa.family, k < len(answer)))
        kind_a, slot_a, order_a = np.array(kind), np.array(slot_of), np.array(order)
        n = len(ids)
        evict = np.array(evict + [slots + 1] * (n - len(evict)), dtype=np.int64)
        sink = np.array(sink + [True] * (n - len(sink)), dtype=bool)
        q_kind, k_kind = kind_a[:, None], kind_a[None, :]
        q_slot, k_slot = slot_a[:, None], slot_a[None, :]
        same_unit = (q_kind == k_kind) & (q_slot == k_slot) & (order_a[None, :] <= order_a[:, None])
        video_query = q_kind == 1
        branch_query = q_kind >= 2
        earlier_video = (k_kind == 1) & (k_slot < q_slot) & (evict[None, :] > q_slot)
        mask = (k_kind == 0) & ((q_kind != 0) | (order_a[None, :] <= order_a[:, None]))
        mask |= same_unit & (q_kind != 0)
        mask |= video_query & earlier_video & sink[None, :]
        mask |= branch_query & earlier_video
        attend, avoid = [], []
        lure_at = None
        lured = sample.lured if self.aux else None
        if looks or lured is not None:
            video_at = np.concatenate([np.asarray(p, dtype=np.int64) for p in slot_positions])  # every video token
        if looks:
            shows = np.concatenate([sample.carried[slot, t] for slot, t in enumerate(slot_tokens)])  # its event
            for local, query, about in looks:  # the about-events' tokens the answer's query sees (not evicted ones)
                keys = video_at[np.isin(shows, about)]
                seen = keys[mask[query, keys]]
                if len(seen):
                    attend.append((local, seen))
        if lured is not None:
            keys = video_at[np.concatenate([lured[slot, t] for slot, t in enumerate(slot_tokens)])]
            lure_at = keys
            for local, query in queries:  # the lures' tokens each question's query sees
                seen = keys[mask[query, keys]]
                if len(seen):
                    avoid.append((local, seen))
        return {"ids": ids, "positions": torch.cat(pos, dim=1), "mask": mask, "video_start": s0, "targets": targets,
                "slot_tokens": slot_tokens, "slot_positions": slot_positions, "slot_of": slot_a, "attend": attend,
                "avoid": avoid, "lure_at": lure_at, "branch": kind_a >= 2}


def _marked_keys(rows: list[int], keys: list[np.ndarray], longest: int
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(rows [A] long, keys [A, longest] bool with each row's keys set), or (None, None) when there are none."""
    if not rows:
        return None, None
    marked = torch.zeros(len(rows), longest, dtype=torch.bool)
    for a, chosen in enumerate(keys):
        marked[a, torch.from_numpy(chosen)] = True
    return torch.tensor(rows), marked


ATTEND_LAYER = 1  # the LM layer whose question attention ``attention_loss`` steers: where the shipped toy's needles
# take the most of it (tools/toy_lure_attention.py: layer 1, 0.18 of the last query token's mass on 3 needle tokens).
# The layers ``avoid_loss`` steers by default: the shipped toy's questions, kept from the lures' tokens (every cell a
# lure covers) in LM layers 1, 2 and 3 while they are asked, answer the 250-pair lured needle streams as streams
# without lures (0.917 against 0.933; none kept from them: 0.617; layer 1 alone 0.825, 1 and 2 0.908; issue 27).
AVOID_LAYERS = (1, 2, 3)
# What ``avoid_loss`` takes the lures' share of: ``all`` the head's attention, or only its attention on video tokens.
# With ``all`` a head can meet the term by giving its mass to the prompt instead of the frames: the toy trained
# 600 steps at W = 3 over layers 1-3 (V2) looks from layers 2 and 3 at no video at all (lures 0.002, needles 0.022,
# other video 0.013 of the question's attention in layer 2), and its short streams lost 12 points (issue 27).
# ``video`` leaves that way out: only looking at other video tokens than the lures lowers it. ``needles`` takes the
# lures' share of the lures' and the asked-about events' tokens: only a needle token read above a lure token lowers
# it (the background drew V6's mass when the lures lost theirs among the frames).
AVOID_AMONG = ("all", "video", "needles")


def forward_logits(model, batch: Batch, recompute: bool = False, attention_loss: list | None = None,
                   avoid_loss: list | None = None, avoid_layers: tuple[int, ...] = AVOID_LAYERS,
                   avoid_among: str = "all", hide_lures: tuple[int, ...] = (), looks: dict | None = None,
                   look_layers: tuple[int, ...] = AVOID_LAYERS) -> torch.Tensor:
    """Logits [T, V] at the supervised positions (the runtime's modules, batched).

    ``attention_loss`` (a list; the batch's ``attend_rows``, without ``recompute``): appends the mean over the
    batch's questions about events of -log(the share of ``ATTEND_LAYER``'s attention, averaged over the query heads,
    that the answer's query gives to the tokens of those events). Issue 27: the toy's question attention prefers a
    needle token over a lure token only ~40 times, so a few hundred lures take most of it (docs/measurements.md, "Every
    lure costs alike"); this term asks for the margin directly.

    ``avoid_loss`` (a list; the batch's ``avoid_rows``, without ``recompute``): appends, for each of
    ``avoid_layers``, the mean over the batch's questions of lured samples and the query heads of -log(1 - the share
    of the head's attention that the answer's query gives to the lures' tokens). Unlike ``attention_loss`` it asks
    nothing of where the rest of the attention goes (the background, the text): only that it leave the lures.
    ``avoid_among="video"`` takes the share of the head's attention on the video tokens instead (``AVOID_AMONG``);
    ``"needles"`` the lures' share of what the head gives the lures and the tokens of the events the question asks
    about (questions about no event add nothing), so the term is -log(1 + lure mass / needle mass): a ratio that
    looking anywhere else — the prompt, the background — leaves as it is.

    ``hide_lures``: in those LM layers the queries of every question's branch do not see the lures' tokens
    (``Batch.lure_keys``; the stream's own tokens see them as always) — the teacher of ``train(distill_weight=...)``,
    as ``tools/toy_lure_attention.py --keep-off-lures`` hides them at run time (issue 27: the shipped toy then reads
    250-pair lured streams at 0.917 against 0.617, 0.933 without lures). ``looks`` (a dict): for each of
    ``look_layers``, the log of each head's attention over the keys from the query of every answer word
    (``Batch.is_answer``), [A, Hq, S] — what ``distill_weight`` matches.

    ``recompute`` keeps no layer's activations for the backward pass but its input, and runs the layer again
    there (``torch.utils.checkpoint``): the memory of one layer's attention weights at a time instead of every
    layer's — what a context of thousands of tokens needs on a CPU — for about a third more compute; the
    gradients are the same."""
    language = model.language
    vision = model.visual(batch.pixel_values, batch.grid_thw)  # [R * 16, d]
    embeds = language.embed_tokens(batch.ids).clone()  # [B, S, d]
    embeds[batch.video_index[:, 0], batch.video_index[:, 1]] = vision[batch.video_source].to(embeds.dtype)
    cos, sin = zip(*(language.rotary(p) for p in batch.positions))
    cos, sin = torch.stack(cos)[:, None], torch.stack(sin)[:, None]  # [B, 1, S, hd]
    # additive float mask, converted once for every layer (SDPA would convert a bool mask per call)
    mask = torch.zeros(batch.mask.shape, dtype=embeds.dtype, device=embeds.device).masked_fill_(
        ~batch.mask, float("-inf"))
    if batch.key_bias is not None:  # diluted samples: background keys weigh as many, seen from later slots
        later = batch.slot[:, :, None] > batch.slot[:, None, :]
        mask += later.to(mask.dtype) * batch.key_bias[:, None, :].to(mask.dtype)
    mask = mask[:, None]

    steer = attention_loss is not None and batch.attend_rows is not None
    avoid = avoid_loss is not None and batch.avoid_rows is not None
    if (steer or avoid or looks is not None) and recompute:
        raise ValueError("attention_loss, avoid_loss and looks need the layers' activations: not with recompute")
    hidden_mask = mask
    if hide_lures and batch.lure_keys is not None:  # the branches' queries kept off the lures' tokens
        hidden_mask = mask.masked_fill((batch.branch_rows[:, :, None] & batch.lure_keys[:, None, :])[:, None],
                                       float("-inf"))
    host = _on_host(batch)
    answers = host_rows(np.asarray(host.is_answer), embeds.device) if looks is not None else None
    if avoid_among not in AVOID_AMONG:
        raise ValueError(f"avoid_among is one of {', '.join(AVOID_AMONG)}, got {avoid_among!r}")
    if avoid and avoid_among == "video":  # per avoided question, the video tokens of its sample
        video = torch.zeros(batch.ids.shape, dtype=torch.bool, device=batch.ids.device)
        video[batch.video_index[:, 0], batch.video_index[:, 1]] = True
        avoid_video = video[batch.target_index[batch.avoid_rows, 0]]  # [Q, S]
    avoid_rows, avoid_keys = batch.avoid_rows, batch.avoid_keys
    if avoid and avoid_among == "needles":  # only the questions about events: their lures against their needles
        if batch.attend_rows is None:
            avoid = False
        else:
            match = np.asarray(host.avoid_rows)[:, None] == np.asarray(host.attend_rows)[None, :]  # [Q, A]
            kept = match.any(-1)
            avoid = bool(kept.any())
            if avoid:
                chosen = host_rows(kept, embeds.device)
                needles = _queued_to(torch.from_numpy(match[kept].argmax(-1)), embeds.device)  # each one's own row
                avoid_rows, avoid_keys = batch.avoid_rows[chosen], batch.avoid_keys[chosen]
                avoid_needles = batch.attend_keys[needles]  # [Q', S]

    def log_attention(rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """[A, Hq, S]: log of each head's attention over the keys from the query of each row's answer."""
        where = batch.target_index[rows]  # [A, 2]: (b, s) of each answer's query
        queries = q[where[:, 0], :, where[:, 1]].float()  # [A, Hq, hd]
        keys = k[where[:, 0]].float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [A, Hq, S, hd]
        scores = torch.einsum("ahd,ahsd->ahs", queries, keys) / q.shape[-1] ** 0.5
        scores = scores + seen[where[:, 0], 0, where[:, 1]][:, None].float()  # the same visibility and dilution
        return torch.log_softmax(scores, dim=-1)

    def log_shares(rows: torch.Tensor, marked: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """[A, Hq]: log of each head's attention share on the marked keys, from the query of each row's answer."""
        logp = log_attention(rows, q, k, mask)
        return logp.masked_fill(~marked[:, None], float("-inf")).logsumexp(-1)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen = hidden_mask if layer in hide_lures else mask
        if looks is not None and layer in look_layers and len(answers):
            looks[layer] = log_attention(answers, q, k, seen)
        if steer and layer == ATTEND_LAYER:
            share = log_shares(batch.attend_rows, batch.attend_keys, q, k).exp().mean(-1)
            attention_loss.append(-torch.log(share + 1e-6).mean())
        if avoid and layer in avoid_layers:
            logs = log_shares(avoid_rows, avoid_keys, q, k)  # [Q, Hq]
            if avoid_among == "video":  # the lures' tokens are video tokens: a share of at most 1
                logs = logs - log_shares(avoid_rows, avoid_video, q, k)
            elif avoid_among == "needles":  # lures / (lures + needles): log(1 + lures / needles) below
                logs = logs - torch.logaddexp(logs, log_shares(avoid_rows, avoid_needles, q, k))
            share = logs.exp()
            avoid_loss.append(-torch.log1p(-share.clamp(max=1 - 1e-6)).mean())
        return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=True)

    x = embeds
    for index, layer in enumerate(language.layers):
        if recompute and torch.is_grad_enabled():
            x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, index, attend, use_reentrant=False)
        else:
            x = layer(x, cos, sin, index, attend)
    hidden = language.norm(x[batch.target_index[:, 0], batch.target_index[:, 1]])
    return language.logits(hidden)


def distill_terms(student_looks: dict, teacher_looks: dict, student_logits: torch.Tensor,
                  teacher_logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention, answers): the student's distance from a teacher that does not see the lures (issue 27).

    ``attention``: the mean over ``teacher_looks``' layers, the answer words' queries and the query heads of
    KL(teacher || student) between the two attentions over the keys (``forward_logits(looks=...)``): the teacher's
    hides the lures' tokens, so this asks the student to leave them *and* to spread the rest as the teacher does —
    over the same frames, the text and the question — which ``avoid_loss`` leaves free (V2 met it by looking at no
    video from layers 2-3). ``answers``: the mean over the answer words of KL(teacher || student) between the next-
    token distributions. On a sample without lures the teacher is the round's starting model: both terms then hold
    the student to what it read before (the short streams the avoid rounds lost)."""
    layers = [layer for layer in teacher_looks if layer in student_looks]
    if layers:
        per_layer = []
        for layer in layers:
            lt, ls = teacher_looks[layer], student_looks[layer]
            seen = torch.isfinite(lt)  # the keys the teacher's query sees (a subset of the student's)
            # exp(-inf) = 0 weighs the unseen keys out; their logs are zeroed so that 0 x -inf never makes a nan
            term = lt.exp() * (lt.masked_fill(~seen, 0.0) - ls.masked_fill(~seen, 0.0))
            per_layer.append(term.sum(-1).mean())
        attention = torch.stack(per_layer).mean()
    else:
        attention = student_logits.new_zeros(())
    host = _on_host(batch)
    if np.asarray(host.is_answer).any():
        answer = host_rows(np.asarray(host.is_answer), student_logits.device)
        lt = torch.log_softmax(teacher_logits[answer].float(), -1)
        ls = torch.log_softmax(student_logits[answer].float(), -1)
        answers = (lt.exp() * (lt - ls)).sum(-1).mean()
    else:
        answers = student_logits.new_zeros(())
    return attention, answers


def accuracy_by_family(logits: torch.Tensor, batch: Batch) -> dict[str, list[int]]:
    """family -> [correct, total] over the answer words (teacher-forced argmax)."""
    correct = (logits.argmax(-1) == batch.targets).tolist()
    out: dict[str, list[int]] = {}
    for ok, family, answer in zip(correct, batch.families, batch.is_answer.tolist()):
        if answer:
            slot = out.setdefault(family, [0, 0])
            slot[0] += int(ok)
            slot[1] += 1
    return out


# ---------------------------------------------------------------------------------------------- vision warm-up
def vision_batch(rng: np.random.Generator, preprocessor: FramePreprocessor, count: int,
                 families: tuple[str, ...] | None = None, size: int = RESOLUTION[0], world: float = 0.0,
                 lures: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``count`` frame pairs with one to four shapes each, and per-token labels: shape (0 = none, -1 = a
    sliver too small to tell) and colour (0 = none) of the event covering most of the token's cell.
    A share ``world`` of the pairs is drawn in the randomized world on ``families`` (world sizes, camera,
    light, JPEG, distractors, occlusion); the rest on the classic renderer. A share ``lures`` of the world
    pairs also shows up to three look-alikes (``lure_clutter``: out-of-vocabulary shapes in the vocabulary's
    colours, apart from the events), their tokens labelled none: the per-token lesson that a red star is no
    red cross, which distractors in other colours never teach (they can be told by colour alone)."""
    grid = size // CELL
    tokens = grid * grid
    pixels, shapes, colors = [], [], []
    for _ in range(count):
        in_world = bool(world) and rng.random() < world
        events: list[Event] = []
        if in_world:
            from edgekv.video.world import (DEFAULT_HOLDOUT, WorldScene, drawable_families, random_style,
                                            world_event)

            drawable = families or drawable_families(None, DEFAULT_HOLDOUT)
            for _ in range(int(rng.integers(1, 5))):
                events.append(world_event(rng, str(rng.choice(SHAPES)), str(rng.choice(COLORS)), 0, 1, size, size,
                                          avoid=events))
            scene = WorldScene(size, size, 2.0, int(rng.integers(2 ** 31)), events,
                               drawable[int(rng.integers(len(drawable)))], random_style(rng))
            if lures and rng.random() < lures:  # drawn only where asked: warm-ups without lures draw as before
                scene.clutter = [*scene.clutter, *lure_clutter(rng, int(rng.integers(1, 4)), events, size)]
        else:
            for _ in range(int(rng.integers(1, 5))):
                events.append(place_event(rng, str(rng.choice(SHAPES)), str(rng.choice(COLORS)), 0, 1, size, size,
                                          avoid=events))
            style = SceneStyle(noise=float(rng.uniform(1, 6)), light=float(rng.uniform(0, 0.2)),
                               distractors=int(rng.choice([0, 0, 1, 2])))
            scene = EventScene(size, size, seed=int(rng.integers(2 ** 31)), events=events, style=style)
        pixels.append(preprocessor.pair(*scene.pair_frames(0))[0])
        shape, color, best = np.zeros(tokens, np.int64), np.zeros(tokens, np.int64), np.zeros(tokens)
        for event in events:
            cover = scene.cell_cover(event).reshape(-1)
            carried, shows = event_tokens(cover)
            wins = carried & (cover > best)
            color[wins] = COLORS.index(event.color) + 1
            shape[wins] = np.where(shows[wins], SHAPES.index(event.shape) + 1, -1)
            best = np.where(wins, cover, best)
        shapes.append(shape)
        colors.append(color)
    grid_thw = torch.tensor([[1, 2 * grid, 2 * grid]] * count)
    return torch.cat(pixels), grid_thw, torch.from_numpy(np.concatenate(shapes)), torch.from_numpy(np.concatenate(colors))


def lure_clutter(rng: np.random.Generator, count: int, events: list[Event], size: int) -> list:
    """Up to ``count`` static look-alikes for a ``size`` x ``size`` world pair: an out-of-vocabulary shape
    (``edgekv.video.world.DISTRACTOR_SHAPES``) in a vocabulary colour, of the world's radii, each clear of
    ``events`` and of the others (a few tries each; one that finds no room is left out). Measured (issue 27;
    docs/measurements.md, "Look-alikes in the tower"): a warm-up with them lifts how well a linear probe tells a
    needle's token from a look-alike's (``tools/toy_lure_probe.py``) from 0.914 to 0.932 on the shipped toy's tower."""
    from edgekv.video.world import DISTRACTOR_SHAPES, Clutter, draw_radius, world_radius_range

    low, high = world_radius_range(size, size)
    placed: list[tuple[tuple[float, float], float]] = [(event.center, event.radius) for event in events]
    out = []
    for _ in range(count):
        shape, color = str(rng.choice(DISTRACTOR_SHAPES)), str(rng.choice(COLORS))
        radius = float(draw_radius(rng, (low, max(low, high * 2 // 3))))
        angle = float(rng.uniform(0, np.pi))
        for _ in range(8):
            center = (float(rng.uniform(radius, size - radius)), float(rng.uniform(radius, size - radius)))
            if all(math.dist(center, other) > radius + other_radius + 2 for other, other_radius in placed):
                placed.append((center, radius))
                out.append(Clutter(shape, color, center, radius, angle))
                break
    return out


def vision_batches(rng: np.random.Generator, steps: int, batch_size: int, families: tuple[str, ...] | None = None,
                   size: int = RESOLUTION[0], world: float = 0.0, lures: float = 0.0):
    """The warm-up's batches (``vision_batch``), one per step."""
    preprocessor = FramePreprocessor(resolution=(size, size))
    for _ in range(steps):
        yield vision_batch(rng, preprocessor, batch_size, families, size, world, lures)


def vision_batches_sharded(seed: int, steps: int, batch_size: int, families: tuple[str, ...] | None = None,
                           size: int = RESOLUTION[0], world: float = 0.0, lures: float = 0.0, shard: int = 0,
                           shards: int = 1):
    """Warm-up steps ``shard, shard + shards, ...``, each drawn from its own generator ``(seed, 13, step)``:
    the same batches however many workers share the steps (``edgekv.toy.prefetch.sharded``)."""
    preprocessor = FramePreprocessor(resolution=(size, size))
    for step in range(shard, steps, shards):
        yield vision_batch(np.random.default_rng((seed, 13, step)), preprocessor, batch_size, families, size, world,
                           lures)


def qa_batch(rng: np.random.Generator, step: int, steps: int, batch_size: int, encoder: Encoder,
             curriculum: str = "full", families: tuple[str, ...] | None = None, size: int = RESOLUTION[0],
             max_positions: int = MAX_POSITIONS, mark_lures: bool = False) -> Batch:
    """Step ``step``'s batch: the curriculum stage at its progress, a narrow range of K, ``batch_size``
    samples, encoded; world samples drawn on ``families``, temporal positions up to ``max_positions``;
    ``mark_lures``: the lures' tokens marked for ``avoid_loss`` (``draw_sample``)."""
    stage = stage_at(step / max(1, steps), rng, curriculum)
    pairs = batch_pairs(stage, rng)
    count = batch_size if stage.batch_divisor == 1 else max(1, batch_size // stage.batch_divisor)
    return encoder.encode([draw_sample(rng, stage, max_positions, size=size, pairs=pairs, families=families,
                                       mark_lures=mark_lures) for _ in range(count)])


def qa_batches(rng: np.random.Generator, steps: int, batch_size: int, aux: bool, seed: int,
               curriculum: str = "full", families: tuple[str, ...] | None = None, size: int = RESOLUTION[0],
               max_positions: int = MAX_POSITIONS, mark_lures: bool = False):
    """The question-answering steps' batches (``qa_batch``), all from the one generator ``rng``."""
    encoder = Encoder(aux=aux, seed=seed, size=size, aux_where=families is not None)
    for step in range(steps):
        yield qa_batch(rng, step, steps, batch_size, encoder, curriculum, families, size, max_positions, mark_lures)


def qa_batches_sharded(seed: int, steps: int, batch_size: int, aux: bool, curriculum: str = "full",
                       families: tuple[str, ...] | None = None, size: int = RESOLUTION[0],
                       max_positions: int = MAX_POSITIONS, mark_lures: bool = False, shard: int = 0,
                       shards: int = 1):
    """Steps ``shard, shard + shards, ...``, each from its own generators (the draws ``(seed, 11, step)``, the
    auxiliary labels ``(seed, 3, step)``): the same batches however many workers share the steps."""
    encoder = Encoder(aux=aux, seed=seed, size=size, aux_where=families is not None)
    for step in range(shard, steps, shards):
        encoder.aux_rng = np.random.default_rng((seed, 3, step))
        yield qa_batch(np.random.default_rng((seed, 11, step)), step, steps, batch_size, encoder, curriculum,
                       families, size, max_positions, mark_lures)


def probe_loss(shape_probe, color_probe, tokens: torch.Tensor, shape: torch.Tensor, color: torch.Tensor
               ) -> torch.Tensor:
    """The warm-up's loss on a tower's tokens: event tokens' shape (slivers, -1, left out) and colour, background
    tokens (colour 0) weighted a quarter. ``shape`` and ``color`` are read on the host (moved there if they are
    not): the tokens each term reads are chosen there, so that the step never waits for the GPU (``host_rows``)."""
    shape, color = shape.cpu(), color.cpu()
    background = color == 0

    def term(probe, labels: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        rows = host_rows(flags.numpy(), tokens.device)
        return F.cross_entropy(probe(tokens[rows]), _queued_to(labels[flags], tokens.device))

    return (term(shape_probe, shape, shape > 0) + term(color_probe, color, ~background)
            + 0.25 * (term(shape_probe, shape, background) + term(color_probe, color, background)))


def token_positions(count: int, grid: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each of ``count`` tower output tokens in its frame pair (``grid`` merged tokens a
    side): the tower gives each pair's tokens in raster order (its window permutation undone)."""
    index = torch.arange(count, device=device) % (grid * grid)
    return index // grid, index % grid


def position_loss(row_probe, col_probe, tokens: torch.Tensor, grid: int) -> torch.Tensor:
    """The warm-up's position loss: every token's row and column in its frame pair, read by two linear probes."""
    row, col = token_positions(tokens.shape[0], grid, tokens.device)
    return 0.5 * (F.cross_entropy(row_probe(tokens), row) + F.cross_entropy(col_probe(tokens), col))


def warm_up_vision(model, steps: int, rng: np.random.Generator, lr: float = 2e-3, batch_size: int = 32,
                   log: Callable[[str], None] = print, log_every: int = 100, prefetch: bool = False,
                   families: tuple[str, ...] | None = None, size: int = RESOLUTION[0], world: float = 0.0,
                   workers: int = 0, seed: int = 0, position: bool = True, lures: float = 0.0) -> list[dict]:
    """Train the vision tower alone to tell shape and colour per token, through two linear probes that are
    then thrown away — the role a pre-trained ViT plays for a real VLM. Trained from scratch inside the
    question-answering loop, this 4-block ViT learned colours in tens of steps but shapes only after
    thousands (measured: token shape accuracy 0.44 after 800 steps of 32 pairs), which held every
    question about shapes back; alone, its steps are cheap. ``workers`` > 0 draws the batches sharded over
    that many processes (``vision_batches_sharded``, seeded by ``seed``) instead of from ``rng``; the tower
    trains where the model's parameters are.

    ``position`` also teaches each token where it is in the frame (row and column probes,
    ``position_loss``). Nothing else can tell the LM: the tower has no absolute position embedding (2-D
    RoPE only), and the LM's M-RoPE gives the width section the lowest frequencies — at the toy's
    head_dim 16 with rope_theta 1e6, 1.8e-4 rad a column and below (theta^(-5/8); the 3B's width section
    starts at the same frequency), invisible across 4 columns. Measured on the world-trained toy whose tower
    was warmed up without it: ``Where was the {color} {shape}?`` answered 0.16 (chance 0.20), its
    mistakes spread over every region, and fresh linear probes read its event tokens' row / column at
    0.36 / 0.34. Re-warmed 1,500 steps with this loss, the same 4-block tower's event tokens read 0.998 /
    0.999 (0.995 / 0.994 on held-out backgrounds) with its shape probe at 0.95: the softmax over a
    frame's finite set of keys is not translation invariant at the frame's edges (docs/measurements.md, "`where`: a
    tower that knows where its tokens are")."""
    width = model.config.vision.out_hidden_size
    device = next(model.parameters()).device
    side = size // CELL  # merged tokens a side
    shape_probe = torch.nn.Linear(width, len(SHAPES) + 1).to(device)
    color_probe = torch.nn.Linear(width, len(COLORS) + 1).to(device)
    params = [*model.visual.parameters(), *shape_probe.parameters(), *color_probe.parameters()]
    if position:  # made only when used: without them the warm-up draws what it drew before
        row_probe, col_probe = torch.nn.Linear(width, side).to(device), torch.nn.Linear(width, side).to(device)
        params += [*row_probe.parameters(), *col_probe.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=device.type == "cuda")
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps))))
    history: list[dict] = []
    started = time.perf_counter()
    drawn = (sharded(vision_batches_sharded, steps, seed, steps, batch_size, families, size, world, lures,
                     workers=workers)
             if workers else batches(vision_batches, rng, steps, batch_size, families, size, world, lures,
                                     prefetch=prefetch))
    for step, (pixels, grid, shape, color) in enumerate(drawn):
        tokens = model.visual(_queued_to(pixels, device), grid)
        loss = probe_loss(shape_probe, color_probe, tokens, shape, color)  # shape, colour: on the host
        if position:
            loss = loss + position_loss(row_probe, col_probe, tokens, side)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if (step + 1) % log_every == 0 or step == steps - 1:
            shape, color = shape.to(device), color.to(device)
            background = color == 0
            with torch.no_grad():
                shape_acc = (shape_probe(tokens[shape > 0]).argmax(-1) == shape[shape > 0]).float().mean().item()
                color_acc = (color_probe(tokens[~background]).argmax(-1) == color[~background]).float().mean().item()
            record = {"vision_step": step + 1, "loss": round(loss.item(), 4), "token_shape_accuracy": round(shape_acc, 3),
                      "token_color_accuracy": round(color_acc, 3)}
            if position:
                with torch.no_grad():
                    row, col = token_positions(tokens.shape[0], side, device)
                    record["token_row_accuracy"] = round((row_probe(tokens).argmax(-1) == row).float().mean().item(), 3)
                    record["token_col_accuracy"] = round((col_probe(tokens).argmax(-1) == col).float().mean().item(), 3)
            record["seconds"] = round(time.perf_counter() - started, 1)
            history.append(record)
            log(json.dumps(record))
    return history


@contextmanager
def _interrupt_after():
    """Holds a Ctrl-C (SIGINT) or SIGTERM that arrives inside the block until the block has run, then acts on it: an
    optimizer step is applied whole or not at all (a KeyboardInterrupt inside ``AdamW.step`` can leave some
    parameters moved and others not). Then the handler before runs (Python's raises ``KeyboardInterrupt``, as
    ``term_as_interrupt``'s does for SIGTERM; a default SIGTERM is sent again). Outside the main thread, where no
    handler can be set, the block just runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    previous = {number: handler for number, handler in previous.items() if handler is not None}  # set outside Python
    for number in previous:
        signal.signal(number, lambda number, frame: held.append(number))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    for number in dict.fromkeys(held):
        before = previous[number]
        if before is signal.SIG_IGN:
            continue
        if callable(before):  # what the handler before would have done (Python's SIGINT one: raise)
            before(number, None)
        elif number == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            signal.raise_signal(number)


@contextmanager
def term_as_interrupt():
    """SIGTERM ends a training round as Ctrl-C does: the steps taken are kept as OUT-stepN (``train``). ``timeout``
    (whose default signal it is), ``kill``, systemd and container runtimes stop a process with SIGTERM, which would
    otherwise end the round with nothing written. In the main thread, unless SIGTERM is ignored; the handler before
    is put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    if before is signal.SIG_IGN or before is None:
        yield
        return
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # raises KeyboardInterrupt, whichever signal
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def heldout(seed: int, count: int, progress: float = 1.0, curriculum: str = "full",
            families: tuple[str, ...] | None = None, size: int = RESOLUTION[0],
            max_positions: int = MAX_POSITIONS) -> list[Sample]:
    rng = np.random.default_rng((seed, 99))
    return [draw_sample(rng, stage_at(progress, rng, curriculum), max_positions, size=size, families=families)
            for _ in range(count)]


def loss_of(logits: torch.Tensor, batch: Batch, aux_weight: float, no_id: int | None = None,
            hard_negatives: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Answer cross-entropy (answer words and closing tokens) + ``aux_weight`` x the auxiliary one.

    The auxiliary targets are balanced: the few tokens that show an event (colour or shape word) weigh as
    much together as the many background tokens ("no") — averaged over all of them, the event tokens'
    signal was 20x weaker and the vision tower learned shapes far more slowly (measured).

    ``hard_negatives`` in (0, 1]: the background term averages only that share of the background tokens, those the
    model reads least as "no" (online hard example mining, Shrivastava et al. 2016, applied per token): among
    thousands of plain background tokens the few look-alikes — a grey ring on a bright wall read as a white circle
    (issue 27, docs/measurements.md "Where the full cache loses") — are what the question later mistakes for a needle.
        Returns (the loss, the answer term, the auxiliary term), the last two detached 0-dim tensors (0 without
    auxiliary targets): read them (``float``) only when logging, since reading a device tensor waits for the GPU.
    Which rows are auxiliary, shown or background is decided from the batch's host copy (``host_rows``).
    """
    host = _on_host(batch)
    aux = np.array([family == "aux" for family in batch.families], dtype=bool)

    def term(flags: np.ndarray, reduction: str = "mean") -> torch.Tensor:
        rows = host_rows(flags, logits.device)
        return F.cross_entropy(logits[rows].float(), batch.targets[rows], reduction=reduction)

    answer = term(~aux)
    if not aux.any() or aux_weight == 0:
        return answer, answer.detach(), answer.new_zeros(())
    targets = np.asarray(host.targets.cpu())
    background = aux & (targets == no_id) if no_id is not None else np.zeros_like(aux)
    shown = aux & ~background
    parts = [term(flags) for flags in (shown, background) if flags.any()]
    if hard_negatives and background.any():
        parts[-1] = term(background, "none").topk(max(1, math.ceil(hard_negatives * background.sum()))).values.mean()
    auxiliary = parts[0] if len(parts) == 1 else parts[0] + 0.25 * parts[1]
    return answer + aux_weight * auxiliary, answer.detach(), auxiliary.detach()


def train(out_dir: str | Path, steps: int = 4000, seed: int = 0, batch_size: int = 8, lr: float = 3e-3,
          aux_weight: float = 0.5, threads: int | None = None, log: Callable[[str], None] = print,
          log_every: int = 100, eval_samples: int = 64, heldout_streams: int = 200, vision_steps: int = 2000,
          width: int = 64, layers: int = 4, prefetch: bool = True, init: str | Path | None = None,
          curriculum: str = "full", families: tuple[str, ...] | None = None, holdout: tuple[str, ...] | None = None,
          size: int = RESOLUTION[0], freeze_vision: bool = True, vision_width: int = 64, vision_depth: int = 4,
          device: str = "cpu", workers: int = 0, freeze_init_vision: bool = False, grow: int = 0,
          grow_vision: int = 0, recompute: bool = False, grow_width: int = 0, hard_negatives: float = 0.0,
          vision_lr: float = 2e-3, vision_lures: float = 0.0, max_positions: int | None = None,
          save_every: int = 0, attend_weight: float = 0.0, avoid_weight: float = 0.0,
          avoid_layers: tuple[int, ...] = AVOID_LAYERS, avoid_among: str = "all", distill_weight: float = 0.0,
          distill_logits: float = 0.0, distill_layers: tuple[int, ...] = AVOID_LAYERS,
          distill_teacher: str | Path | None = None, rope_theta: float | None = None,
          reshape: tuple[int, int] | None = None) -> dict:
    """Train from scratch — or go on from the toy checkpoint ``init`` (its width and depth are kept; the
    vision warm-up, when ``vision_steps`` > 0, starts from its tower) — and write the checkpoint (fp16) with
    ``card.json``; returns the card.

    ``prefetch`` draws the batches in a spawned worker process (``edgekv.toy.prefetch``): a script that
    calls this needs Python's ``if __name__ == "__main__":`` guard, as for any spawned process.

    ``curriculum`` names the stages drawn from (``edgekv.toy.data.CURRICULA``: ``full`` from scratch,
    ``refine`` for further rounds, ``world`` and ``world-long`` in the randomized world). World samples
    (and the world share of the vision warm-up: the curriculum's largest ``Stage.world``) are drawn on the
    background families ``families`` (default all) less ``holdout`` (default
    ``edgekv.video.world.DEFAULT_HOLDOUT``) that are available here; ``size`` is the frame side (112: 16
    tokens per pair, 224: 64). ``freeze_vision`` keeps the tower as the warm-up left it; ``freeze_init_vision``
    keeps it as ``init`` has it when there is no warm-up (a tower trained apart, e.g. by
    ``tools/toy_tower_probe.py --save``). ``vision_width`` and
    ``vision_depth`` size a new model's vision tower (``toy_config``; a checkpoint given as ``init`` keeps its own).
    ``grow`` and ``grow_vision`` deepen ``init``'s LM and tower by that many layers / blocks before training,
    answering as ``init`` did at step 0 (``edgekv.toy.model.grow_layers``); ``grow_width`` > 0 widens ``init``'s
    LM to that hidden size first (a multiple of its own; ``edgekv.toy.model.grow_width``, the same answers up to
    rounding). ``recompute`` runs each layer
    again in the backward pass instead of keeping its activations (``forward_logits``): the same training in
    less memory, for long contexts. ``hard_negatives`` > 0 averages the auxiliary background term over that share
    of the background tokens, the hardest (``loss_of``). ``vision_lr`` is the warm-up's peak learning rate;
    ``vision_lures`` the share of its world pairs that also show look-alikes (``vision_batch``).
    ``max_positions`` is the range the samples' temporal positions are drawn over, written to the checkpoint as
    its ``max_position_embeddings`` (None: ``init``'s, else ``MAX_POSITIONS``): a full cache whose video spans more
    than it reaches distances the toy never trained on (issue 27: the shipped toy's full cache on 10,000-pair
    streams at 2 fps, 20,000 positions, answers 59 % of the short streams). ``rope_theta`` is the LM's M-RoPE base
    (None: ``init``'s, else the 3B's 1e6); another than ``init``'s re-bases its rotary frequencies before training
    (``edgekv.toy.model.with_rope_theta``: why a toy may want a larger one).

    ``device`` trains on another device than the CPU (``cuda``: the batches are drawn on the host and moved;
    the checkpoint is written from the host). ``workers`` > 0 draws the batches in that many spawned
    processes, step ``i`` by worker ``i mod workers``, each step from its own generators seeded by ``seed``
    and the step (``qa_batches_sharded``): a different draw than the default one stream of ``rng`` (0, as
    every shipped round was trained), the same run for any number of workers — what feeds a GPU, where one
    drawing process is the bottleneck (~0.25 s a world-long batch against milliseconds of model).

    ``save_every`` > 0 also writes the model every that many steps (not the last) beside ``out_dir``, as
    ``OUT_DIR-stepN``, each with the round's card cut at step N (its history and wall time; the command says which
    step, since the schedule and the curriculum's progress are those of the whole round): a round's path can be
    evaluated point by point (issue 27: a third 900-step round from P2 read the 10,000-pair streams worse than P2).

    ``distill_weight`` / ``distill_logits`` > 0 (with ``init``): a frozen copy of ``init`` whose questions do not see
    the lures' tokens in ``distill_layers`` (``forward_logits(hide_lures=...)``) teaches the round —
    ``distill_weight`` x the attention term of ``distill_terms`` in those layers, ``distill_logits`` x its answer
    term — on every batch (issue 27: learning-using-privileged-information, the privilege being where the lures
    are, which the stream at run time does not say). ``distill_teacher``: another toy checkpoint as the teacher
    (the same LM depth and query heads for ``distill_weight``; any toy for ``distill_logits`` alone), e.g. to go on
    from a distilled round with its first teacher.

    ``reshape`` = (heads, kv_heads): ``init``'s LM attention cut into that many heads and made new before training
    (``edgekv.toy.model.reshape_heads``; the rest copied); with ``distill_logits`` the teacher is ``init`` as it
    was (or ``distill_teacher``)."""
    if save_every < 0:
        raise ValueError(f"save_every must be at least 0, got {save_every}")
    if curriculum not in CURRICULA:
        raise ValueError(f"curriculum {curriculum!r} is not one of {', '.join(CURRICULA)}")
    if size % CELL or size < CELL:
        raise ValueError(f"toy frame size must be a multiple of {CELL}, got {size}")
    world_share = max(stage.world for _, stage in CURRICULA[curriculum])
    drawable = None
    if world_share:
        from edgekv.video.world import DEFAULT_HOLDOUT, drawable_families

        holdout = DEFAULT_HOLDOUT if holdout is None else tuple(holdout)
        drawable = drawable_families(tuple(families) if families else None, holdout)
    if workers < 0:
        raise ValueError(f"workers must be at least 0, got {workers}")
    if not 0.0 <= hard_negatives <= 1.0:
        raise ValueError(f"hard_negatives is a share of the background tokens in [0, 1], got {hard_negatives}")
    if attend_weight < 0 or (attend_weight and (recompute or aux_weight <= 0)):
        raise ValueError(f"attend_weight must be >= 0 (got {attend_weight}), and > 0 only with the auxiliary labels "
                         f"(aux_weight > 0) and without recompute")
    if avoid_weight < 0 or (avoid_weight and (recompute or aux_weight <= 0 or not avoid_layers)):
        raise ValueError(f"avoid_weight must be >= 0 (got {avoid_weight}), and > 0 only with the auxiliary labels "
                         f"(aux_weight > 0), without recompute and with at least one layer (got {avoid_layers})")
    if avoid_among not in AVOID_AMONG:
        raise ValueError(f"avoid_among is one of {', '.join(AVOID_AMONG)}, got {avoid_among!r}")
    distill = distill_weight > 0 or distill_logits > 0
    if min(distill_weight, distill_logits) < 0 or (distill and (init is None or recompute or aux_weight <= 0
                                                                  or not distill_layers)) or \
            (distill_teacher is not None and not distill):
        raise ValueError(f"distill_weight and distill_logits must be >= 0 (got {distill_weight}, {distill_logits}), "
                         f"and > 0 only from an init checkpoint (the teacher), with the auxiliary labels "
                         f"(aux_weight > 0), without recompute and with at least one layer (got {distill_layers}); "
                         f"a distill_teacher only with one of them")
    if not 0.0 <= vision_lures <= 1.0:
        raise ValueError(f"vision_lures is a share of the warm-up's world pairs in [0, 1], got {vision_lures}")
    if not vision_lr > 0:
        raise ValueError(f"vision_lr must be > 0, got {vision_lr}")
    if max_positions is not None and max_positions < 1024:
        raise ValueError(f"max_positions must be at least 1024 (a long sample's span), got {max_positions}")
    if rope_theta is not None and not rope_theta > 0:
        raise ValueError(f"rope_theta must be positive, got {rope_theta}")
    if min(grow, grow_vision) < 0 or ((grow or grow_vision) and init is None):
        raise ValueError(f"grow / grow_vision deepen an init checkpoint by at least 0 layers; got {grow} / "
                         f"{grow_vision} with init {init!r}")
    if reshape is not None and (init is None or distill_weight > 0):
        raise ValueError(f"reshape {reshape}: cuts an init checkpoint's attention into new heads (got init {init!r}); "
                         f"its attention is new, so it cannot be distilled head by head (distill_weight)")
    if grow_width < 0 or (grow_width and init is None):
        raise ValueError(f"grow_width widens an init checkpoint to a hidden size > 0; got {grow_width} with init "
                         f"{init!r}")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: torch finds no CUDA GPU here")
    if threads is not None:
        from edgekv.threads import apply_threads

        apply_threads(threads)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    encoder = Encoder(aux=aux_weight > 0, seed=seed, size=size)
    if init is not None:
        model, width, layers = _from_checkpoint(init)
        if grow or grow_vision:
            from edgekv.toy.model import grow_layers

            model, layers = grow_layers(model, grow, vision=grow_vision), layers + grow
        if grow_width and grow_width != width:
            from edgekv.toy.model import grow_width as widen

            model, width = widen(model, grow_width, seed=seed), grow_width
        teacher_before_reshape = None
        if reshape is not None:
            from edgekv.toy.model import reshape_heads

            if distill and distill_teacher is None:  # the teacher: init as it was, before its attention is new
                teacher_before_reshape = copy.deepcopy(model)
            model = reshape_heads(model, *reshape, seed=seed)
        for param in model.parameters():
            param.requires_grad_(True)
        vision_width, vision_depth = model.config.vision.hidden_size, model.config.vision.depth
        if max_positions is not None and max_positions != model.config.text.max_position_embeddings:
            set_max_positions(model, max_positions)
        if rope_theta is not None and rope_theta != model.config.text.rope_theta:
            set_rope_theta(model, rope_theta)
    else:
        model = init_model(toy_config(width=width, layers=layers, vision_width=vision_width,
                                      vision_depth=vision_depth, max_positions=max_positions or MAX_POSITIONS,
                                      rope_theta=rope_theta or ROPE_THETA), seed)
    positions = int(model.config.text.max_position_embeddings)
    if attend_weight and len(model.language.layers) <= ATTEND_LAYER:
        raise ValueError(f"attend_weight steers LM layer {ATTEND_LAYER}'s attention: the model has "
                         f"{len(model.language.layers)} layer(s)")
    if avoid_weight and not all(0 <= layer < len(model.language.layers) for layer in avoid_layers):
        raise ValueError(f"avoid_layers {avoid_layers}: the model's LM has layers 0-{len(model.language.layers) - 1}")
    if distill and not all(0 <= layer < len(model.language.layers) for layer in distill_layers):
        raise ValueError(f"distill_layers {distill_layers}: the model's LM has layers "
                         f"0-{len(model.language.layers) - 1}")
    teacher = None
    if distill and init is not None and reshape is not None and distill_teacher is None:
        teacher = teacher_before_reshape.to(device).eval().requires_grad_(False)
    elif distill and distill_teacher is not None:
        teacher = _from_checkpoint(distill_teacher)[0]
        shapes = [(len(m.language.layers), m.config.text.num_attention_heads) for m in (model, teacher)]
        if distill_weight > 0 and shapes[0] != shapes[1]:
            raise ValueError(f"distill_teacher {distill_teacher}: its LM has {shapes[1][0]} layers of "
                             f"{shapes[1][1]} query heads, the student {shapes[0][0]} of {shapes[0][1]}")
        teacher = teacher.to(device).eval().requires_grad_(False)
    elif distill:  # init as loaded (grown / widened alike), frozen: it answers with the lures hidden
        teacher = copy.deepcopy(model).to(device).eval().requires_grad_(False)
    model.to(device).train()
    started = time.perf_counter()
    vision_history = (warm_up_vision(model, vision_steps, rng, lr=vision_lr, log=log, log_every=log_every,
                                     prefetch=prefetch, families=drawable, size=size, world=world_share,
                                     workers=workers, seed=seed, lures=vision_lures)
                      if vision_steps else [])
    if (vision_steps and freeze_vision) or (not vision_steps and freeze_init_vision):
        # The warmed-up tower stays as it is (a pre-trained ViT's role): trained on by the answers' noisy
        # early gradients it lost its shape features, and frozen its backward pass is saved (1.5x faster).
        model.visual.requires_grad_(False)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trainable if p.dim() >= 2]
    other = [p for n, p in trainable if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.98), fused=device.type == "cuda")  # one kernel a step
    warmup = max(1, min(200, steps // 20))

    def rate(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    held_samples = heldout(seed, eval_samples, curriculum=curriculum, families=drawable, size=size,
                           max_positions=positions)
    held_encoder = Encoder(size=size)
    held = [held_encoder.encode(held_samples[i:i + HELD_CHUNK]).to(device)
            for i in range(0, len(held_samples), HELD_CHUNK)]
    history: list[dict] = []
    snapshots: list[tuple[Path, int, int, float]] = []  # directory, step, history records then, seconds
    # Running means of the loss terms, kept on the device (read on log steps only: ``loss_of``'s note), exponential
    # with 0.98 from the first value on.
    running = attend_running = avoid_running = distill_running = None

    def ema(mean: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
        return value if mean is None else 0.98 * mean + 0.02 * value
    marks = avoid_weight > 0 or distill  # the lures' tokens, drawn only for a round that reads them
    drawn = (sharded(qa_batches_sharded, steps, seed, steps, batch_size, aux_weight > 0, curriculum, drawable, size,
                     positions, marks, workers=workers)
             if workers else batches(qa_batches, rng, steps, batch_size, aux_weight > 0, seed, curriculum, drawable,
                                     size, positions, marks, prefetch=prefetch))
    applied, interrupted = 0, False  # optimizer steps taken; Ctrl-C keeps them as a snapshot (below)
    try:
        for step, batch in enumerate(drawn):
            batch = batch.to(device)
            progress = step / max(1, steps)
            steered: list | None = [] if attend_weight else None
            avoided: list | None = [] if avoid_weight else None
            looked: dict | None = {} if distill_weight else None
            logits = forward_logits(model, batch, recompute, steered, avoided, avoid_layers, avoid_among,
                                    looks=looked, look_layers=distill_layers)
            loss, answer_loss, aux_loss = loss_of(logits, batch, aux_weight, encoder.no, hard_negatives)
            if teacher is not None:
                taught: dict = {}
                with torch.no_grad():
                    teacher_logits = forward_logits(teacher, batch, hide_lures=distill_layers,
                                                    looks=taught if distill_weight else None,
                                                    look_layers=distill_layers)
                attention_term, answers_term = distill_terms(looked or {}, taught, logits, teacher_logits, batch)
                loss = loss + distill_weight * attention_term + distill_logits * answers_term
                distill_running = ema(distill_running, torch.stack([attention_term, answers_term]).detach())
            if steered:
                loss = loss + attend_weight * steered[0]
                attend_running = ema(attend_running, steered[0].detach())
            if avoided:  # a batch without lures on screen adds nothing
                avoid_term = torch.stack(avoided).mean()
                loss = loss + avoid_weight * avoid_term
                avoid_running = ema(avoid_running, avoid_term.detach())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(decay + other, 1.0)
            with _interrupt_after():  # Ctrl-C here waits for the step: a snapshot never holds part of one
                optimizer.step()
                scheduler.step()
                applied = step + 1
            running = ema(running, torch.stack([answer_loss, aux_loss]))
            if (step + 1) % log_every == 0 or step == steps - 1:
                answer_running, aux_running = running.tolist()  # the step's one wait for the GPU, on log steps only
                record = {"step": step + 1, "loss": round(answer_running, 4), "aux_loss": round(aux_running, 4),
                          "seconds": round(time.perf_counter() - started, 1),
                          "stage": stage_at(progress, np.random.default_rng(0), curriculum).name,
                          "load_average": round(os.getloadavg()[0], 2)}
                if attend_weight:
                    record["attend_loss"] = round(float(attend_running if attend_running is not None else 0.0), 4)
                if avoid_weight:
                    record["avoid_loss"] = round(float(avoid_running if avoid_running is not None else 0.0), 4)
                if distill:
                    both = distill_running.tolist() if distill_running is not None else [0.0, 0.0]
                    record["distill_attention"], record["distill_answers"] = round(both[0], 4), round(both[1], 4)
                record["heldout"] = evaluate(model, held)
                history.append(record)
                log(json.dumps(record))
            if save_every and (step + 1) % save_every == 0 and step + 1 < steps:
                snapshot = Path(f"{out_dir}-step{step + 1}")
                save_checkpoint(model, snapshot, {"snapshot_step": step + 1, "steps_planned": steps},
                                resolution=(size, size))
                snapshots.append((snapshot, step + 1, len(history), round(time.perf_counter() - started, 1)))
                log(json.dumps({"snapshot": str(snapshot), "step": step + 1}))
    except KeyboardInterrupt:
        if not applied:
            raise
        interrupted = True
    wall = time.perf_counter() - started
    model.cpu().eval()
    command = f"edgekv train-toy {out_dir} --steps {steps} --seed {seed}"
    if batch_size != 8 or lr != 3e-3 or vision_steps != 2000:
        command += f" --batch-size {batch_size} --lr {lr} --vision-steps {vision_steps}"
    if init is not None:
        command += f" --init {init}"
    if grow:
        command += f" --grow-layers {grow}"
    if grow_vision:
        command += f" --grow-vision {grow_vision}"
    if grow_width:
        command += f" --grow-width {grow_width}"
    if curriculum != "full":
        command += f" --curriculum {curriculum}"
    if init is None and (width != 64 or layers != 4):
        command += f" --width {width} --layers {layers}"
    if init is None and (vision_width != 64 or vision_depth != 4):
        command += f" --vision-width {vision_width} --vision-depth {vision_depth}"
    if drawable is not None:
        command += f" --families {','.join(families) if families else 'all'} --holdout {','.join(holdout) or 'none'}"
    if size != RESOLUTION[0]:
        command += f" --size {size}"
    if vision_steps and not freeze_vision:
        command += " --train-vision"
    if not vision_steps and freeze_init_vision:
        command += " --freeze-vision"
    if hard_negatives:
        command += f" --hard-negatives {hard_negatives:g}"
    if attend_weight:
        command += f" --attend-weight {attend_weight:g}"
    if avoid_weight:
        command += f" --avoid-weight {avoid_weight:g}"
        if tuple(avoid_layers) != AVOID_LAYERS:
            command += f" --avoid-layers {','.join(str(layer) for layer in avoid_layers)}"
        if avoid_among != "all":
            command += f" --avoid-among {avoid_among}"
    if distill_weight:
        command += f" --distill-weight {distill_weight:g}"
    if distill_logits:
        command += f" --distill-logits {distill_logits:g}"
    if distill and tuple(distill_layers) != AVOID_LAYERS:
        command += f" --distill-layers {','.join(str(layer) for layer in distill_layers)}"
    if distill_teacher is not None:
        command += f" --distill-teacher {distill_teacher}"
    if max_positions is not None:
        command += f" --max-positions {max_positions}"
    if rope_theta is not None:
        command += f" --rope-theta {rope_theta:g}"
    if reshape is not None:
        command += f" --reshape-heads {reshape[0]}:{reshape[1]}"
    if vision_steps and vision_lr != 2e-3:
        command += f" --vision-lr {vision_lr:g}"
    if vision_steps and vision_lures:
        command += f" --vision-lures {vision_lures:g}"
    if recompute:
        command += " --recompute"  # memory, not the recipe: the same gradients
    if workers:
        command += f" --workers {workers}"  # the draw (sharded); the device is not part of the run's recipe
    card = {"command": command, "seed": seed, "steps": steps, "vision_steps": vision_steps,
            "vision_history": vision_history, "vision_frozen_after_warm_up": bool(vision_steps) and freeze_vision,
            "vision_frozen": not any(p.requires_grad for p in model.visual.parameters()),
            "batch_size": batch_size, "lr": lr, "aux_weight": aux_weight, "curriculum": curriculum,
            "init": None if init is None else str(init), "grown_layers": grow, "grown_vision_blocks": grow_vision,
            "grown_width": grow_width or None, "hard_negatives": hard_negatives or None,
            "rope_theta": float(model.config.text.rope_theta),
            "heads": model.config.text.num_attention_heads, "kv_heads": model.config.text.num_key_value_heads,
            "reshaped_heads": list(reshape) if reshape is not None else None,
            "attend_weight": attend_weight or None,
            "avoid_weight": avoid_weight or None, "avoid_layers": list(avoid_layers) if avoid_weight else None,
            "avoid_among": avoid_among if avoid_weight else None,
            "distill_weight": distill_weight or None, "distill_logits": distill_logits or None,
            "distill_layers": list(distill_layers) if distill else None,
            "distill_teacher": None if distill_teacher is None else str(distill_teacher),
            "vision_lr": vision_lr if vision_steps else None, "vision_lures": vision_lures or None,
            "width": width, "layers": layers,
            "vision_width": vision_width, "vision_depth": vision_depth, "prefetch": prefetch, "workers": workers,
            "recompute": recompute,
            "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "wall_time_s": round(wall, 1), "threads": torch.get_num_threads(),
            "machine": _machine(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__, "parameters": sum(p.numel() for p in model.parameters()),
            "history": history, "fps": 2.0, "resolution": [size, size], "max_position_embeddings": positions,
            "world": None if drawable is None else {"families": list(drawable), "holdout": list(holdout)}}
    if init is not None:
        card["parent"] = _lineage(init)
    for snapshot, at, logged, seconds in snapshots:
        write_model_card(snapshot, {**card, "command": f"{command}  # its step {at} of {steps}", "steps": at,
                                    "snapshot_step": at, "history": history[:logged], "wall_time_s": seconds})
    if interrupted:  # Ctrl-C: the steps taken are kept as OUT-stepN, as --save-every writes; OUT itself is not
        snapshot = Path(f"{out_dir}-step{applied}")
        save_checkpoint(model, snapshot, {**card, "command": f"{command}  # its step {applied} of {steps}, "
                                          "interrupted", "steps": applied, "snapshot_step": applied,
                                          "interrupted": True}, resolution=(size, size))
        log(json.dumps({"snapshot": str(snapshot), "step": applied, "interrupted": True}))
        raise KeyboardInterrupt
    save_checkpoint(model, out_dir, card, resolution=(size, size))
    if heldout_streams:
        from edgekv.eval.toy_accuracy import evaluate as heldout_accuracy

        card["heldout_accuracy"] = heldout_accuracy(str(out_dir), heldout_streams)
        log(json.dumps({"heldout_accuracy": card["heldout_accuracy"]["accuracy"]}))
    write_model_card(out_dir, card)
    return card


def _lineage(path: str | Path) -> dict | None:
    """What the checkpoint at ``path`` was trained from (its card's command, steps, wall time, held-out accuracy
    and note, and its own parent; the checkpoints it is the mean of, if ``edgekv average-toy`` made it), so a model
    trained in rounds keeps the whole recipe in its card."""
    card_path = Path(path) / "card.json"
    if not card_path.is_file():
        return None
    parent = json.loads(card_path.read_text())
    kept = {key: parent[key] for key in ("command", "seed", "steps", "vision_steps", "lr", "wall_time_s", "note", "parent",
                                         "averaged", "weights")
            if key in parent}
    if "heldout_accuracy" in parent:
        kept["heldout_accuracy"] = parent["heldout_accuracy"].get("accuracy")
    return kept


def _from_checkpoint(path: str | Path):
    """The toy checkpoint at ``path`` as a trainable fp32 model, with its LM width and depth; a directory
    that is not a toy of today's vocabulary (any LM and tower width and depth ``toy_config`` makes) is refused
    with what differs."""
    from edgekv.model.loading import load_pretrained

    model = load_pretrained(path, dtype=torch.float32)
    text, vision = model.config.text, model.config.vision
    sizes = dict(width=text.hidden_size, layers=text.num_hidden_layers, vision_width=vision.hidden_size,
                 vision_depth=vision.depth, max_positions=text.max_position_embeddings, rope_theta=text.rope_theta,
                 heads=text.num_attention_heads, kv_heads=text.num_key_value_heads)
    try:
        expected = toy_config(**sizes)
    except ValueError:
        expected = None
    if expected is None or model.config != expected:
        raise ValueError(f"{path}: not a toy checkpoint of this version (its config differs from "
                         f"toy_config({', '.join(f'{k}={v}' for k, v in sizes.items())}))")
    for param in model.parameters():
        param.requires_grad_(True)
    return model, text.hidden_size, text.num_hidden_layers


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} x {cpu}"


# Held-out samples scored a few at a time: a batch's attention mask is [streams, S, S] floats, and the last
# stage's 64 samples in one batch of 6,000-token contexts took 10 GB (what killed world-mild-224-long's first runs).
HELD_CHUNK = 4


@torch.no_grad()
def evaluate(model, batches: Batch | list[Batch]) -> dict[str, float]:
    """Teacher-forced accuracy of the answer words per question family, over one batch or several."""
    was_training = model.training
    model.eval()
    counts: dict[str, list[int]] = {}
    try:
        for batch in [batches] if isinstance(batches, Batch) else batches:
            for family, (right, total) in accuracy_by_family(forward_logits(model, batch), batch).items():
                slot = counts.setdefault(family, [0, 0])
                slot[0] += right
                slot[1] += total
    finally:
        model.train(was_training)
    return {family: round(counts[family][0] / counts[family][1], 3) for family in ALL_FAMILIES if family in counts}
