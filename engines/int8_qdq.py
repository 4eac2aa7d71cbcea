"""The INT8 vision graph by explicit quantization: ``QuantizeLinear`` / ``DequantizeLinear`` pairs in the ONNX graph.

TensorRT's implicit INT8 (``IInt8EntropyCalibrator2`` + ``BuilderFlag.INT8``) is deprecated since TensorRT 10.1
("Superseded by explicit quantization") and gone in 11. Explicit quantization puts the scales in the graph, so
the engine is built strongly typed with no precision flag ("Use explicit quantization with Strong Typing.
Precision-control build flags are not required and should not be specified", TensorRT developer guide,
*Explicit Quantization*), and the same graph runs under onnxruntime, where its numerics are checked.

What is quantized — the five products of every ViT block (``attn.qkv``, ``attn.proj``, ``mlp.gate_proj``,
``mlp.up_proj``, ``mlp.down_proj``), nearly all of the tower's FLOPs, each as::

    x ──Q(s_x, 0)──DQ(s_x, 0)──┐
    W_int8 ──DQ(s_w[out], 0, axis=0)──Gemm(transB=1) + bias      (the exporter's Linear, kept)

* weights: symmetric int8, one scale per output channel, ``s_w[c] = max|W[c, :]| / 127``, codes in
  ``[-127, 127]``, computed here and stored as INT8 initializers behind a ``DequantizeLinear`` ("When using
  pre-quantized weights, an IDequantizeLayer is required between the weights and the linear operator",
  ibid.) — half the bytes of an fp16 graph's weights;
* activations: symmetric int8, one scale per tensor, ``s_x = amax / 127``, ``amax`` the largest ``|x|`` the
  product's input reached over the ``engines.int8_calibration`` frame pairs, run through the float tower
  (``calibrate``). Max, not entropy or percentile: TensorRT's own guidance is MinMax for transformers ("the
  preferred calibrator for NLP tasks", ``IInt8MinMaxCalibrator``), the entropy calibrator is the CNN default,
  and NVIDIA's ModelOpt quantizes INT8 the same way (``INT8_DEFAULT_CFG``: weights ``axis: 0``, inputs
  per tensor, ``"algorithm": "max"``). Measured on the shipped toys' trained towers (engines/README.md),
  99.99th-percentile clipping won on one video, tied on one and, on the third, clipped rare large inputs and
  put the worst token 16 % off (max: 3 %); max never did that;
* zero points: explicit INT8 zeros. TensorRT quantizes symmetrically only (its ONNX parser refuses a non-zero
  zero point) and reads a missing one as INT8 where ONNX reads UINT8, so the graph says INT8 to both.

Left in the graph's float dtype: the patch embedding (pixels straight from the preprocessor), RMSNorms, rotary,
the attention products and softmax (fp32 islands), and the merger (its output is what the LLM reads; quantizing
it too doubled the toys' median token error, see the README).

Opset: 19, the first whose ``QuantizeLinear`` takes fp16 / bf16 input and whose ``DequantizeLinear`` writes fp16
/ bf16 (opset 18's take fp32 / int32 only), so an fp16 graph needs no Cast around each pair. TensorRT 10's
parser takes opsets 9 to 20 (onnx-tensorrt ``docs/operators.md``, 10.0/10.1 GA) and, strongly typed, gives a
``DequantizeLinear`` the scale's type as its output (``onnxOpImporters.cpp`` ``QuantDequantLinearHelper``);
onnxruntime (1.32, installed here) runs opset 19 Q/DQ in fp32 and fp16 on the CPU. The float graph is exported at
opset 18 like the others and converted with ``onnx.version_converter`` (the float graph's outputs unchanged by it:
measured 0.0 on the toy).

What was run where: the Q/DQ graph under onnxruntime's CPU provider against the float graph and torch
(``tests/test_int8_qdq.py``); TensorRT builds only against the stand-in module (``tests/helpers_tensorrt.py``).
No TensorRT and no Jetson have built or run it.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from edgekv.engines.manifest import EngineError

QDQ_OPSET = 19
INT8_MAX = 127
BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
CALIBRATION = "max"
GRAPH_PREFIX = "tower."  # VisionGraph holds the tower as ``tower``: its weights are ``tower.<module>.weight``
CHECK_PAIRS = 4  # calibration pairs the build also runs fake-quantized, to report the token cosine in the manifest


def block_linears(tower: nn.Module, float_products: Sequence[str] = ()) -> list[str]:
    """The products quantized: the five linears of every ViT block (module names under the tower) but those of
    ``float_products`` (``engines.int8_float_products``: ``down_proj``, ``qkv``, ... — the last part of the name),
    which stay in the graph's float dtype."""
    known = {name.rsplit(".", 1)[-1] for name in BLOCK_LINEARS}
    unknown = sorted(set(float_products) - known)
    if unknown:
        raise EngineError(f"engines.int8_float_products: {', '.join(unknown)} is not a ViT block product (choose from "
                          f"{', '.join(sorted(known))})")
    kept = [name for name in BLOCK_LINEARS if name.rsplit(".", 1)[-1] not in set(float_products)]
    if not kept:
        raise EngineError("engines.int8_float_products: every product left in float quantizes nothing; use "
                          "engines.precision fp16 (or bf16) instead of int8")
    return [f"blocks.{index}.{name}" for index in range(len(tower.blocks)) for name in kept]


