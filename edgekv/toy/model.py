"""The toy Qwen2.5-VL: the real architecture at a size that trains on two CPU cores, and its checkpoint.

Shape (``TOY_SHAPE``): ViT depth 4 (blocks 1 and 3 full attention, 0 and 2 windowed; 112 px windows),
hidden 64, 4 heads, 2x2 merger; Qwen2 LM with 4 layers, hidden 64, 4 query heads on 2 KV heads (GQA),
head_dim 16, M-RoPE sections (2, 3, 3), tied embeddings, a 64-entry word vocabulary. About 0.5 M
parameters: 1 MB in fp16.

``max_position_embeddings = 8192``. Nothing in the model is a learned position table, so the number
only matters through the session's re-basing mark (half of it, 4096): positions of kept frames are
squeezed when they pass it, and a cache of C slots then spans at most ``C * G`` positions
(``G`` = one pair's spacing). Training draws temporal positions uniformly over the whole 0..8192, so
every position a capped cache produces below the mark, and the overshoot of up to ``C * G`` after it at
the budgets the benchmarks use (C <= 3,000 slots at G = 2 is 6,000 positions), is in distribution.
A smaller value would re-base more often (each compaction once positions pass it); a larger one would
need more training to cover. A full cache is never re-based: its video spans ``pairs * G`` positions, past
8,192 on a stream of more than 4,096 pairs at 2 fps: the shipped toy's full cache answers 0.87 asked within
3,000 pairs, 0.30 after 9,000 (issue 27; a round trained over 0..32,768 takes the 10,000-pair streams from 59 %
to 76 % of short: docs/measurements.md, "Why the full cache fails at 10,000 pairs"). ``train-toy --max-positions N``
trains over 0..N and writes N here.

The checkpoint directory is what a released Qwen2.5-VL directory holds (``config.json`` in the released
layout, ``model.safetensors`` with the released tensor names and the 5D patch-embedding kernel,
``generation_config.json``, ``preprocessor_config.json``, tokenizer files with the chat template), so
transformers' ``Qwen2_5_VLForConditionalGeneration`` loads it too.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from edgekv.model.config import ModelConfig, TextConfig, VisionConfig
from edgekv.model.loading import (SINGLE_FILE, checkpoint_shapes, module_key_to_checkpoint,
                                  remove_weight_files)
from edgekv.model.qwen25vl import Qwen25VL
from edgekv.model.tiny import PREPROCESSOR_CONFIG, QWEN25VL_CHAT_TEMPLATE
from edgekv.toy.vocab import build_tokenizer, write_tokenizer_files

MAX_POSITIONS = 8192
ROPE_THETA = 1_000_000.0  # the 3B's M-RoPE base
RESOLUTION = (112, 112)  # 8 x 8 patches, 4 x 4 = 16 LLM tokens per frame pair


def toy_config(vocab_pad: int = 64, width: int = 64, layers: int = 4, vision_width: int = 64,
               vision_depth: int = 4, max_positions: int = MAX_POSITIONS,
               rope_theta: float = ROPE_THETA, heads: int = 4, kv_heads: int = 2) -> ModelConfig:
    """The toy's configuration; ``width`` is the LM's hidden size (``heads`` query heads of ``width / heads`` on
    ``kv_heads`` KV heads — 4 on 2 unless ``reshape_heads`` made others — M-RoPE sections scaled as the 3B's (16, 24,
    24) are to its head_dim 128, MLP 2.75x), ``layers`` its depth. The vision tower is ``vision_depth`` blocks of ``vision_width`` (4 heads, MLP 2x; full
    attention in every second block, windowed in the others, as the 3B's tower alternates them in its
    own proportion); its merger projects to ``width``. ``max_positions`` is the temporal range its training
    drew positions over (``max_position_embeddings``), ``rope_theta`` its M-RoPE base (``with_rope_theta``). The
    shipped toy: 64 / 4 and 64 / 4, 8,192, 1e6."""
    if width % 16 or width < 32:
        raise ValueError(f"toy LM width must be a multiple of 16 and at least 32, got {width}")
    if heads < 1 or kv_heads < 1 or heads % kv_heads or width % heads or (width // heads) % 4:
        raise ValueError(f"toy LM heads: {heads} query heads on {kv_heads} KV heads must divide evenly, and width "
                         f"{width} into heads of a multiple of 4 dimensions")
    if vision_width % 16 or vision_width < 32 or vision_depth < 1:
        raise ValueError(f"toy vision width must be a multiple of 16 and at least 32, and its depth at least 1; "
                         f"got {vision_width} / {vision_depth}")
    tokenizer, special = build_tokenizer()
    vocab_size = -(-tokenizer.get_vocab_size() // vocab_pad) * vocab_pad
    head_dim = width // heads
    half = head_dim // 2
    section = (half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8)
    text = TextConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=int(width * 2.75),
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim,
                      mrope_section=section, max_position_embeddings=max_positions, tie_word_embeddings=True,
                      rms_norm_eps=1e-6, rope_theta=float(rope_theta))
    vision = VisionConfig(depth=vision_depth, hidden_size=vision_width, intermediate_size=2 * vision_width, num_heads=4,
                          fullatt_block_indexes=tuple(range(1, vision_depth, 2)),
                          out_hidden_size=width, window_size=112, tokens_per_second=2)
    return ModelConfig(text=text, vision=vision, image_token_id=special["<|image_pad|>"],
                       video_token_id=special["<|video_pad|>"], vision_start_token_id=special["<|vision_start|>"],
                       vision_end_token_id=special["<|vision_end|>"],
                       eos_token_ids=(special["<|im_end|>"], special["<|endoftext|>"]),
                       bos_token_id=special["<|endoftext|>"])


def init_model(config: ModelConfig, seed: int) -> Qwen25VL:
    """A trainable fp32 model: matrices ~ N(0, 0.02), biases 0, norm scales 1 (transformers' init)."""
    generator = torch.Generator().manual_seed(seed)
    model = Qwen25VL(config)
    for name, param in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def grow_layers(model: Qwen25VL, count: int, vision: int = 0) -> Qwen25VL:
    """``model`` with ``count`` more LM decoder layers and ``vision`` more tower blocks, computing exactly what it
    computed: each new layer is a copy of a trained one whose two residual branches start at zero (the LM's
    ``o_proj`` and ``down_proj``, the tower's ``attn.proj`` and ``mlp.down_proj``), so the residual stream
    passes through it unchanged until training moves those matrices — the zero-initialised residual branch of
    Goyal et al. 2017 / Fixup, used here to deepen a trained toy instead of training a deeper one from scratch.
    New LM layers are copies of the layer below them, spread evenly through the stack (4 + 2: after layers 0
    and 2). New tower blocks go after the last one, before the merger, each a copy of the last old block of its
    attention kind: ``toy_config`` makes every second block full attention, so appending keeps every old block's
    kind. The rest is copied; the result is fp32 on the CPU."""
    if count < 0 or vision < 0:
        raise ValueError(f"grow_layers: count and vision must be at least 0, got {count} and {vision}")
    text = model.config.text
    old, old_blocks = text.num_hidden_layers, model.config.vision.depth
    config = toy_config(width=text.hidden_size, layers=old + count, vision_width=model.config.vision.hidden_size,
                        vision_depth=old_blocks + vision, max_positions=text.max_position_embeddings,
                        rope_theta=text.rope_theta, heads=text.num_attention_heads,
                        kv_heads=text.num_key_value_heads)
    after = [0] * old
    for k in range(count):
        after[min(old - 1, max(0, round((k + 1) * old / (count + 1)) - 1))] += 1
    order: list[tuple[int, bool]] = []  # (source layer, new?)
    for index in range(old):
        order.append((index, False))
        order.extend((index, True) for _ in range(after[index]))
    grown = Qwen25VL(config)
    state = {name: value.detach().float().cpu() for name, value in model.state_dict().items()}
    new_state = {name: value.clone() for name, value in state.items()
                 if not name.startswith(("language.layers.", "visual.blocks."))}

    def copy(source: str, target: str, zeroed: tuple[str, ...]) -> None:
        for name, value in state.items():
            if name.startswith(source):
                rest = name[len(source):]
                new_state[target + rest] = torch.zeros_like(value) if rest.startswith(zeroed) else value.clone()

    full = set(config.vision.fullatt_block_indexes)
    for target in range(old_blocks + vision):
        same = [b for b in range(old_blocks) if (b in full) == (target in full)]
        source = target if target < old_blocks else (same[-1] if same else old_blocks - 1)
        copy(f"visual.blocks.{source}.", f"visual.blocks.{target}.",
             ("attn.proj.", "mlp.down_proj.") if target >= old_blocks else ())
    for target, (source, fresh) in enumerate(order):  # the LM's o_proj and down_proj have no bias
        copy(f"language.layers.{source}.", f"language.layers.{target}.",
             ("self_attn.o_proj.", "mlp.down_proj.") if fresh else ())
    grown.load_state_dict(new_state, strict=True)
    return grown.float()


class WidthError(ValueError):
    """A width ``grow_width`` cannot widen a checkpoint to (and why)."""


def grow_width(model: Qwen25VL, width: int, seed: int = 0) -> Qwen25VL:
    """``model`` with its LM ``width`` wide (an integer multiple ``m`` of today's hidden size; head_dim, MLP and
    M-RoPE sections grow with it as ``toy_config`` makes them), computing what it computed up to rounding — the
    function-preserving widening of Net2Net (Chen et al. 2016, sec. 2), done here with zeros instead of copies:

    * the residual stream's new dimensions start at zero and stay zero at step 0: every matrix that writes to it
      (the embedding, the merger's output, ``o_proj``, ``down_proj``) gets zero rows there; every matrix that
      reads it gets small random columns there (they read zeros, and give the new dimensions a gradient);
    * RMSNorm averages over ``m`` times the dimensions, so each norm's old scales are divided by sqrt(m);
    * rotary pair ``j`` of a head (frequency theta^(-2j/d)) becomes pair ``m j`` of the wider head (theta^(-2mj/(md)),
      the same frequency, in the same M-RoPE section since ``toy_config``'s sections scale by ``m`` too); the
      query's old dimensions are multiplied by sqrt(m), so that q.k / sqrt(m d) is the old q.k / sqrt(d); the
      query's new dimensions start at zero (the key's are random), so they add nothing yet and still train;
    * new value dimensions and new MLP units are read out through zero columns of ``o_proj`` / ``down_proj``.

    The vision tower is unchanged. The result is fp32 on the CPU; ``seed`` draws the new random columns.
    Measured (issue 27): D3 widened to 128 answered all 59 questions of a 2,000-pair 224 x 224 needle stream as D3;
    one training round after it read the long streams worse than D3 (docs/measurements.md, "A wider toy")."""
    text = model.config.text
    old = text.hidden_size
    if width < old or width % old:
        raise WidthError(f"grow_width: the new width must be a multiple of the old one ({old}), got {width}")
    m = width // old
    config = toy_config(width=width, layers=text.num_hidden_layers, vision_width=model.config.vision.hidden_size,
                        vision_depth=model.config.vision.depth, max_positions=text.max_position_embeddings,
                        rope_theta=text.rope_theta, heads=text.num_attention_heads,
                        kv_heads=text.num_key_value_heads)
    new_text = config.text
    grown = Qwen25VL(config)
    if m == 1:
        grown.load_state_dict(model.state_dict(), strict=True)
        return grown.float()
    generator = torch.Generator().manual_seed(seed)
    state = {name: value.detach().float().cpu() for name, value in model.state_dict().items()}
    target = {name: value.detach().float() for name, value in grown.state_dict().items()}
    d, d_new = text.head_dim, new_text.head_dim
    half, half_new = d // 2, d_new // 2
    # old head dimension i -> new one: rotate_half pairs (j, j + half) -> (m j, half_new + m j)
    within = torch.tensor([m * i if i < half else half_new + m * (i - half) for i in range(d)])
    from edgekv.model.rope import mrope_dim_rows

    rows_old, rows_new = mrope_dim_rows(text.mrope_section), mrope_dim_rows(new_text.mrope_section)
    if not torch.equal(rows_new[within[:half]], rows_old):  # toy_config's sections round: 32 -> 64 does not map
        raise WidthError(f"grow_width: M-RoPE sections {list(text.mrope_section)} of width {old} do not map onto "
                         f"{list(new_text.mrope_section)} of width {width} (pair j -> {m} j changes section)")
    inter = text.intermediate_size

    def random(shape) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * 0.02

    def heads(count: int) -> torch.Tensor:  # old row index -> new row index, over ``count`` heads
        return torch.cat([h * d_new + within for h in range(count)])

    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        shape = target[name].shape
        if not name.startswith(("language.", "visual.merger.mlp.2.")):
            out[name] = value  # the tower and the merger's inside: unchanged
            continue
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            new = torch.full(shape, 1.0 / math.sqrt(m))
            new[:old] = value / math.sqrt(m)
        elif name in ("language.embed_tokens.weight", "language.lm_head.weight"):  # [vocab, hidden], tied
            new = torch.zeros(shape)  # writes to the residual stream (and reads it, as the head): new columns zero
            new[:, :old] = value
        elif name.startswith("visual.merger.mlp.2."):  # [hidden, 4 x tower] and [hidden]: writes the stream
            new = torch.zeros(shape)
            new[:old] = value
        elif ".self_attn." in name:
            kind = name.split(".self_attn.")[1].split(".")[0]
            count = text.num_attention_heads if kind in ("q_proj", "o_proj") else text.num_key_value_heads
            rows = heads(count)
            if kind == "o_proj":  # [hidden, heads * d]: reads attention outputs, writes the residual stream
                new = torch.zeros(shape)
                new[:old, rows] = value
            elif name.endswith(".bias"):
                new = torch.zeros(shape)
                new[rows] = value * (math.sqrt(m) if kind == "q_proj" else 1.0)
            else:  # [heads * d, hidden]: the query's new head dimensions zero, the key's and value's random
                new = torch.zeros(shape) if kind == "q_proj" else random(shape)
                new[rows, :old] = value * (math.sqrt(m) if kind == "q_proj" else 1.0)
                new[rows, old:] = random((len(rows), width - old))
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):  # [inter, hidden]
            new = random(shape)
            new[:inter, :old] = value
        elif name.endswith("down_proj.weight"):  # [hidden, inter]
            new = torch.zeros(shape)
            new[:old, :inter] = value
        else:
            raise ValueError(f"grow_width: no rule for {name} {tuple(value.shape)}")
        assert new.shape == shape, (name, new.shape, shape)
        out[name] = new
    grown.load_state_dict(out, strict=True)
    return grown.float()


