"""A stand-in for the ``tensorrt`` Python module (TensorRT 10) that keeps the real module's contract, so that
``engines/tensorrt_backend.py`` and ``engines/tensorrt_runtime.py`` can be driven on a machine without TensorRT.

Written from TensorRT's own headers and binding sources at tag v10.3.0 (the version JetPack 6.1/6.2 ships;
NVIDIA/TensorRT commit c5b9de37f7ef9034e2efc621c664145c7c12436e): ``include/NvInferRuntime.h``,
``include/NvInfer.h``, ``python/src/infer/pyCore.cpp``, ``python/docstrings/infer/*.h``. What it enforces, and
where the real API says so:

* ``Builder.create_network(flags)`` takes an int bit mask; ``NetworkDefinitionCreationFlag.STRONGLY_TYPED`` is
  bit 1 (``EXPLICIT_BATCH`` is 0, deprecated and ignored in 10). A strongly typed network refuses the precision
  builder flags (FP16/BF16/INT8/FP8): the build fails, as TensorRT logs and returns None.
* A network with a dynamic input (``-1`` in the ONNX shape) needs an optimization profile giving that input
  ``min <= opt <= max`` of its rank, equal to the static dims; otherwise ``build_serialized_network`` -> None.
* INT8 with a calibrator: ``get_batch(names)`` returns one device pointer per name holding *that input's data
  type* ("device memory containing each network input data", NvInfer.h ``IInt8Calibrator::getBatch``), or None.
* A new builder config has ``BuilderFlag.TF32`` set ("Enabled by default", NvInfer.h ``kTF32``; no other flag);
  ``set_flag`` / ``clear_flag`` / ``get_flag`` and the ``flags`` bit mask work on it. TF32 is not a precision flag
  a strongly typed network refuses. A plan built with it runs as TF32 tensor cores compute (``tf32_graph``): fp32
  MatMul / Gemm / Conv operands rounded to 11 significant bits, as on Orin and every GPU from Ampere on.
* ``IBuilderConfig.int8_calibrator`` (get or set) gives the DeprecationWarning the bindings give ("Deprecated in
  TensorRT 10.1. Superseded by explicit quantization.", pyCore.cpp ``utils::deprecateMember``).
* Explicit quantization (``QuantizeLinear`` / ``DequantizeLinear``, onnx-tensorrt 10.1-GA
  ``onnxOpImporters.cpp`` ``QuantDequantLinearHelper``): every constant scale must be positive ("Scale
  coefficients must all be positive") and every zero point zero ("TensorRT only supports symmetric
  quantization"). A UINT8 or missing zero point TensorRT reads as INT8 where ONNX (and so onnxruntime, which runs
  the stand-in's engines) reads UINT8: the stand-in refuses such a graph, whose engine it could not run as
  TensorRT would. Strongly typed, a ``DequantizeLinear`` outputs its scale's type; at opset 19+ a
  ``QuantizeLinear``'s scale has its input's type (the ONNX schema, which onnxruntime checks). A Q/DQ network is
  built with no precision flag, like every strongly typed one ("Use explicit quantization with Strong Typing.
  Precision-control build flags are not required and should not be specified", developer guide).
* ``Runtime.deserialize_cuda_engine`` returns None for a plan it cannot read.
* A new execution context is on profile 0 (NvInferRuntime.h ``createExecutionContext``);
  ``set_optimization_profile_async`` raises RuntimeError on a bad index (pyCore.cpp).
* ``set_input_shape`` returns False for a name that is not an input, a wrong rank, a dim that differs from a
  static one, or a shape outside the active profile; ``set_tensor_address`` returns False for an unknown name and
  (NvInferRuntime.h: "The pointer must have at least 256-byte alignment") for an address that is not 256-aligned.
* ``infer_shapes`` lists the inputs whose dynamic shape was not set; ``execute_async_v3`` returns False when an
  I/O tensor has no address or an input no shape.

Execution: the engine is the ONNX graph it was "built" from, run with onnxruntime on the host memory behind the
bound addresses, read and written with the engine's data types and shapes. So CPU tensors stand for device
memory: a test binds torch CPU tensors and sees the engine's outputs in them.
"""

from __future__ import annotations

import ctypes
import enum
import json
import warnings
from pathlib import Path

import numpy as np

__version__ = "10.3.0"

