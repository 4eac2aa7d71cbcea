"""Load a Hugging Face Qwen2.5-VL checkpoint directory into :class:`Qwen25VL`, without transformers.

Reads ``config.json`` and either ``model.safetensors`` or the shards named by
``model.safetensors.index.json``, tensor by tensor (``edgekv/model/tensor_file.py``: no memory map), each
straight into a tensor of its final dtype and device (a stored dtype that differs converted through a small
buffer), so peak memory is the model plus that buffer. The model is built on the meta device
first; nothing is initialised twice.

Two key layouts are accepted:

=========================================  ==========================================  ===========================
released checkpoints (transformers 4.x)    transformers 5 ``save_pretrained``          here
=========================================  ==========================================  ===========================
``model.embed_tokens.*``, ``model.norm.*``   ``model.language_model.embed_tokens.*``    ``language.embed_tokens.*``
``model.layers.N.*``                       ``model.language_model.layers.N.*``         ``language.layers.N.*``
``lm_head.weight``                         ``lm_head.weight``                          ``language.lm_head.weight``
``visual.*``                               ``model.visual.*``                          ``visual.*``
=========================================  ==========================================  ===========================

With ``tie_word_embeddings`` the head is the embedding; a stored ``lm_head.weight`` is then ignored.
A ``quantization_config`` in ``config.json`` (AutoAWQ GEMM or GPTQ, 4-bit) makes the decoder layers' stored
4-bit linears :class:`~edgekv.model.int4.Int4Linear` modules (``edgekv/model/int4_checkpoint.py``); the
vision tower, norms and embedding load as above. Every failure is a :class:`CheckpointError` naming the
file and the tensor (or the ``quantization_config`` field), raised before the model is returned.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from edgekv.hostmem import trim
from edgekv.model import int4_checkpoint
from edgekv.model.config import ConfigError, ModelConfig
from edgekv.model.int4 import QuantConfig, QuantConfigError
from edgekv.model.qwen25vl import Qwen25VL
from edgekv.model.tensor_file import TensorFile, TensorFileError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PATCH_EMBED = "visual.patch_embed.proj.weight"
# Non-persistent buffers that some old exports still carry; harmless, recomputed here.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", "rotary_pos_emb.inv_freq")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; ``file`` and ``tensor`` say where."""

    def __init__(self, message: str, file: str | Path | None = None, tensor: str | None = None) -> None:
        super().__init__(message)
        self.file = str(file) if file is not None else None
        self.tensor = tensor


def checkpoint_key_to_module(key: str) -> str | None:
    """Map a checkpoint tensor name (either layout) to this package's parameter name; None if foreign."""
    for prefix, target in (("model.language_model.", "language."), ("model.visual.", "visual."),
                           ("visual.", "visual."), ("model.", "language.")):
        if key.startswith(prefix):
            return target + key[len(prefix):]
    if key == "lm_head.weight":
        return "language.lm_head.weight"
    return None


def module_key_to_checkpoint(name: str) -> str:
    """This package's parameter name -> the released-checkpoint name (what ``make_tiny_checkpoint`` writes)."""
    if name.startswith("language.lm_head."):
        return name[len("language."):]
    if name.startswith("language."):
        return "model." + name[len("language."):]
    return name


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Released-checkpoint tensor name -> shape implied by ``config``, in module order."""
    with torch.device("meta"):
        model = Qwen25VL(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        shapes[module_key_to_checkpoint(name)] = tuple(param.shape)
    v = config.vision
    shapes[_PATCH_EMBED] = (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    if not config.text.tie_word_embeddings:
        shapes.setdefault("lm_head.weight", (config.text.vocab_size, config.text.hidden_size))
    return shapes


def read_config_json(path: Path) -> dict:
    """A checkpoint's ``config.json`` as a dict, or a ValueError naming the file: a file that is not UTF-8 JSON
    used to be refused with the decoder's message alone, which does not say which file."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON config ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def remove_weight_files(model_dir: Path) -> None:
    """Delete a checkpoint folder's weight files — the single file, the index and ``model-*-of-*`` shards — before
    new ones are written in place: an index left from an earlier, sharded checkpoint is read before a new single
    file (``weight_files``), so it loaded the old shards against the new config.json."""
    model_dir = Path(model_dir)
    for path in [model_dir / SINGLE_FILE, model_dir / INDEX_FILE, *model_dir.glob("model-*-of-*.safetensors")]:
        path.unlink(missing_ok=True)