def reshape_heads(model: Qwen25VL, heads: int, kv_heads: int, seed: int = 0) -> Qwen25VL:
    """``model`` with its LM's attention cut into ``heads`` query heads on ``kv_heads`` KV heads (head_dim ``width /
    heads``, M-RoPE sections as ``toy_config`` scales them), the attention itself new: query, key and value
    projections drawn N(0, 0.02) (``seed``), ``o_proj`` zero, so that at step 0 the residual stream carries no
    attention and each layer's attention enters as training writes ``o_proj`` (the zero-initialised residual branch
    of ``grow_layers``). Everything else — embeddings, norms, MLPs, the tower, the merger — is copied.

    Why (issue 27, docs/measurements.md "Six of sixteen"): a question matches a video token across a long stream
    only through the rotary pairs that turn less than a radian or two over the toy's positions — at head_dim 16 and
    base 1e6 three pairs (6 of 16 dimensions) of each head; rotary pairs grown into a trained head were never taken
    up. Fewer, wider heads have that room from the first step (head_dim 32: 6 slow pairs; 64: 12), the 3B's
    proportion. The result is fp32 on the CPU."""
    text = model.config.text
    config = toy_config(width=text.hidden_size, layers=text.num_hidden_layers,
                        vision_width=model.config.vision.hidden_size, vision_depth=model.config.vision.depth,
                        max_positions=text.max_position_embeddings, rope_theta=text.rope_theta, heads=heads,
                        kv_heads=kv_heads)
    reshaped = Qwen25VL(config)
    generator = torch.Generator().manual_seed(seed)
    target = reshaped.state_dict()
    out = {}
    for name, value in model.state_dict().items():
        if ".self_attn." not in name:
            out[name] = value.detach().float().cpu()
            continue
        shape = target[name].shape
        if ".o_proj." in name or name.endswith(".bias"):
            out[name] = torch.zeros(shape)
        else:
            out[name] = torch.randn(shape, generator=generator) * 0.02
    missing = sorted(set(target) - set(out))
    if missing:
        raise ValueError(f"reshape_heads: no weights for {missing[:3]}")
    reshaped.load_state_dict(out, strict=True)
    return reshaped.float()