ALIGNMENT = 256
PLAN_MAGIC = "fake-tensorrt-plan-v1"


class Logger:
    class Severity(enum.IntEnum):
        INTERNAL_ERROR = 0
        ERROR = 1
        WARNING = 2
        INFO = 3
        VERBOSE = 4

    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = Severity

    def __init__(self, min_severity=Severity.WARNING) -> None:
        self.min_severity = min_severity
        self.messages: list[str] = []

    def log(self, severity, msg: str) -> None:
        self.messages.append(msg)


class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class NetworkDefinitionCreationFlag(enum.IntEnum):
    EXPLICIT_BATCH = 0
    STRONGLY_TYPED = 1


class BuilderFlag(enum.IntEnum):  # NvInfer.h v10.3.0 ``enum class BuilderFlag`` (the values edgekv may touch)
    FP16 = 0
    INT8 = 1
    DEBUG = 2
    GPU_FALLBACK = 3
    REFIT = 4
    DISABLE_TIMING_CACHE = 5
    TF32 = 6  # "Enabled by default"
    SPARSE_WEIGHTS = 7
    OBEY_PRECISION_CONSTRAINTS = 9
    PREFER_PRECISION_CONSTRAINTS = 10
    FP8 = 15
    BF16 = 17
    INT4 = 22


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0


# The reduced-precision flags a strongly typed network refuses. TF32 is not among them: it is no storage type, only
# how FP32 inner products are computed (inputs rounded to 10-bit mantissas), and it is on unless cleared.
PRECISION_FLAGS = {BuilderFlag.FP16, BuilderFlag.INT8, BuilderFlag.BF16, BuilderFlag.FP8, BuilderFlag.INT4}
DEFAULT_FLAGS = {BuilderFlag.TF32}
CALIBRATOR_DEPRECATION = "Deprecated in TensorRT 10.1. Superseded by explicit quantization."
TF32_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose"}  # the inner products TF32 tensor cores compute
TF32_SPLIT = 8193.0  # 2**13 + 1: Veltkamp's split of a 24-bit float32 significand keeps its top 11 bits = TF32's

# ONNX TensorProto element types -> TensorRT data types, and the host (numpy) type of each
ONNX_TYPES = {1: DataType.FLOAT, 10: DataType.HALF, 16: DataType.BF16, 3: DataType.INT8, 6: DataType.INT32,
              7: DataType.INT64, 9: DataType.BOOL, 2: DataType.UINT8}
NUMPY = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8, DataType.INT32: np.int32,
         DataType.INT64: np.int64, DataType.BOOL: np.bool_, DataType.UINT8: np.uint8}


class Dims(tuple):
    """``trt.Dims``: a sequence of ints (-1 = dynamic)."""


class IHostMemory:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self.nbytes = len(data)

    def __buffer__(self, flags):  # Python 3.12+; bytes(IHostMemory) below 3.12 goes through __bytes__
        return memoryview(self._data)

    def __bytes__(self) -> bytes:
        return self._data


class ITensor:
    def __init__(self, name: str, dtype: DataType, shape: tuple, dims: list) -> None:
        self.name, self.dtype, self.shape = name, dtype, Dims(shape)
        self.dims = dims  # the ONNX dims: ints and symbolic names/expressions ("P", "P + 512")


class INetworkDefinition:
    def __init__(self, flags: int) -> None:
        if not isinstance(flags, int) or flags < 0:
            raise TypeError(f"create_network(): flags must be an int bit mask, got {flags!r}")
        self.flags = flags
        self.inputs: list[ITensor] = []
        self.outputs: list[ITensor] = []
        self.onnx_path: str | None = None
        self.qdq_nodes = 0  # QuantizeLinear / DequantizeLinear nodes parsed: an explicitly quantized network

    @property
    def strongly_typed(self) -> bool:
        return bool(self.flags & (1 << int(NetworkDefinitionCreationFlag.STRONGLY_TYPED)))

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)

    def get_input(self, index: int) -> ITensor:
        return self.inputs[index]

    def get_output(self, index: int) -> ITensor:
        return self.outputs[index]


class IParserError:
    def __init__(self, text: str) -> None:
        self.text = text

    def desc(self) -> str:
        return self.text

    def __str__(self) -> str:
        return self.text


