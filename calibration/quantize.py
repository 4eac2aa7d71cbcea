"""``edgekv quantize IN_DIR OUT_DIR``: a checkpoint's decoder-layer linears to 4 bits, in the AutoAWQ GEMM layout.

Round-to-nearest with a zero point, per group of ``g`` input features and per output feature — the
asymmetric min-max quantizer of AWQ's ``pseudo_quantize_tensor`` (Lin et al. 2024, section 4; AutoAWQ
``awq/quantize/quantizer.py``), with the range widened to contain 0 as GPTQ's quantizer does (AWQ's
clamps ``z`` to 0..15, so a group whose weights all have one sign would be clamped wholesale)::

    lo, hi = min(min(w), 0), max(max(w), 0)
    s = max(hi - lo, 1e-5) / 15                  (rounded to float16: the stored scale)
    z = clamp(-round(lo / s), 0, 15)
    q = clamp(round(w / s) + z, 0, 15)           so that  w ~ (q - z) * s

The output directory is what AutoAWQ writes and what loads Qwen's ``Qwen2.5-VL-3B-Instruct-AWQ``:
``config.json`` with ``quantization_config: {quant_method: awq, bits: 4, group_size, zero_point: true,
version: gemm, modules_to_not_convert: [visual]}``, ``<linear>.qweight / .qzeros / .scales`` packed as
``edgekv/model/int4.py`` describes, everything else (vision tower, norms, the tied embedding, biases) in
float16 (``--dtype``), sharded safetensors with an index above ``--max-shard-gb``, and the tokenizer,
generation and preprocessor files copied. It reads one tensor at a time: peak memory is one output shard.

``--method awq`` adds AWQ's activation-aware scaling before rounding (see :func:`awq_scales`): each
group of linears that read the same input (q/k/v after the input norm, gate/up after the post-attention
norm, down after the MLP product) is multiplied per input channel by ``mean|x|^alpha`` (alpha searched on
a grid for the smallest output error on calibration activations) and the inverse is folded into what
produces that input (the norm's weight, ``up_proj``'s rows; ``o_proj`` is left alone: with GQA its input
is not ``v_proj``'s output shape). Calibration activations come from the fp32 model watching a few synthetic
event streams through a live session and answering toy questions (:func:`calibration_inputs`); a
checkpoint without a tokenizer gets random token ids instead.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from edgekv.calibration.calibrate import Progress
from edgekv.model.int4 import PACK, QuantConfig, dequantize, pack_awq, unpack_awq
from edgekv.model.loading import read_config_json

COPIED_FILES = ("generation_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
                "tokenizer.json", "tokenizer_config.json", "chat_template.json", "chat_template.jinja", "vocab.json",
                "merges.txt", "special_tokens_map.json", "added_tokens.json")
_OUT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------------------------------------- math
FP16_MAX = float(torch.finfo(torch.float16).max)


def quantize_weight(weight: torch.Tensor, group: int,
                    name: str = "weight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (q [K, N] uint8, zeros [K/g, N] uint8, scales [K/g, N] float16).

    ValueError naming ``name`` for what the format cannot hold: an inf or nan weight (its group's scale and
    every weight of the group would come back nan) and a group spanning more than 15 float16 steps can."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"{name}: group size {group} does not divide in_features {k}")
    w = weight.detach().to(torch.float32)
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        row, column = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}: {int(bad.sum())} weight(s) are inf or nan (first at [{row}, {column}]); a 4-bit "
                         f"group holding one comes back all nan. Repair the source checkpoint first")
    w = w.reshape(n, k // group, group)
    low, high = w.amin(dim=-1).clamp(max=0), w.amax(dim=-1).clamp(min=0)  # [N, G], 0 inside the range
    scales = ((high - low).clamp(min=1e-5) / 15).to(torch.float16)
    overflow = torch.isinf(scales)
    if bool(overflow.any()):
        row, index = (int(i) for i in overflow.nonzero()[0])
        span = float(high[row, index].double() - low[row, index].double())
        raise ValueError(f"{name}: the weights of row {row}, inputs {index * group}..{(index + 1) * group - 1} span "
                         f"{span:.4g}, more than 15 steps of the largest float16 scale ({FP16_MAX:g}) reach; the "
                         f"scale would overflow to inf and the group come back nan")
    s = scales.to(torch.float32)
    zeros = (-torch.round(low / s)).clamp(0, 15)
    q = (torch.round(w / s[..., None]) + zeros[..., None]).clamp(0, 15)
    return (q.reshape(n, k).t().to(torch.uint8).contiguous(), zeros.t().to(torch.uint8).contiguous(),
            scales.t().contiguous())


def quantized_tensors(weight: torch.Tensor, group: int, name: str = "weight") -> dict[str, torch.Tensor]:
    """W [N, K] -> the AutoAWQ GEMM tensors ``qweight``, ``qzeros``, ``scales``."""
    q, zeros, scales = quantize_weight(weight, group, name)
    return {"qweight": pack_awq(q), "qzeros": pack_awq(zeros), "scales": scales}


def fake_quantized(weight: torch.Tensor, group: int) -> torch.Tensor:
    """W [N, K] as its 4-bit round trip would hold it (fp32): what the AWQ search scores."""
    q, zeros, scales = quantize_weight(weight, group)
    return dequantize(q, zeros, scales, group).t()


# ---------------------------------------------------------------------------------------------- AWQ scaling
def awq_scales(weights: list[torch.Tensor], inputs: torch.Tensor, group: int, grid: int = 20) -> torch.Tensor:
    """Per-input-channel scales ``s`` [K] for linears that share ``inputs`` [T, K] (AWQ section 4.2, eq. 4-5):
    ``s = mean_t|x|^alpha`` (normalized), alpha in {0, 1/grid, ..., (grid-1)/grid} minimizing
    ``sum_i ||Q(W_i diag(s)) (x / s) - W_i x||^2``. alpha = 0 (s = 1) is plain round-to-nearest, so the
    result is never worse than it on the calibration inputs."""
    x = inputs.to(torch.float32)
    magnitude = x.abs().mean(dim=0).clamp(min=1e-8)  # [K]
    reference = [x @ w.to(torch.float32).t() for w in weights]
    best, best_error = torch.ones_like(magnitude), float("inf")
    for step in range(grid):
        alpha = step / grid
        s = magnitude.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        error = 0.0
        for w, ref in zip(weights, reference):
            scaled = fake_quantized(w.to(torch.float32) * s, group)
            error += float(((x / s) @ scaled.t() - ref).pow(2).mean())
        if error < best_error:
            best, best_error = s, error
    return best


def calibration_inputs(model_dir: Path, streams: int = 4, pairs: int = 12, seed: int = 7) -> dict[str, torch.Tensor]:
    """The inputs of every decoder linear (by module name under ``language.layers``, [T, K] fp32) while the
    fp32 model watches ``streams`` synthetic event streams (``edgekv.video.events``, 112x112, 2 fps; not the
    held-out seed) through a live session and answers one question of each toy family about each.
    A checkpoint without a tokenizer gets random token ids through the language model instead."""
    if not (model_dir / "tokenizer.json").is_file():
        return _random_id_inputs(model_dir, count=streams * 4, length=64, seed=seed)
    import numpy as np

    from edgekv.runtime import Runtime
    from edgekv.toy.questions import FAMILIES, sample_question
    from edgekv.video.events import EventPlan, EventScene, SceneStyle, random_events

    runtime = Runtime.from_pretrained(str(model_dir), model={"dtype": "fp32", "device": "cpu"},
                                      cache={"policy": "full", "max_tokens": 64 + 16 * pairs + 128,
                                             "text_reserve_tokens": 64},
                                      video={"fps": 2.0, "resolution": [112, 112]})
    rng = np.random.default_rng(seed)
    with _LinearInputs(runtime.model.language.layers) as captured:
        for index in range(streams):
            events = random_events(rng, pairs, EventPlan(rate=0.3, duration=(1, 2), max_per_shape=3))
            scene = EventScene(112, 112, 2.0, seed * 7919 + index, events, SceneStyle(noise=3.0), frames=2 * pairs)
            session = runtime.session()
            for frame in range(2 * pairs):
                session.ingest(scene.frame(frame), t=scene.time(frame))
            for family in FAMILIES:
                qa = sample_question(events, family, rng)
                if qa is not None:
                    session.ask(qa.question, max_new_tokens=2)
    return captured.inputs


def _random_id_inputs(model_dir: Path, count: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    from edgekv.model.language import dense_causal_attend
    from edgekv.model.loading import load_pretrained
    from edgekv.model.rope import text_position_ids

    model = load_pretrained(model_dir, dtype=torch.float32, skip=("visual",)).eval()
    generator = torch.Generator().manual_seed(seed)
    with _LinearInputs(model.language.layers) as captured, torch.inference_mode():
        for _ in range(count):
            ids = torch.randint(0, model.config.text.vocab_size, (length,), generator=generator)
            model.language(model.language.embed_tokens(ids), text_position_ids(0, length), dense_causal_attend)
    return captured.inputs


class _LinearInputs:
    """Forward hooks that keep every ``nn.Linear``'s input under ``layers`` (removed on exit)."""

    def __init__(self, layers: torch.nn.Module) -> None:
        self.layers = layers
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.hooks: list = []

    def __enter__(self) -> "_LinearInputs":
        for name, module in self.layers.named_modules():
            if isinstance(module, torch.nn.Linear):
                self.hooks.append(module.register_forward_hook(self._keep(name)))
        return self

    def _keep(self, name: str):
        def hook(module, args, output) -> None:
            x = args[0].detach()
            self.parts.setdefault(name, []).append(x.reshape(-1, x.shape[-1]).float().clone())
        return hook

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        return {name: torch.cat(parts) for name, parts in self.parts.items()}