def weight_files(model_dir: Path) -> dict[Path, list[str] | None]:
    """Safetensors files to read -> the tensor names the index promises in each (None: single file)."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: not a safetensors index ({exc!r})", file=index_path) from exc
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: weight_map is empty or not an object", file=index_path)
        files: dict[Path, list[str]] = {}
        for tensor, shard in weight_map.items():
            files.setdefault(model_dir / shard, []).append(tensor)
        for path, tensors in files.items():
            if not path.is_file():
                raise CheckpointError(f"{path}: shard listed in {index_path.name} is missing "
                                      f"(it should hold {len(tensors)} tensors, e.g. {tensors[0]})",
                                      file=path, tensor=tensors[0])
        return dict(files)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return {single: None}
    raise CheckpointError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found", file=model_dir)


def check_safetensors_file(path: Path) -> list[str]:
    """Validate a safetensors file's header against its size; return its tensor names.

    A file cut short (an interrupted copy) keeps a valid header; the first tensor whose bytes run past
    the end of the file is named in the error.
    """
    with _open_tensor_file(path) as handle:
        return handle.names


def _open_tensor_file(path: Path) -> TensorFile:
    try:
        return TensorFile(path)
    except TensorFileError as exc:
        raise CheckpointError(str(exc), file=path, tensor=exc.tensor) from exc
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open safetensors file ({exc})", file=path) from exc


def _read(handle: TensorFile, key: str, dtype: torch.dtype | None, device: torch.device | str) -> torch.Tensor:
    try:
        return handle.read(key, dtype, device)
    except TensorFileError as exc:
        raise CheckpointError(str(exc), file=handle.path, tensor=key) from exc
    except (OSError, RuntimeError) as exc:  # a read error, or no memory for it on the device
        raise CheckpointError(f"{handle.path}: cannot read tensor {key} ({exc})", file=handle.path, tensor=key) from exc


def _set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path)
    module._parameters[leaf] = nn.Parameter(value, requires_grad=False)


def load_pretrained(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", skip: tuple[str, ...] = ()) -> Qwen25VL:
    """Load ``model_dir`` (config.json + safetensors) as a :class:`Qwen25VL` in ``dtype`` on ``device`` (eval).

    ``skip``: parts an engine runs instead — ``"visual"`` (the vision tower) and/or ``"language.layers"``
    (the decoder stack). Their tensors are checked (names, shapes) but never read, and the parts are left
    out of the model (``model.visual is None``, ``model.language.layers`` empty), so a Jetson running
    TensorRT engines does not also hold a second copy of those weights.
    """
    unknown = set(skip) - {"visual", "language.layers"}
    if unknown:
        raise ValueError(f"skip: unknown model parts {sorted(unknown)} (known: visual, language.layers)")
    skipped = tuple(f"{part}." for part in skip)
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory", file=model_dir)
    try:
        config = ModelConfig.from_dir(model_dir)
    except ConfigError as exc:
        raise CheckpointError(str(exc), file=model_dir / "config.json") from exc
    try:
        quant = QuantConfig.from_model_config(config.extra)
    except QuantConfigError as exc:
        raise CheckpointError(f"{model_dir / 'config.json'}: {exc}", file=model_dir / "config.json") from exc
    device = torch.device(device)
    with torch.device("meta"):
        model = Qwen25VL(config)
    expected = checkpoint_shapes(config)
    tied = config.text.tie_word_embeddings
    loaded: dict[str, Path] = {}
    unexpected: list[tuple[str, Path]] = []
    files = {path: (promised, check_safetensors_file(path)) for path, promised in weight_files(model_dir).items()}
    plans: dict[str, int4_checkpoint.QuantizedLinearPlan] = {}
    if quant is not None:
        def refuse(message: str, tensor: str | None) -> CheckpointError:
            return CheckpointError(message if message.startswith(str(model_dir)) else f"{model_dir}: {message}",
                                   file=model_dir, tensor=tensor)

        stored = {module_key_to_checkpoint(m) for _, names in files.values() for key in names
                  if (m := checkpoint_key_to_module(key)) is not None}
        plans = int4_checkpoint.plan_quantized(model, quant, stored, module_key_to_checkpoint, refuse)
        expected = int4_checkpoint.expected_with_quantized(expected, plans)

    for path, (promised, names) in files.items():
        if promised is not None:
            absent = sorted(set(promised) - set(names))
            if absent:
                raise CheckpointError(f"{path}: tensor {absent[0]} is listed in {INDEX_FILE} but not in the file"
                                      f"{f' ({len(absent)} missing)' if len(absent) > 1 else ''}",
                                      file=path, tensor=absent[0])
        with _open_tensor_file(path) as handle:
            for key in names:
                if key.endswith(_IGNORED_SUFFIXES) or (tied and key == "lm_head.weight"):
                    continue
                module_name = checkpoint_key_to_module(key)
                canonical = module_key_to_checkpoint(module_name) if module_name else None
                if canonical not in expected:
                    unexpected.append((key, path))
                    continue
                if canonical in loaded:
                    raise CheckpointError(f"{path}: tensor {key} is also stored in {loaded[canonical]}",
                                          file=path, tensor=key)
                shape = handle.shape(key)
                if shape != expected[canonical]:
                    raise CheckpointError(f"{path}: tensor {key}: config.json implies shape "
                                          f"{list(expected[canonical])}, found {list(shape)}", file=path, tensor=key)
                if module_name.startswith(skipped):
                    loaded[canonical] = path
                    continue
                quantized = int4_checkpoint.split_part(canonical, plans)
                if quantized is not None:
                    plan, part = quantized
                    tensor = _read(handle, key, None, "cpu")
                    int4_checkpoint.check_part(tensor, key, part, path, lambda m, t: CheckpointError(m, path, t))
                    plan.parts[part] = tensor
                    loaded[canonical] = path
                    int4_checkpoint.finish_linear(model, plan, quant, device,
                                                  lambda m, t: CheckpointError(f"{path}: {m}", path, t))
                    continue
                tensor = _read(handle, key, dtype, device)
                if canonical == _PATCH_EMBED:
                    tensor = tensor.reshape(tensor.shape[0], -1)  # Conv3d kernel == stride: a Linear
                _set_parameter(model, module_name, tensor)
                loaded[canonical] = path

    if unexpected:
        key, path = unexpected[0]
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        hint = ""
        if key.endswith((".qweight", ".qzeros", ".scales", ".g_idx")):
            hint = (" (4-bit tensors are read for the language model's decoder layers only, and only with a "
                    "quantization_config in config.json)")
        raise CheckpointError(f"{path}: unexpected tensor {key}{more}: not part of a Qwen2.5-VL model with this "
                              f"config.json{hint}", file=path, tensor=key)
    missing = [name for name in expected if name not in loaded]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{model_dir}: required tensor {missing[0]}{more} is in no weight file",
                              file=model_dir, tensor=missing[0])
    model.quantization = quant
    trim()  # whatever the reads freed between the tensors they made goes back to the kernel (edgekv/hostmem.py)
    if tied:
        model.language.lm_head.weight = model.language.embed_tokens.weight
    if "visual" in skip:
        model.visual = None
    if "language.layers" in skip:
        model.language.layers = nn.ModuleList()
    return model.eval()