def with_max_positions(config: ModelConfig, positions: int) -> ModelConfig:
    """``config`` with ``positions`` as its ``max_position_embeddings``: the temporal range a toy's training drew
    positions over (``train-toy --max-positions``). It has no weights (M-RoPE is computed, not learned), so toys
    that differ only there are of one shape."""
    return replace(config, text=replace(config.text, max_position_embeddings=positions))


def set_max_positions(model: Qwen25VL, positions: int) -> Qwen25VL:
    """Give ``model`` (and its language model) the temporal range ``positions`` (``with_max_positions``)."""
    model.config = with_max_positions(model.config, positions)
    model.language.config = model.config.text
    return model


def with_rope_theta(config: ModelConfig, theta: float) -> ModelConfig:
    """``config`` with ``theta`` as its M-RoPE base (``train-toy --rope-theta``). Like the temporal range it has no
    weights: only the rotary frequencies theta^(-2i/head_dim) change. Why a toy may want another base than the 3B's
    1e6 (issue 27): a rotary pair can match content across a long stream only where it turns little (a radian or
    two) over the positions trained on; over 8,192 at 1e6 that is the last 3/8 of a head's pairs, its ``w`` section:
    24 of the 3B's 64 (head_dim 128) but 3 of the toy's 8 (head_dim 16). A larger base moves more pairs there
    (``tools/toy_lure_attention.py --by-pair`` shows which pairs a toy's questions use)."""
    if not theta > 0:
        raise ValueError(f"rope_theta must be positive, got {theta!r}")
    return replace(config, text=replace(config.text, rope_theta=float(theta)))