def awq_adjustments(model_dir: Path, group: int, progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """Released-checkpoint tensor name -> multiplier applied before rounding: ``[1, K]`` column scales for
    linears (``W diag(s)``), ``[K]`` divisors for the norms and ``[N, 1]`` row divisors for ``up_proj``."""
    from edgekv.model.config import ModelConfig

    config = ModelConfig.from_dir(model_dir)
    weights = _read_layer_weights(model_dir)  # first: a weight it refuses is named before minutes of calibration
    inputs = calibration_inputs(model_dir)
    factors: dict[str, torch.Tensor] = {}
    for layer in range(config.text.num_hidden_layers):
        base = f"model.layers.{layer}"
        for readers, producer in (((f"{base}.self_attn.q_proj", f"{base}.self_attn.k_proj", f"{base}.self_attn.v_proj"),
                                   f"{base}.input_layernorm.weight"),
                                  ((f"{base}.mlp.gate_proj", f"{base}.mlp.up_proj"),
                                   f"{base}.post_attention_layernorm.weight"),
                                  ((f"{base}.mlp.down_proj",), f"{base}.mlp.up_proj.weight#rows")):
            module = readers[0].replace("model.layers.", "", 1)
            x = inputs[module]
            s = awq_scales([weights[f"{r}.weight"] for r in readers], x, _group_for(group, x.shape[1]))
            for reader in readers:
                factors[f"{reader}.weight"] = factors.get(f"{reader}.weight", 1.0) * s[None, :]
            if producer.endswith("#rows"):
                name = producer.removesuffix("#rows")
                factors[name] = factors.get(name, 1.0) / s[:, None]
            else:
                factors[producer] = 1.0 / s
        if progress is not None:
            progress(layer + 1, f"AWQ scales, layer {layer + 1}/{config.text.num_hidden_layers}")
    return factors


def _group_for(group: int, k: int) -> int:
    return k if group == -1 else group


def _read_layer_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from edgekv.model.loading import checkpoint_key_to_module, module_key_to_checkpoint, weight_files

    out = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                module = checkpoint_key_to_module(key)
                canonical = module_key_to_checkpoint(module) if module else key
                if canonical.startswith("model.layers.") and canonical.endswith(tuple(f"{n}.weight" for n in _LINEARS)):
                    out[canonical] = handle.get_tensor(key).to(torch.float32)
                    if not bool(torch.isfinite(out[canonical]).all()):
                        quantize_weight(out[canonical], out[canonical].shape[1], f"{path}: tensor {key}")  # names it
    return out


# ---------------------------------------------------------------------------------------------- checkpoint
def quantize_checkpoint(in_dir: str | Path, out_dir: str | Path, *, bits: int = 4, group_size: int = 128,
                        method: str = "rtn", dtype: str = "fp16", max_shard_bytes: int = 2 * 2**30,
                        progress: bool = False) -> Path:
    """Write the 4-bit AutoAWQ GEMM checkpoint of ``in_dir`` to ``out_dir``; returns ``out_dir``."""
    from edgekv.model.config import ModelConfig
    from edgekv.model.loading import checkpoint_key_to_module, module_key_to_checkpoint, weight_files
    from edgekv.toy import resolve_model_path

    in_dir, out_dir = Path(resolve_model_path(str(in_dir))), Path(out_dir)
    if bits != 4:
        raise ValueError(f"--bits: {bits} is not supported (edgekv writes 4-bit weights)")
    if group_size != -1 and (group_size <= 0 or group_size % PACK):
        raise ValueError(f"--group-size: {group_size} must be -1 or a positive multiple of {PACK}")
    if method not in ("rtn", "awq"):
        raise ValueError(f"--method: {method!r} is not one of rtn, awq")
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of {', '.join(_OUT_DTYPES)}")
    if out_dir.resolve() == in_dir.resolve():
        raise ValueError(f"OUT_DIR: {out_dir} is the input directory; write the 4-bit copy elsewhere")
    _check_output(out_dir, max_shard_bytes)
    if not in_dir.is_dir():
        raise ValueError(f"IN_DIR: {in_dir}: " + ("not a directory (give the checkpoint's folder)" if in_dir.exists()
                                                  else "no such directory"))
    if not (in_dir / "config.json").is_file():
        raise ValueError(f"IN_DIR: {in_dir} has no config.json (not a Qwen2.5-VL checkpoint directory)")
    raw = read_config_json(in_dir / "config.json")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    if raw.get("quantization_config") is not None or text.get("quantization_config") is not None:
        raise ValueError(f"{in_dir}: already quantized (config.json has a quantization_config)")
    config = ModelConfig.from_dir(in_dir)
    linears = _linear_shapes(config)
    for name, (n, k) in linears.items():
        if n % PACK:
            raise ValueError(f"IN_DIR: {in_dir}: {name} has {n} output features, not a multiple of {PACK}: the "
                             f"AutoAWQ GEMM layout packs {PACK} outputs into each int32 word")
        group = _group_for(group_size, k)
        if k % group:
            raise ValueError(f"--group-size: {group_size} does not divide in_features {k} of {name} "
                             f"(choose a divisor of {sorted({kk for _, kk in linears.values()})})")
    _check_weights(in_dir, config, linears)
    factors = {}
    if method == "awq":
        search = Progress(config.text.num_hidden_layers, label="quantize") if progress else None
        factors = awq_adjustments(in_dir, group_size, search)
        if search is not None:
            search.close()
    out_dtype = _OUT_DTYPES[dtype]
    with _output_folder(out_dir) as folder:
        writer = _ShardWriter(folder, max_shard_bytes)
        done, bar = 0, Progress(len(linears), label="quantize") if progress else None
        for path in weight_files(in_dir):
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    module = checkpoint_key_to_module(key)
                    name = module_key_to_checkpoint(module) if module else key
                    tensor = handle.get_tensor(key)
                    if name in factors:
                        tensor = tensor.to(torch.float32) * factors[name]
                    prefix = name.removesuffix(".weight")
                    if prefix in linears:
                        group = _group_for(group_size, linears[prefix][1])
                        for part, value in quantized_tensors(tensor, group, f"{path}: tensor {key}").items():
                            writer.add(f"{prefix}.{part}", value)
                        done += 1
                        if bar is not None:
                            bar(done, f"{done}/{len(linears)} linears ({prefix})")
                    else:
                        writer.add(name, _converted(tensor, out_dtype, f"{path}: tensor {key}"))
        writer.close()
        if bar is not None:
            bar.close()
        quant = QuantConfig("awq", bits, group_size, modules_to_not_convert=("visual",))
        raw["quantization_config"] = quant.to_dict()
        raw["torch_dtype"] = str(out_dtype).removeprefix("torch.")
        raw["edgekv_quantize"] = {"method": method, "group_size": group_size}
        (folder / "config.json").write_text(json.dumps(raw, indent=2))
        for name in COPIED_FILES:
            if (in_dir / name).is_file():
                shutil.copyfile(in_dir / name, folder / name)
    return out_dir


def _converted(tensor: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """A tensor left unquantized, in the output dtype; ValueError naming it where a finite value overflows (a bf16 or
    fp32 value past float16's 65504 would be written as inf)."""
    if not tensor.is_floating_point():
        return tensor
    out = tensor.to(dtype)
    overflow = torch.isinf(out) & torch.isfinite(tensor)
    if bool(overflow.any()):
        where = [int(i) for i in overflow.nonzero()[0]]
        value = float(tensor[tuple(where)])
        raise ValueError(f"{name}: {int(overflow.sum())} value(s) (first at {where}: {value:.6g}) do not fit "
                         f"{str(dtype).removeprefix('torch.')}; write the unquantized tensors with --dtype bf16 or "
                         f"fp32")
    return out


def _check_weights(in_dir: Path, config, linears: dict[str, tuple[int, int]]) -> None:
    """Refuse, before anything is written, what would make a 4-bit checkpoint no loader takes (the error then naming
    OUT_DIR, not the input) or the run fail part way: weight files cut short (an interrupted copy: safetensors' own
    reader failed mid-write with a traceback), a decoder linear in no file, a tensor whose shape is not the one
    config.json implies (its 4-bit parts were written with the tensor's shape, and the load refused them), and
    tensors already 4-bit (``.qweight``) under a config.json that does not say so."""
    from edgekv.model.loading import (check_safetensors_file, checkpoint_key_to_module, checkpoint_shapes,
                                      module_key_to_checkpoint, weight_files)
    from edgekv.model.tensor_file import TensorFile

    expected = checkpoint_shapes(config)
    stored = set()
    for path in weight_files(in_dir):
        check_safetensors_file(path)  # a damaged file named first, as the loader names it
        with TensorFile(path) as handle:
            for key in handle.names:
                module = checkpoint_key_to_module(key)
                canonical = module_key_to_checkpoint(module) if module else key
                stored.add(canonical)
                if key.endswith((".qweight", ".qzeros")):
                    raise ValueError(f"IN_DIR: {in_dir}: already quantized ({path.name} holds tensor {key}); "
                                     f"edgekv quantize reads a floating-point checkpoint")
                shape, want = handle.shape(key), expected.get(canonical)
                if want is not None and tuple(shape) != tuple(want):
                    raise ValueError(f"IN_DIR: {path}: tensor {key}: config.json implies shape {list(want)}, found "
                                     f"{list(shape)}")
    missing = [f"{prefix}.weight" for prefix in linears if f"{prefix}.weight" not in stored]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"IN_DIR: {in_dir}: tensor {missing[0]}{more} is in no weight file")


def _check_output(out_dir: Path, max_shard_bytes: int, replaces_quantized: bool = True) -> None:
    """Refuse, before anything is read or searched, an ``OUT_DIR`` that is a file or a folder of something other
    than a checkpoint (it would be replaced whole), and a shard size that is not positive. ``replaces_quantized``:
    the checkpoint an ``OUT_DIR`` may hold must be a 4-bit one (an earlier run's): a floating-point checkpoint
    there — the source of another run, a slip of the command line — used to be deleted and replaced."""
    if max_shard_bytes <= 0:
        raise ValueError(f"--max-shard-gb: must be > 0 (got {max_shard_bytes / 2**30:g})")
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir())
                                                       and not (out_dir / "config.json").is_file())):
        raise ValueError(f"OUT_DIR: {out_dir} exists and is not a checkpoint folder (it would be replaced); choose "
                         f"another or remove it")
    if replaces_quantized and (out_dir / "config.json").is_file():
        try:
            raw = read_config_json(out_dir / "config.json")
        except (OSError, ValueError):
            raw = {}
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
        if raw.get("quantization_config") is None and text.get("quantization_config") is None:
            raise ValueError(f"OUT_DIR: {out_dir} holds a checkpoint that is not 4-bit (its config.json has no "
                             f"quantization_config), which would be replaced; choose another folder or remove it")