class OnnxParser:
    def __init__(self, network: INetworkDefinition, logger: Logger) -> None:
        self.network, self.logger = network, logger
        self.errors: list[IParserError] = []

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, index: int) -> IParserError:
        return self.errors[index]

    def parse_from_file(self, model: str) -> bool:
        import onnx

        try:
            graph = onnx.load(model, load_external_data=False).graph
        except Exception as exc:  # noqa: BLE001 - the real parser reports any read failure as a parser error
            self.errors.append(IParserError(f"ModelImporter: failed to parse {model}: {exc}"))
            return False
        problem = _qdq_problem(graph)
        if problem:
            self.errors.append(IParserError(problem))
            return False
        self.network.qdq_nodes = sum(node.op_type in QDQ_OPS for node in graph.node)
        for source, target in ((graph.input, self.network.inputs), (graph.output, self.network.outputs)):
            for value in source:
                kind = value.type.tensor_type
                if kind.elem_type not in ONNX_TYPES:
                    self.errors.append(IParserError(f"{value.name}: unsupported ONNX type {kind.elem_type}"))
                    return False
                dims = [d.dim_param if d.dim_param else int(d.dim_value) for d in kind.shape.dim]
                shape = tuple(d if isinstance(d, int) else -1 for d in dims)
                target.append(ITensor(value.name, ONNX_TYPES[kind.elem_type], shape, dims))
        self.network.onnx_path = str(Path(model).resolve())
        return True


QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


def _qdq_problem(graph) -> str | None:
    """What TensorRT's ONNX parser (10.1-GA ``QuantDequantLinearHelper``) refuses in a Q/DQ node, or what would make
    the stand-in's onnxruntime run differ from TensorRT (a UINT8 or missing zero point); None if nothing."""
    from onnx import TensorProto, numpy_helper

    constants = {init.name: init for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = node.attribute[0].t
    for node in graph.node:
        if node.op_type not in QDQ_OPS:
            continue
        where = f"{node.op_type} {node.name or node.output[0]}"
        if len(node.input) < 2:
            return f"{where}: requires at least 2 inputs"
        scale = constants.get(node.input[1])
        if scale is not None and not (numpy_helper.to_array(scale).astype(np.float32) > 0).all():
            return f"{where}: Scale coefficients must all be positive"
        zero = constants.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if zero is None:
            if len(node.input) > 2 and node.input[2]:
                continue  # a computed zero point: TensorRT takes it as a tensor
            return (f"{where}: no zero point: TensorRT quantizes to INT8, ONNX (onnxruntime) to UINT8; the stand-in "
                    f"cannot run this graph as TensorRT would")
        if zero.data_type != TensorProto.INT8:
            return (f"{where}: zero point of ONNX type {zero.data_type}: TensorRT uses INT8 instead (it warns), "
                    f"onnxruntime its own type; the stand-in cannot run this graph as TensorRT would")
        if numpy_helper.to_array(zero).any():
            return (f"{where}: TensorRT only supports symmetric quantization. The zero point for the "
                    f"QuantizeLinear/DequantizeLinear operator must be all zeros.")
    return None


class IOptimizationProfile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple[tuple, tuple, tuple]] = {}

    def set_shape(self, input: str, min, opt, max) -> None:  # noqa: A002 - the binding's argument names
        self.shapes[input] = (tuple(int(v) for v in min), tuple(int(v) for v in opt), tuple(int(v) for v in max))


class ITimingCache:
    def __init__(self, data: bytes) -> None:
        self.data = bytes(data) or b"fake-timing-cache"

    def serialize(self) -> IHostMemory:
        return IHostMemory(self.data)


class IInt8EntropyCalibrator2:
    def __init__(self) -> None:
        pass