def set_rope_theta(model: Qwen25VL, theta: float) -> Qwen25VL:
    """Give ``model`` (and its language model's rotary frequencies) the M-RoPE base ``theta``."""
    from edgekv.model.rope import rotary_inv_freq

    model.config = with_rope_theta(model.config, theta)
    model.language.config = model.config.text
    model.language._inv_freq = rotary_inv_freq(model.config.text.head_dim, float(theta), device="cpu")
    return model


def save_checkpoint(model: Qwen25VL, out_dir: str | Path, card: dict, dtype: torch.dtype = torch.float16,
                    resolution: tuple[int, int] = RESOLUTION) -> Path:
    """Write ``model`` as a released-layout checkpoint directory with the toy tokenizer and a model card."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    shapes = checkpoint_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        key = module_key_to_checkpoint(name)
        tensors[key] = param.detach().to(dtype).reshape(shapes[key]).contiguous()
    remove_weight_files(out)  # an earlier checkpoint's shards and index would be read instead
    save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    hf = config.to_hf_dict()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    hf["edgekv_toy"] = {"resolution": list(resolution), "fps": card.get("fps", 2.0)}
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    eos = list(config.eos_token_ids)
    generation = {"bos_token_id": config.bos_token_id, "pad_token_id": eos[-1], "eos_token_id": eos,
                  "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    write_tokenizer_files(out, QWEN25VL_CHAT_TEMPLATE, config.text.max_position_embeddings)
    (out / "card.json").write_text(json.dumps(card, indent=2))
    for path in out.iterdir():
        path.chmod(0o644)
    return out