@contextlib.contextmanager
def _output_folder(out_dir: Path):
    """A checkpoint folder written whole or not at all: the files go to a hidden sibling, which replaces
    ``out_dir`` only once every file is written. Writing over an earlier checkpoint used to keep its shards and
    index beside the new files, and the index — read first — pointed at the old weights: a checkpoint that
    failed to load, or loaded the previous run's weights where the shapes agreed. A failure or Ctrl-C leaves
    ``out_dir`` as it was and removes the sibling."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out_dir, "partial")
    partial = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old)
    os.replace(partial, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _remove_stale(out_dir, "old")  # an earlier run's, killed between its two renames: the new one is in place now


def _remove_stale(out_dir: Path, kind: str) -> None:
    """Remove the hidden ``.<name>.<kind>-<pid>`` folders beside ``out_dir`` whose process is gone. A run killed
    (SIGKILL, power loss) cannot remove its own, and at 3B each partial folder held up to 2 GB of a Jetson's flash
    that no later run ever freed. A folder whose process still runs (another conversion to the same place) stays."""
    prefix = f".{out_dir.name}.{kind}-"
    for entry in out_dir.parent.glob(f"{glob.escape(prefix)}*"):
        pid = entry.name[len(prefix):]
        if pid.isdigit() and entry.is_dir() and not entry.is_symlink() and not _process_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: someone else's process
        return True
    return True


def _linear_shapes(config) -> dict[str, tuple[int, int]]:
    """Released-checkpoint prefix of every decoder-layer linear -> (out_features, in_features)."""
    t = config.text
    d, hd = t.hidden_size, t.head_dim
    shapes = {"self_attn.q_proj": (t.num_attention_heads * hd, d), "self_attn.k_proj": (t.num_key_value_heads * hd, d),
              "self_attn.v_proj": (t.num_key_value_heads * hd, d), "self_attn.o_proj": (d, t.num_attention_heads * hd),
              "mlp.gate_proj": (t.intermediate_size, d), "mlp.up_proj": (t.intermediate_size, d),
              "mlp.down_proj": (d, t.intermediate_size)}
    return {f"model.layers.{i}.{name}": shape for i in range(t.num_hidden_layers) for name, shape in shapes.items()}


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors reports a full disk as its own SafetensorError, which the command line took for a bug (a
    traceback, exit 1): an OSError naming the file instead."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as exc:
        raise OSError(f"{path}: cannot write it ({exc})") from None


class _ShardWriter:
    """Safetensors shards of at most ``max_bytes`` (one file and no index when everything fits)."""

    def __init__(self, out_dir: Path, max_bytes: int) -> None:
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.shards: list[dict[str, torch.Tensor] | list[str]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        index = len(self.shards)
        _save(self.pending, self.out_dir / f"shard-{index:05d}.tmp")
        self.shards.append(list(self.pending))
        self.pending, self.size = {}, 0

    def close(self) -> None:
        from edgekv.model.loading import INDEX_FILE, SINGLE_FILE

        if not self.shards:
            _save(self.pending, self.out_dir / SINGLE_FILE)
            os.chmod(self.out_dir / SINGLE_FILE, 0o644)
            return
        if self.pending:
            self._flush()
        count = len(self.shards)
        weight_map = {}
        for index, names in enumerate(self.shards):
            final = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.out_dir / f"shard-{index:05d}.tmp", self.out_dir / final)
            os.chmod(self.out_dir / final, 0o644)
            weight_map.update({name: final for name in names})
        (self.out_dir / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": self.total},
                                                            "weight_map": weight_map}, indent=2))


def dequantize_checkpoint(in_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32,
                          max_shard_bytes: int = 2 * 2**30) -> Path:
    """The dequantized twin of a 4-bit AWQ checkpoint: every ``qweight/qzeros/scales`` triple as the exact
    ``.weight`` (fp32, then ``dtype``), everything else converted to ``dtype``; no quantization_config.
    Written shard by shard, one linear's parts held at a time."""
    from edgekv.model.loading import weight_files

    in_dir, out_dir = Path(in_dir), Path(out_dir)
    raw = json.loads((in_dir / "config.json").read_text())
    quant = QuantConfig.from_model_config(raw)
    if quant is None or quant.method != "awq":
        raise ValueError(f"{in_dir}: not an AWQ checkpoint")
    _check_output(out_dir, max_shard_bytes, replaces_quantized=False)
    with _output_folder(out_dir) as folder:
        writer = _ShardWriter(folder, max_shard_bytes)
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for path in weight_files(in_dir):
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    prefix, _, part = key.rpartition(".")
                    if part not in ("qweight", "qzeros", "scales"):
                        writer.add(key, handle.get_tensor(key).to(dtype))
                        continue
                    parts.setdefault(prefix, {})[part] = handle.get_tensor(key)
                    if len(parts[prefix]) == 3:
                        p = parts.pop(prefix)
                        group = _group_for(quant.group_size, p["qweight"].shape[0])
                        weight = dequantize(unpack_awq(p["qweight"]), unpack_awq(p["qzeros"]), p["scales"], group)
                        writer.add(f"{prefix}.weight", weight.t().contiguous().to(dtype))
        if parts:
            prefix = next(iter(parts))
            raise ValueError(f"{in_dir}: {prefix} has only {sorted(parts[prefix])} of qweight, qzeros, scales")
        writer.close()
        del raw["quantization_config"]
        raw["torch_dtype"] = str(dtype).removeprefix("torch.")
        (folder / "config.json").write_text(json.dumps(raw, indent=2))
        for name in COPIED_FILES:
            if (in_dir / name).is_file():
                shutil.copyfile(in_dir / name, folder / name)
    return out_dir