class IBuilderConfig:
    def __init__(self) -> None:
        self.enabled: set[BuilderFlag] = set(DEFAULT_FLAGS)
        self.pools: dict[MemoryPoolType, int] = {}
        self.profiles: list[IOptimizationProfile] = []
        self._calibrator = None
        self._timing: ITimingCache | None = None

    @property
    def flags(self) -> int:
        """``IBuilderConfig::getFlags``: the bit mask ``1 << flag`` of every flag set (TF32 from the start)."""
        return sum(1 << int(flag) for flag in self.enabled)

    @property
    def int8_calibrator(self):
        warnings.warn(f"Use {CALIBRATOR_DEPRECATION} instead.", DeprecationWarning, stacklevel=2)  # pyCore.cpp
        return self._calibrator

    @int8_calibrator.setter
    def int8_calibrator(self, calibrator) -> None:
        warnings.warn(f"Use {CALIBRATOR_DEPRECATION} instead.", DeprecationWarning, stacklevel=2)
        self._calibrator = calibrator

    def set_flag(self, flag: BuilderFlag) -> None:
        self.enabled.add(BuilderFlag(flag))

    def clear_flag(self, flag: BuilderFlag) -> None:
        self.enabled.discard(BuilderFlag(flag))

    def get_flag(self, flag: BuilderFlag) -> bool:
        return BuilderFlag(flag) in self.enabled

    def set_memory_pool_limit(self, pool: MemoryPoolType, pool_size: int) -> None:
        self.pools[MemoryPoolType(pool)] = int(pool_size)

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1

    def create_timing_cache(self, serialized_timing_cache: bytes) -> ITimingCache:
        return ITimingCache(serialized_timing_cache)

    def set_timing_cache(self, cache: ITimingCache, ignore_mismatch: bool) -> bool:
        self._timing = cache
        return True

    def get_timing_cache(self) -> ITimingCache | None:
        return self._timing


class Builder:
    platform_has_tf32 = True  # Orin (sm_87) and every GPU from Ampere on

    def __init__(self, logger: Logger) -> None:
        self.logger = logger
        self.calibration_reads: list[dict[str, np.ndarray]] = []  # what get_batch pointed at, as the input's type

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        return INetworkDefinition(flags)

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig()

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile()

    def _error(self, text: str) -> None:
        self.logger.log(Logger.ERROR, text)
        return None

    def build_serialized_network(self, network: INetworkDefinition, config: IBuilderConfig) -> IHostMemory | None:
        if network.onnx_path is None:
            return self._error("network has no layers")
        precision = config.enabled & PRECISION_FLAGS
        if network.strongly_typed and precision:
            return self._error(f"strongly typed network: builder flags {sorted(f.name for f in precision)} are not "
                               "allowed")
        names = {t.name for t in network.inputs}
        dynamic = [t for t in network.inputs if -1 in t.shape]
        if dynamic and not config.profiles:
            return self._error("network has dynamic or shape inputs, but no optimization profile has been defined")
        profiles = []
        for index, profile in enumerate(config.profiles):
            unknown = set(profile.shapes) - names
            if unknown:
                return self._error(f"optimization profile {index}: {sorted(unknown)} are not network inputs")
            for tensor in dynamic:
                if tensor.name not in profile.shapes:
                    return self._error(f"optimization profile {index} is missing values for input {tensor.name}")
            for name, triple in profile.shapes.items():
                tensor = next(t for t in network.inputs if t.name == name)
                for shape in triple:
                    if len(shape) != len(tensor.shape) or any(s != d for s, d in zip(shape, tensor.shape) if d != -1):
                        return self._error(f"optimization profile {index}: {name} {shape} does not fit "
                                           f"{tensor.shape}")
                low, best, top = triple
                if not all(a <= b <= c for a, b, c in zip(low, best, top)) or min(low) < 0:
                    return self._error(f"optimization profile {index}: {name} needs min <= opt <= max")
            profiles.append({name: [list(s) for s in triple] for name, triple in profile.shapes.items()})
        if config._calibrator is not None:
            if BuilderFlag.INT8 not in config.enabled:
                return self._error("a calibrator is set without BuilderFlag.INT8")
            if not self._calibrate(network, config._calibrator):
                return None
        io = [{"name": t.name, "mode": int(TensorIOMode.INPUT), "dtype": int(t.dtype), "dims": t.dims}
              for t in network.inputs]
        io += [{"name": t.name, "mode": int(TensorIOMode.OUTPUT), "dtype": int(t.dtype), "dims": t.dims}
               for t in network.outputs]
        if config._timing is not None:
            config._timing.data += b"+"
        plan = {"magic": PLAN_MAGIC, "onnx": network.onnx_path, "io": io, "profiles": profiles or [{}],
                "flags": sorted(flag.name for flag in config.enabled), "qdq_nodes": network.qdq_nodes,
                "strongly_typed": network.strongly_typed,
                "tf32": self.platform_has_tf32 and BuilderFlag.TF32 in config.enabled}
        return IHostMemory(json.dumps(plan).encode())

    def _calibrate(self, network: INetworkDefinition, calibrator) -> bool:
        if network.strongly_typed:
            return self._error("implicit INT8 calibration needs a weakly typed network") is not None
        cache = calibrator.read_calibration_cache()
        if cache:
            return True
        names = [t.name for t in network.inputs]
        batches = 0
        while True:
            pointers = calibrator.get_batch(names)
            if not pointers:
                break
            if len(pointers) != len(names) or not all(isinstance(p, int) for p in pointers):
                return self._error(f"get_batch must return one int device pointer per input {names}, got "
                                   f"{pointers!r}") is not None
            read = {}
            for tensor, pointer in zip(network.inputs, pointers):
                if pointer % ALIGNMENT:
                    return self._error(f"calibration batch for {tensor.name} is not {ALIGNMENT}-byte aligned") \
                        is not None
                read[tensor.name] = host_array(pointer, NUMPY[tensor.dtype], tensor.shape).copy()
            self.calibration_reads.append(read)
            batches += 1
        if not batches:
            return self._error("calibration failure: no batches") is not None
        calibrator.write_calibration_cache(b"fake-calibration-table")
        return True