def _tiny(dtype: torch.dtype) -> float:
    """The smallest scale kept: the dtype's smallest normal number (TensorRT's parser wants every scale > 0)."""
    return float(torch.finfo(dtype).tiny)


def quantize_weight(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` -> (codes int8 [out, in], scale [out] in ``dtype``): symmetric, per output channel.
    The codes are rounded against the scale as stored (``dtype``), so ``codes * scale`` is what the graph holds."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(_tiny(dtype)).to(dtype)
    codes = torch.round(w / scale.float()[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def activation_scale(amax: float, dtype: torch.dtype) -> torch.Tensor:
    """The per-tensor scale of an input whose largest magnitude was ``amax`` (a 0-d tensor in ``dtype``)."""
    return torch.tensor(max(float(amax) / INT8_MAX, _tiny(dtype)), dtype=torch.float32).to(dtype)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``DequantizeLinear(QuantizeLinear(x, scale, 0), scale, 0)`` with INT8 zero points, in fp32: round half to
    even (ONNX's rounding, and torch's), saturate to [-128, 127]."""
    s = scale.float()
    return torch.round(x.float() / s).clamp(-INT8_MAX - 1, INT8_MAX) * s


@dataclass
class QuantPlan:
    """What edgekv computed for one vision tower: per quantized linear (module name under the tower) its int8
    weights and per-channel scales, and the largest |input| it saw on the calibration frames."""

    dtype: torch.dtype
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    input_amax: dict[str, float] = field(default_factory=dict)
    pairs: int = 0

    def input_scale(self, name: str) -> torch.Tensor:
        return activation_scale(self.input_amax[name], self.dtype)


def calibrate(tower: nn.Module, run, pixel_batches: Sequence[torch.Tensor], names: Sequence[str]) -> dict[str, float]:
    """The largest |input| of each module ``names`` over ``pixel_batches`` (each one frame pair's pixels), the
    tower run in float by ``run(pixels)``. Hooks are removed whatever happens."""
    amax = dict.fromkeys(names, 0.0)

    def recorder(name: str):
        def hook(module, args) -> None:
            amax[name] = max(amax[name], float(args[0].detach().abs().amax()))
        return hook

    handles = [tower.get_submodule(name).register_forward_pre_hook(recorder(name)) for name in names]
    try:
        with torch.no_grad():
            for pixels in pixel_batches:
                run(pixels)
    finally:
        for handle in handles:
            handle.remove()
    return amax


def make_plan(tower: nn.Module, run, pixel_batches: Sequence[torch.Tensor],
              names: Sequence[str] | None = None) -> QuantPlan:
    """Quantize the weights of ``names`` (default: ``block_linears``) and calibrate their inputs."""
    names = list(names) if names is not None else block_linears(tower)
    if not pixel_batches:
        raise EngineError("engines.int8_calibration: no frame pair to calibrate the vision tower's INT8 scales on")
    dtype = tower.patch_embed.proj.weight.dtype
    plan = QuantPlan(dtype=dtype, pairs=len(pixel_batches))
    for name in names:
        module = tower.get_submodule(name)
        if not isinstance(module, nn.Linear):
            raise EngineError(f"vision tower: {name} is a {type(module).__name__}, not a Linear; only Linear "
                              f"products are quantized")
        plan.weights[name] = quantize_weight(module.weight, dtype)
    plan.input_amax = calibrate(tower, run, pixel_batches, names)
    return plan


@contextlib.contextmanager
def fake_quantized(tower: nn.Module, plan: QuantPlan) -> Iterator[None]:
    """The tower computing what the Q/DQ graph computes (the torch reference of ``insert_qdq``): each planned
    linear's input fake-quantized per tensor, its weight replaced by ``codes * scale``. Put back on exit."""
    saved, handles = {}, []
    try:
        for name, (codes, scale) in plan.weights.items():
            module = tower.get_submodule(name)
            saved[name] = module.weight.data
            module.weight.data = (codes.float() * scale.float()[:, None]).to(module.weight.dtype)
            input_scale = plan.input_scale(name)
            handles.append(module.register_forward_pre_hook(
                lambda m, args, s=input_scale: (fake_quantize(args[0], s).to(args[0].dtype), *args[1:])))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for name, data in saved.items():
            tower.get_submodule(name).weight.data = data


# ---------------------------------------------------------------------------------------------- the ONNX graph
def _onnx_type(dtype: torch.dtype) -> int:
    from onnx import TensorProto

    types = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
             torch.bfloat16: TensorProto.BFLOAT16, torch.int8: TensorProto.INT8}
    if dtype not in types:
        raise EngineError(f"vision graph: no Q/DQ scale type for {dtype}")
    return types[dtype]


def _initializer(name: str, tensor: torch.Tensor):
    """A TensorProto of ``tensor`` as its bytes (bf16 included, which numpy cannot hold)."""
    from onnx import TensorProto

    proto = TensorProto(name=name, data_type=_onnx_type(tensor.dtype), dims=list(tensor.shape))
    flat = tensor.detach().cpu().contiguous().reshape(-1)  # a 0-d scale too: view() needs a dimension
    proto.raw_data = flat.view(torch.uint8).numpy().tobytes()
    return proto


def insert_qdq(model, plan: QuantPlan, prefix: str = GRAPH_PREFIX):
    """Rewrite the exported float vision graph (an opset 19 ``onnx.ModelProto``, in place; returned): every
    planned linear's ``Gemm`` reads its INT8 weights through a per-channel ``DequantizeLinear`` and its input
    through one ``QuantizeLinear`` -> ``DequantizeLinear`` pair per tensor (linears that share an input — gate and
    up — share the pair, scaled by the larger amax). The float weights leave the graph."""
    from onnx import helper

    graph = model.graph
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if version < QDQ_OPSET:
        raise EngineError(f"vision graph: opset {version}; fp16 Q/DQ needs opset {QDQ_OPSET} (convert it first)")
    initializers = {init.name: init for init in graph.initializer}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    inserts: dict[str, list] = {}  # tensor name -> the Q/DQ nodes to place before its first quantized consumer
    activation_amax: dict[str, float] = {}
    rewired: list[tuple] = []
    for module_name, (codes, scale) in plan.weights.items():
        weight = f"{prefix}{module_name}.weight"
        users = consumers.get(weight, [])
        gemm = users[0] if len(users) == 1 else None
        trans_b = {a.name: a.i for a in gemm.attribute}.get("transB", 0) if gemm is not None else 0
        if weight not in initializers or gemm is None or gemm.op_type != "Gemm" or gemm.input[1] != weight \
                or trans_b != 1:
            found = ", ".join(f"{n.op_type} {n.name}" for n in users) or "no node"
            raise EngineError(f"vision graph: {weight} is read by {found}; the Q/DQ rewrite expects the exporter's "
                              f"Linear, one Gemm(x, W, b, transB=1) reading it as its second input")
        graph.initializer.remove(initializers.pop(weight))
        graph.initializer.extend([_initializer(f"{weight}_int8", codes), _initializer(f"{weight}_scale", scale),
                                  _initializer(f"{weight}_zero_point", torch.zeros(codes.shape[0], dtype=torch.int8))])
        dequantized = f"{weight}_dequantized"
        inserts.setdefault(weight, []).append(helper.make_node(
            "DequantizeLinear", [f"{weight}_int8", f"{weight}_scale", f"{weight}_zero_point"], [dequantized],
            name=f"{weight}_DequantizeLinear", axis=0))
        x = gemm.input[0]
        activation_amax[x] = max(activation_amax.get(x, 0.0), plan.input_amax[module_name])
        rewired.append((gemm, x, dequantized))
    for x, amax in activation_amax.items():
        scale, zero = f"{x}_qdq_scale", f"{x}_qdq_zero_point"
        graph.initializer.extend([_initializer(scale, activation_scale(amax, plan.dtype)),
                                  _initializer(zero, torch.zeros((), dtype=torch.int8))])
        inserts.setdefault(x, []).extend([
            helper.make_node("QuantizeLinear", [x, scale, zero], [f"{x}_quantized"], name=f"{x}_QuantizeLinear"),
            helper.make_node("DequantizeLinear", [f"{x}_quantized", scale, zero], [f"{x}_dequantized"],
                             name=f"{x}_DequantizeLinear")])
    for gemm, x, dequantized in rewired:
        gemm.input[0], gemm.input[1] = f"{x}_dequantized", dequantized
    ordered = []
    for node in graph.node:  # each pair right before the first node that reads it: the order stays topological
        for name in node.input:
            source = name.removesuffix("_dequantized")
            if name.endswith("_dequantized") and source in inserts:
                ordered.extend(inserts.pop(source))
        ordered.append(node)
    del graph.node[:]
    graph.node.extend(ordered)
    return model


def export_vision_qdq(model, grid_thw: tuple[int, int, int], path: Path,
                      pixel_batches: Sequence[torch.Tensor], float_products: Sequence[str] = ()) -> dict:
    """Write the INT8 (Q/DQ) vision graph for one frame pair at ``grid_thw``; returns its manifest entry.

    The float graph is exported as for every backend (``export.export_vision``), converted to opset 19 and
    rewritten by ``insert_qdq`` with the scales ``make_plan`` computed on ``pixel_batches``; the products named in
    ``float_products`` (``block_linears``) are left as exported."""
    import onnx
    from onnx import version_converter

    from edgekv.engines.export import EXTERNAL_DATA_BYTES, export_vision
    from edgekv.engines.graphs import VisionGraph

    graph = VisionGraph(model.visual, grid_thw).eval()
    weight = model.visual.patch_embed.proj.weight

    def run(pixels: torch.Tensor) -> torch.Tensor:
        return graph(pixels.to(device=weight.device, dtype=weight.dtype))

    plan = make_plan(model.visual, run, pixel_batches, block_linears(model.visual, float_products))
    cosine = _token_cosine(model.visual, plan, run, pixel_batches[:CHECK_PAIRS])
    entry = export_vision(model, grid_thw, path)
    proto = onnx.load(str(path), load_external_data=False)
    proto = version_converter.convert_version(proto, QDQ_OPSET)
    onnx.load_external_data_for_model(proto, str(path.parent))
    insert_qdq(proto, plan)
    for name in entry["files"]:
        (path.parent / name).unlink()
    external = proto.ByteSize() > EXTERNAL_DATA_BYTES
    data = path.name + ".data"
    onnx.save_model(proto, str(path), save_as_external_data=external, location=data if external else None)
    entry["files"] = [path.name, *([data] if external else [])]
    entry["opset"] = QDQ_OPSET
    entry["quantization"] = {
        "format": "QuantizeLinear/DequantizeLinear (explicit), INT8, symmetric (zero points 0)",
        "weights": "per output channel", "activations": f"per tensor, {CALIBRATION} calibration",
        "calibration_pairs": plan.pairs, "linears": sorted(plan.weights),
        "float_products": sorted(float_products),  # engines.int8_float_products: left in the graph's dtype
        "token_cosine_min": round(cosine, 6),  # fake-quantized vs float tower on the first calibration pairs
    }
    return entry


def _token_cosine(tower: nn.Module, plan: QuantPlan, run, pixel_batches: Sequence[torch.Tensor]) -> float:
    """The smallest per-token cosine similarity between the float tower's tokens and the fake-quantized tower's."""
    worst = 1.0
    with torch.no_grad():
        for pixels in pixel_batches:
            reference = run(pixels).float()
            with fake_quantized(tower, plan):
                quantized = run(pixels).float()
            worst = min(worst, float(torch.nn.functional.cosine_similarity(reference, quantized, dim=-1).min()))
    return worst


CALIBRATION_LIMIT = 64  # frame pairs read from engines.int8_calibration at most


def calibration_digest(config, memo_file: Path | None = None) -> str | None:
    """What the build key holds of ``engines.int8_calibration`` (None without one): ``calibration_input``'s value."""
    return calibration_input(config, memo_file)[0]


def calibration_input(config, memo_file: Path | None = None) -> tuple[str | None, str | None]:
    """(what the build key holds of ``engines.int8_calibration``, why it could not be taken — None when it was).

    The value is a digest of what decides the frames the scales are computed on — the spec, ``video.fps`` (the
    sampling rate) and the pair limit, and for a file its content (sha256, remembered in ``memo_file`` by size and
    mtime, as the checkpoint's: a load only stats it), for a folder (a ROS 2 bag) every file's; the path is not part
    of it, so a copied deployment keeps its engines. Changing the spec, the file's frames or the rate makes another
    bundle. A file that is not there (an operator cleaned ``/data`` after the build) or cannot be read gives a
    placeholder no bundle was built for, and the reason: a load then takes the bundle whose other fields fit
    (``manifest.locate``), since the clip is only needed to build the engines again. A live source (camera, URL,
    ``gst:``, ``csi:``) is keyed by its spec alone."""
    from edgekv.model.checkpoint_hash import file_digest, read_memo, write_memo

    spec = config.engines.int8_calibration
    if spec is None:
        return None, None
    if spec.startswith("synthetic:"):
        what = f"spec {spec}"
    else:
        path = calibration_path(spec)
        memo = read_memo(memo_file)
        try:
            if path is None:
                what = f"source {spec}"
            elif path.is_file():
                what = f"file sha256 {file_digest(path, memo)}"
            elif path.is_dir():
                files = sorted(f for f in path.rglob("*") if f.is_file())
                what = "folder " + ", ".join(f"{f.relative_to(path)} sha256 {file_digest(f, memo)}" for f in files)
            else:
                return f"{spec} (not found)", f"{spec} is not there"
        except OSError as exc:
            return f"{spec} (unreadable)", f"{spec} cannot be read ({exc.strerror or exc})"
        finally:
            write_memo(memo_file, memo)
    text = f"{what}; fps {config.video.fps}; pairs {CALIBRATION_LIMIT}"
    return hashlib.sha256(text.encode()).hexdigest()[:16], None


def calibration_path(spec: str) -> Path | None:
    """The file or folder an ``engines.int8_calibration`` spec reads (None: a live source, or ``synthetic:``)."""
    text = spec.strip()
    if text.lower().startswith("rosbag:"):
        return Path(text[len("rosbag:"):].partition("?")[0]).expanduser()
    if text.lower().startswith("file://"):
        text = text[len("file://"):]
    head = text.partition("?")[0]
    if not text or head.isdigit() or head.startswith("/dev/") or ":" in text.split("/")[0]:
        return None  # camera index or device, rtsp://, gst:, csi:, synthetic:, ros2:
    return Path(text).expanduser()


def calibration_record(config) -> dict:
    """What the manifest keeps of the calibration input as configured (``Manifest.inputs``): the spec, credentials
    of a URL left out, so that a load whose clip is gone can tell the bundle built from that path among several."""
    from edgekv.video.sources import redact

    spec = config.engines.int8_calibration
    return {} if spec is None else {"int8_calibration": redact(spec)}


def calibration_pixels(config, vision, limit: int = CALIBRATION_LIMIT) -> list[torch.Tensor]:
    """Up to ``limit`` frame pairs of ``engines.int8_calibration`` (a recorded source: a video file or a
    ``synthetic:`` spec), sampled at ``video.fps`` and preprocessed as the session does (``vision``: the
    checkpoint's ``VisionConfig``)."""
    from contextlib import closing

    from edgekv.preprocess import FramePreprocessor
    from edgekv.video.sources import iter_frames

    source = config.engines.int8_calibration
    if source is None:
        raise EngineError("engines.int8_calibration: int8 needs calibration frames (a video file or source spec); "
                          "set it, or choose engines.precision fp16")
    pre = FramePreprocessor(resolution=tuple(config.video.resolution), patch_size=vision.patch_size,
                            temporal_patch_size=vision.temporal_patch_size, merge_size=vision.spatial_merge_size)
    frames, batches = [], []
    try:
        with closing(iter_frames(source, fps=config.video.fps)) as recorded:
            for frame, _ in recorded:
                frames.append(frame)
                if len(frames) == 2:
                    pixels, _ = pre.pair(*frames)
                    batches.append(pixels.clone())  # on the host: moved to the device one pair at a time
                    frames.clear()
                if len(batches) >= limit:
                    break
    except (ValueError, OSError) as exc:  # a live camera cannot be replayed, a file that is not there, ...
        raise EngineError(f"engines.int8_calibration: {exc}") from exc
    if not batches:
        raise EngineError(f"engines.int8_calibration: {source} gave no frame pair")
    return batches