def bench_int4_checkpoint(model_dir: str | Path, out_dir: Path, group_size: int = 128) -> str:
    """``model_dir`` quantized into ``out_dir`` for a benchmark, with the largest of ``group_size``, 64, 32,
    16 that divides every linear's in_features (a tiny checkpoint's 64 / 176 take 16)."""
    from edgekv.model.config import ModelConfig
    from edgekv.toy import resolve_model_path

    config = ModelConfig.from_dir(resolve_model_path(str(model_dir)))
    widths = {k for _, k in _linear_shapes(config).values()}
    group = next((g for g in (group_size, 64, 32, 16) if all(k % g == 0 for k in widths)), -1)
    return str(quantize_checkpoint(model_dir, out_dir, group_size=group))


# ---------------------------------------------------------------------------------------------- CLI
def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("in_dir", help="a Qwen2.5-VL checkpoint directory (or builtin:toy)")
    parser.add_argument("out_dir", help="where the 4-bit checkpoint goes (AutoAWQ GEMM layout)")
    parser.add_argument("--bits", type=int, default=4, help="bits per weight (4)")
    parser.add_argument("--group-size", type=int, default=128,
                        help="input features per scale and zero point (-1: one group per output feature)")
    parser.add_argument("--method", choices=["rtn", "awq"], default="rtn",
                        help="rtn: round to nearest; awq: activation-aware scaling searched on calibration inputs "
                             "first")
    parser.add_argument("--dtype", choices=sorted(_OUT_DTYPES), default="fp16",
                        help="dtype of everything left unquantized (AutoAWQ writes fp16)")
    parser.add_argument("--max-shard-gb", type=float, default=2.0, help="largest safetensors file, in GB")
    parser.epilog = "example: edgekv quantize builtin:toy out/toy-int4 --group-size 16"
    parser.set_defaults(func=quantize_main)


def quantize_main(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.max_shard_gb) and args.max_shard_gb > 0):  # inf was an OverflowError's traceback
        raise ValueError(f"--max-shard-gb: must be > 0 and finite, in GB (got {args.max_shard_gb:g})")
    out = quantize_checkpoint(args.in_dir, args.out_dir, bits=args.bits, group_size=args.group_size,
                              method=args.method, dtype=args.dtype,
                              max_shard_bytes=max(1, int(args.max_shard_gb * 2**30)), progress=True)
    print(f"wrote a 4-bit checkpoint (AutoAWQ GEMM, group size {args.group_size}, {args.method}) to {out}")
    return 0