def host_array(pointer: int, dtype, shape) -> np.ndarray:
    """The memory at ``pointer`` seen as an array (CPU tensors stand for device buffers here)."""
    count = int(np.prod(shape)) if len(shape) else 1
    nbytes = count * np.dtype(dtype).itemsize
    buffer = (ctypes.c_char * nbytes).from_address(pointer)
    return np.frombuffer(buffer, dtype=dtype, count=count).reshape(shape)


class ICudaEngine:
    def __init__(self, plan: dict) -> None:
        self.plan = plan
        self.io = {entry["name"]: entry for entry in plan["io"]}
        self.order = [entry["name"] for entry in plan["io"]]
        self._session = None
        self.contexts: list[IExecutionContext] = []

    @property
    def num_io_tensors(self) -> int:
        return len(self.order)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.plan["profiles"])

    def get_tensor_name(self, index: int) -> str:
        return self.order[index]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        entry = self.io.get(name)
        return TensorIOMode(entry["mode"]) if entry else TensorIOMode.NONE

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType(self.io[name]["dtype"])

    def get_tensor_shape(self, name: str) -> Dims:
        return Dims(d if isinstance(d, int) else -1 for d in self.io[name]["dims"])

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Dims]:
        triple = self.plan["profiles"][profile_index].get(name)
        if triple is None:
            shape = self.get_tensor_shape(name)
            return [shape, shape, shape]
        return [Dims(s) for s in triple]

    def create_execution_context(self) -> IExecutionContext:
        context = IExecutionContext(self)
        self.contexts.append(context)
        return context

    def session(self):
        if self._session is None:
            import onnxruntime as ort

            graph = tf32_graph(self.plan["onnx"]) if self.plan.get("tf32") else self.plan["onnx"]
            self._session = ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
        return self._session


def tf32_graph(path: str) -> bytes:
    """The ONNX graph at ``path`` as a TF32 engine computes it: every float32 operand of an inner product
    (``TF32_OPS``, their first two inputs: a bias is added in FP32) rounded to TF32's 11 significant bits
    first — "rounding the inputs to 10-bit mantissas before multiplying, but accumulates the sum using 23-bit
    mantissas" (NvInfer.h, ``BuilderFlag::kTF32``). The rounding is Veltkamp's split, ``c = x * (2**13 + 1)``,
    ``x_hi = c - (c - x)``, three FP32 operations onnxruntime runs as written."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.shape_inference.infer_shapes(onnx.load(path))
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    types.update({t.name: t.data_type for t in graph.initializer})
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            types[node.output[0]] = node.attribute[0].t.data_type
    graph.initializer.append(helper.make_tensor("tf32_split", TensorProto.FLOAT, [], [TF32_SPLIT]))
    nodes, rounded = [], {}
    for node in graph.node:
        if node.op_type in TF32_OPS:
            for index, name in enumerate(node.input[:2]):
                if types.get(name) != TensorProto.FLOAT:
                    continue
                if name not in rounded:
                    rounded[name] = f"{name}__tf32"
                    nodes += [helper.make_node("Mul", [name, "tf32_split"], [f"{name}__tf32_c"]),
                              helper.make_node("Sub", [f"{name}__tf32_c", name], [f"{name}__tf32_d"]),
                              helper.make_node("Sub", [f"{name}__tf32_c", f"{name}__tf32_d"], [rounded[name]])]
                node.input[index] = rounded[name]
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return model.SerializeToString()


class IExecutionContext:
    def __init__(self, engine: ICudaEngine) -> None:
        self.engine = engine
        self.active_optimization_profile = 0
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}
        self.streams: list[int] = []  # the stream handle of every execute_async_v3

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        if not 0 <= profile_index < self.engine.num_optimization_profiles:
            raise RuntimeError("Error in set optimization profile async.")
        self.active_optimization_profile = profile_index
        self.shapes.clear()
        return True

    def set_input_shape(self, name: str, shape) -> bool:
        if self.engine.get_tensor_mode(name) != TensorIOMode.INPUT:
            return False
        shape = tuple(int(v) for v in shape)
        declared = self.engine.get_tensor_shape(name)
        if len(shape) != len(declared) or any(s != d for s, d in zip(shape, declared) if d != -1):
            return False
        low, _, top = self.engine.get_tensor_profile_shape(name, self.active_optimization_profile)
        if not all(a <= s <= c for a, s, c in zip(low, shape, top)):
            return False
        self.shapes[name] = shape
        return True

    def _symbols(self) -> dict[str, int]:
        symbols = {}
        for name, shape in self.shapes.items():
            for dim, value in zip(self.engine.io[name]["dims"], shape):
                if isinstance(dim, str):
                    symbols[dim] = value
        return symbols

    def get_tensor_shape(self, name: str) -> Dims:
        if self.engine.get_tensor_mode(name) == TensorIOMode.INPUT and name in self.shapes:
            return Dims(self.shapes[name])
        symbols = self._symbols()
        out = []
        for dim in self.engine.io[name]["dims"]:
            if isinstance(dim, int):
                out.append(dim)
            else:
                try:
                    out.append(int(eval(dim, {"__builtins__": {}}, symbols)))  # noqa: S307 - "P + 512" from ONNX
                except NameError:
                    out.append(-1)
        return Dims(out)

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if not isinstance(memory, int) or memory < 0:
            raise TypeError(f"set_tensor_address(): memory must be an int address, got {memory!r}")
        if self.engine.get_tensor_mode(name) == TensorIOMode.NONE or memory % ALIGNMENT:
            return False
        self.addresses[name] = memory
        return True

    def infer_shapes(self) -> list[str]:
        return [name for name in self.engine.order if self.engine.get_tensor_mode(name) == TensorIOMode.INPUT
                and -1 in self.engine.get_tensor_shape(name) and name not in self.shapes]

    def execute_async_v3(self, stream_handle: int) -> bool:
        self.streams.append(int(stream_handle))
        if self.infer_shapes() or any(name not in self.addresses for name in self.engine.order):
            return False
        feeds, outputs = {}, []
        for name in self.engine.order:
            dtype = NUMPY[self.engine.get_tensor_dtype(name)]
            shape = tuple(self.get_tensor_shape(name))
            if self.engine.get_tensor_mode(name) == TensorIOMode.INPUT:
                feeds[name] = host_array(self.addresses[name], dtype, shape).copy()
            else:
                outputs.append((name, dtype, shape))
        results = self.engine.session().run([name for name, _, _ in outputs], feeds)
        for (name, dtype, shape), value in zip(outputs, results):
            if tuple(value.shape) != shape:
                return False
            host_array(self.addresses[name], dtype, shape)[...] = value.astype(dtype)
        return True


class Runtime:
    def __init__(self, logger: Logger) -> None:
        self.logger = logger

    def deserialize_cuda_engine(self, serialized_engine) -> ICudaEngine | None:
        try:
            plan = json.loads(bytes(serialized_engine))
        except (ValueError, UnicodeDecodeError):
            self.logger.log(Logger.ERROR, "deserializeCudaEngine: magic tag does not match")
            return None
        if not isinstance(plan, dict) or plan.get("magic") != PLAN_MAGIC:
            return None
        return ICudaEngine(plan)
