"""Every kernel in edgekv.kernels against its torch reference.

On a CUDA machine the tests run the compiled kernels (small odd shapes, plus the ``gpu`` tests at the
Qwen2.5-VL-3B shapes). On CPU the kernels run in Triton's interpreter, which must be chosen before
Triton is imported (``edgekv.kernels._triton``): in a process started with ``TRITON_INTERPRET=1`` the
tests run here; otherwise ``test_kernels_in_triton_interpreter`` reads this module's outcome from a
subprocess with it set (one for every kernel module: ``helpers_interpreter.py``), so that the variable
never leaks into other test modules.

Tolerance (flash-attention's rule): max |kernel - fp64 reference| <= 2 x max |same-precision torch run -
fp64 reference| + floor. The same-precision run is the eager reference computed in the input dtype
(fp16 / bf16 scores, softmax and P·V; fp32 for fp32 inputs) — for TaR/VaN, whose math is fp32 whatever
the input dtype, it is the fp32 reference. The floor, two fp32 ulps of the largest reference value,
absorbs summation-order differences where the torch run happens to be exact (fp32 inputs: the torch
run is then the fp32 reference itself). Copies (compaction) and masked keys must be exact.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgekv.attention import attention_with_mass
from edgekv.cache import CacheSpec, CappedKVCache, ChunkMeta, SlotKind
from edgekv.kernels import attention_mass, compact_, triton_available, use_triton
from edgekv.kernels._triton import interpreting
from edgekv.kernels.attention_mass import attention_mass_reference, attention_mass_triton, chunk_mask
from edgekv.kernels.compaction import METADATA_FIELDS, compact_reference_, compact_triton_
from edgekv.kernels.decode_attention import decode_attention_triton
from edgekv.kernels.decode_fused import add_rms_norm, rope_rows, rope_write, silu_mul, silu_mul_rows
from edgekv.kernels.quant_attention import quantized_attention_reference, quantized_attention_triton
from edgekv.kernels.tar import VISION_KIND, tar_scores_reference, tar_scores_triton
from edgekv.kernels.van import (
    layer_cv_reference,
    layer_cv_triton,
    pooled_van_reference,
    pooled_van_triton,
    value_norms_reference,
    value_norms_triton,
)
from edgekv.model.rope import rotary_inv_freq
from helpers_interpreter import interpreted_run

INTERPRETED = interpreting()
CUDA = torch.cuda.is_available() and not INTERPRETED
DEVICE = torch.device("cuda" if CUDA else "cpu")
RUN_HERE = triton_available() and (CUDA or INTERPRETED)
ULPS = 2  # the floor of the tolerance, in fp32 ulps of the largest reference value
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

needs_triton = pytest.mark.skipif(
    not RUN_HERE, reason="no Triton here: runs in test_kernels_in_triton_interpreter's subprocess (or triton is missing)"
)
requires_cuda = pytest.mark.skipif(not (CUDA and triton_available()), reason="needs CUDA and triton")


@pytest.fixture(autouse=True)
def no_forced_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EDGEKV_TRITON", raising=False)


@pytest.mark.skipif(RUN_HERE or not triton_available(), reason="the kernels run in this process")
def test_kernels_in_triton_interpreter(request: pytest.FixtureRequest) -> None:
    run = interpreted_run(request.config.rootpath, request.config.getoption("markexpr"))
    outcomes = run.outcomes(__file__)
    print(run.output[-4000:])
    assert run.returncode in (0, 1) and outcomes.get("passed") and not outcomes.keys() & {"failed", "error"}, \
        f"interpreter run failed ({outcomes.get('failed', [])} {outcomes.get('error', [])}):\n{run.output[-16000:]}"


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0


def assert_within_2x(result: torch.Tensor, same_precision: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    err, base = max_err(result, reference), max_err(same_precision, reference)
    scale = reference.abs().max().item() if reference.numel() else 0.0
    floor = ULPS * torch.finfo(torch.float32).eps * max(1.0, scale)
    assert err <= 2 * base + floor, f"{what}: kernel error {err:.3g} > 2 x torch error {base:.3g} + {floor:.2g}"


def check_op(kernel, reference, args: tuple, what: str) -> torch.Tensor:
    """kernel(*args) against reference(*args) in fp64, with reference(*args) (fp32) as the torch run."""
    got = kernel(*args)
    assert_within_2x(got, reference(*args), reference(*args, compute_dtype=torch.float64), what)
    return got


# ---------------------------------------------------------------------------------------------- attention
def attention_inputs(heads_q, heads_kv, num_new, start, dim, capacity, dtype, visible_share, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(heads_q, num_new, dim, generator=gen) * 1.5  # peaky enough that softmax matters
    k = torch.randn(heads_kv, capacity, dim, generator=gen)
    v = torch.randn(heads_kv, capacity, dim, generator=gen)
    k[:, start + num_new:] = float("nan")  # slots past the valid prefix must never be read (v: NaN would reach out)
    v[:, start + num_new:] = float("nan")
    visible = None if visible_share is None else torch.rand(heads_kv, start, generator=gen) < visible_share
    to = dict(device=DEVICE, dtype=dtype)
    return q.to(**to), k.to(**to), v.to(**to), None if visible is None else visible.to(DEVICE)


def check_attention(q, k, v, start, visible):
    out, mass = attention_mass_triton(q, k, v, start=start, visible=visible)
    ref_out, ref_mass = attention_mass_reference(q, k, v, start=start, visible=visible, compute_dtype=torch.float64)
    same_out, same_mass = attention_mass_reference(q, k, v, start=start, visible=visible, compute_dtype=q.dtype)
    assert out.dtype == q.dtype and mass.dtype == torch.float32
    assert mass.shape == (k.shape[0], start + q.shape[1])
    assert_within_2x(out, same_out, ref_out, f"out {q.dtype}")
    assert_within_2x(mass, same_mass, ref_mass, f"mass {q.dtype}")
    if visible is not None:
        assert (mass[:, :start][~visible] == 0).all(), "invisible keys must get exactly zero mass"
    # each query's probabilities sum to 1, averaged over the group: total mass = P per KV head
    total = torch.full((k.shape[0],), float(q.shape[1]), dtype=torch.float64, device=DEVICE)
    torch.testing.assert_close(mass.sum(1).double(), total, rtol=1e-4, atol=0)
    return out, mass


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads_q,heads_kv", [(2, 2), (8, 2), (8, 1)], ids=["gqa1", "gqa4", "gqa8"])
def test_attention_mass_odd_shapes_partly_filled(dtype, heads_q, heads_kv):
    # P, start, N, D all off powers of two; the cache holds 70 slots of which N = 56 are valid
    q, k, v, visible = attention_inputs(heads_q, heads_kv, num_new=19, start=37, dim=24, capacity=70, dtype=dtype,
                                        visible_share=0.6)
    check_attention(q, k, v, 37, visible)


@needs_triton
@pytest.mark.parametrize(
    "num_new,start,dim,capacity,visible_share",
    [(33, 0, 16, 33, None), (8, 50, 64, 58, None), (21, 45, 40, 80, 0.0), (17, 90, 32, 107, 0.3)],
    ids=["chunk-only", "full-cache-all-visible", "nothing-committed-visible", "first-blocks-invisible"],
)
def test_attention_mass_masks(num_new, start, dim, capacity, visible_share):
    q, k, v, visible = attention_inputs(4, 2, num_new, start, dim, capacity, torch.float16, visible_share, seed=1)
    if visible is not None and start > 64:
        visible[:, :64] = False  # whole key blocks with nothing visible: the online softmax must not NaN
    out, _ = check_attention(q, k, v, start, visible)
    assert torch.isfinite(out).all()


@needs_triton
@pytest.mark.parametrize("split", [2, 4, 8, 3])
def test_attention_mass_split_over_query_heads_and_smaller_query_blocks(split):
    """``mass_split`` shares a KV head's 8 query heads among programs (each writes its part, summed after in a
    fixed order) and ``forward_block_m`` shrinks pass 1's query block (issue 32: at the 3B shape both passes ran
    42-64 programs on 132 multiprocessors): the same attention and mass as one program a KV head; a split that
    does not divide G (3) runs as one; a block that is not a tile size is refused by name."""
    q, k, v, visible = attention_inputs(16, 2, 19, 37, 24, 70, torch.float32, 0.6, seed=4)
    out, mass = attention_mass_triton(q, k, v, start=37, visible=visible)
    for forward_block_m in (16, 32):
        got_out, got_mass = attention_mass_triton(q, k, v, start=37, visible=visible, mass_split=split,
                                                  forward_block_m=forward_block_m)
        torch.testing.assert_close(got_out, out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_mass, mass, rtol=1e-5, atol=1e-6)
        assert (got_mass[:, :37][~visible] == 0).all()
    mass_out = torch.full((2, 80), -1.0, device=DEVICE)
    _, written = attention_mass_triton(q, k, v, start=37, visible=visible, mass_out=mass_out, mass_split=split)
    assert written.data_ptr() == mass_out.data_ptr() and (mass_out[:, 56:] == -1.0).all()
    torch.testing.assert_close(mass_out[:, :56], mass, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="forward_block_m must be 16, 32, 64 or 128, got 48"):
        attention_mass_triton(q, k, v, start=37, visible=visible, forward_block_m=48)


@needs_triton
def test_attention_mass_writes_mass_out_in_place():
    q, k, v, visible = attention_inputs(8, 2, 11, 20, 32, 40, torch.float32, 0.5, seed=2)
    mass_out = torch.full((2, 40), -1.0, device=DEVICE)
    _, mass = attention_mass_triton(q, k, v, start=20, visible=visible, mass_out=mass_out)
    assert mass.data_ptr() == mass_out.data_ptr()
    assert (mass_out[:, 31:] == -1.0).all()
    _, ref = attention_mass_reference(q, k, v, start=20, visible=visible)
    torch.testing.assert_close(mass_out[:, :31], ref, rtol=1e-5, atol=1e-6)


def test_attention_reference_matches_attention_with_mass():
    q, k, v, visible = attention_inputs(8, 2, 13, 29, 16, 50, torch.float32, 0.5, seed=3)
    group = q.shape[0] // k.shape[0]
    mask = chunk_mask(29, 13, visible, 2, DEVICE).repeat_interleave(group, dim=0)  # [Hq, P, N], as CacheAttention
    out, mass = attention_with_mass(q, k[:, :42], v[:, :42], mask)
    ref_out, ref_mass = attention_mass_reference(q, k, v, start=29, visible=visible)
    torch.testing.assert_close(ref_out, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ref_mass, mass, rtol=1e-6, atol=1e-6)


@needs_triton
def test_dispatch_rule(monkeypatch):
    x = torch.zeros(1, device=DEVICE)
    assert use_triton(x)  # CUDA tensors, or the interpreter on CPU
    monkeypatch.setenv("EDGEKV_TRITON", "0")
    assert not use_triton(x)
    q, k, v, visible = attention_inputs(4, 2, 5, 6, 8, 11, torch.float32, 0.5)
    out, mass = attention_mass(q, k, v, start=6, visible=visible)
    ref_out, ref_mass = attention_mass_reference(q, k, v, start=6, visible=visible)
    assert torch.equal(out, ref_out) and torch.equal(mass, ref_mass)


def test_ops_import_and_run_without_triton():
    # sys.modules["triton"] = None makes `import triton` fail, as on an install without it
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from edgekv import kernels\n"
        "assert not kernels.triton_available() and not kernels.use_triton(torch.zeros(1))\n"
        "q = torch.randn(4, 3, 8); k = torch.randn(2, 9, 8)\n"
        "out, mass = kernels.attention_mass(q, k, k, start=6)\n"
        "assert out.shape == (4, 3, 8) and mass.shape == (2, 9)\n"
        "assert kernels.value_norms(k[None]).shape == (1, 2, 9)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def test_vision_kind_matches_the_cache():
    assert VISION_KIND == int(SlotKind.VISION)


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_attention_mass_head_dim_128(dtype):
    q, k, v, visible = attention_inputs(8, 1, 70, 150, 128, 240, dtype, 0.5, seed=4)
    check_attention(q, k, v, 150, visible)


# ---------------------------------------------------------------------------------------------- slot metadata
def toy_slots(layers, heads, grid, pairs, recent_pairs, prefix=3, past_kept=0.6, seed=0):
    """Metadata of a cache after compactions: per (layer, head) a different subset of the past pairs'
    cells survives (same count everywhere), recent pairs whole, a prefix and two text slots around them."""
    gen = torch.Generator().manual_seed(seed)
    cells = grid[0] * grid[1]
    past = (pairs - recent_pairs) * cells
    kept = int(past_kept * past)
    rows = []
    for _ in range(layers * heads):
        chosen = torch.randperm(past, generator=gen)[:kept].sort().values
        vision = torch.cat([chosen, torch.arange(past, pairs * cells)])
        slots = [(int(SlotKind.PREFIX), -1, -1, -1, i) for i in range(prefix)]
        for s in vision.tolist():  # large temporal positions: the sin/cos must hold far from 0
            slots.append((VISION_KIND, s // cells, s % cells // grid[1], s % grid[1], 5000 + 37 * (s // cells)))
        slots += [(int(SlotKind.TEXT), -1, -1, -1, 5000 + 37 * pairs + i) for i in range(2)]
        rows.append(torch.tensor(slots, dtype=torch.int64))
    table = torch.stack(rows).view(layers, heads, -1, 5)
    kind, frame, row, col, tpos = table.unbind(-1)
    vision = kind == VISION_KIND
    recent = vision & (frame > pairs - 1 - recent_pairs)
    meta = dict(kind=kind.to(torch.int8), frame=frame.to(torch.int32), row=row.to(torch.int16), col=col.to(torch.int16),
                tpos=tpos.to(torch.int32), recent=recent, vision=vision)
    return {name: t.to(DEVICE) for name, t in meta.items()}


def cache_tensor(layers, heads, n, capacity, dim, dtype, seed):
    """The valid prefix [L, H, n, D] of a [L, H, capacity, D] buffer (a strided view, as policies get it)."""
    buf = torch.randn(layers, heads, capacity, dim, generator=torch.Generator().manual_seed(seed))
    buf[:, :, n:] = float("nan")
    return buf.to(device=DEVICE, dtype=dtype)[:, :, :n]


# ---------------------------------------------------------------------------------------------- 8-bit attention
CODES = [torch.int8, torch.float8_e4m3fn]


def quantized_inputs(heads_q, heads_kv, num_new, start, dim, capacity, dtype, codes, temporal_section, seed=0):
    from edgekv.cache.quant import quantize

    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(heads_q, num_new, dim, generator=gen) * 1.5).to(device=DEVICE, dtype=dtype)
    k_codes, k_scale = quantize(torch.randn(heads_kv, capacity, dim, generator=gen) * 2, codes)
    v_codes, v_scale = quantize(torch.randn(heads_kv, capacity, dim, generator=gen), codes)
    tpos = torch.randint(0, 8000, (heads_kv, capacity), generator=gen)
    inv_freq = rotary_inv_freq(dim, 1_000_000.0, torch.device("cpu"))
    to = dict(device=DEVICE)
    return (q, k_codes.to(**to), k_scale.to(**to), v_codes.to(**to), v_scale.to(**to), tpos.to(**to),
            inv_freq.to(**to), temporal_section)


def check_quantized_attention(args, start):
    out = quantized_attention_triton(*args, start=start)
    reference = quantized_attention_reference(*args, start=start, compute_dtype=torch.float64)
    same = quantized_attention_reference(*args, start=start)  # the cache's torch path, in q's dtype
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    assert_within_2x(out, same, reference, f"8-bit attention {args[1].dtype} {args[0].dtype}")


@needs_triton
@pytest.mark.parametrize("codes", CODES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads_q,heads_kv,num_new,start,dim,capacity,section", [
    (4, 2, 1, 37, 16, 64, 2),    # the toy's decode step: head_dim 16, GQA 2
    (8, 2, 5, 20, 32, 40, 4),    # a chunk: causal inside, G * P = 20 folded rows over two query blocks
    (4, 1, 3, 0, 24, 8, 3),      # nothing committed yet; head_dim not a power of two
    (2, 2, 1, 70, 16, 80, 0),    # no temporal section: no rotation at all
    (8, 2, 5, 100, 32, 128, 4),  # a chunk over keys cut into 4 splits (flash-decoding), causal in the last
    (8, 2, 32, 40, 16, 96, 3),   # G x P = 128 folded rows: the keys dequantized once, then SDPA
], ids=["decode", "chunk", "empty", "no-time", "split-chunk", "dequantized"])
def test_quantized_attention(codes, dtype, heads_q, heads_kv, num_new, start, dim, capacity, section):
    args = quantized_inputs(heads_q, heads_kv, num_new, start, dim, capacity, dtype, codes, section)
    check_quantized_attention(args, start)


@needs_triton
@pytest.mark.parametrize("codes", CODES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_dequantize_kernel_makes_the_torch_paths_copy(codes, dtype):
    """A wide chunk's keys and values dequantized in one kernel = the cache's torch path (values bit for bit; keys
    to one ulp: the rotation's cos/sin are the kernel's, not torch's)."""
    from edgekv.cache.quant import dequantize
    from edgekv.kernels.quant_attention import dequantized_keys_values
    from edgekv.positions import rotate_temporal

    q, k_codes, k_scale, v_codes, v_scale, tpos, inv_freq, section = quantized_inputs(
        4, 2, 1, 60, 32, 80, dtype, codes, 6, seed=4)
    fp8 = codes == torch.float8_e4m3fn
    views = (k_codes.view(torch.uint8), v_codes.view(torch.uint8)) if fp8 else (k_codes, v_codes)
    keys, values = dequantized_keys_values(views[0], k_scale, views[1], v_scale, tpos, inv_freq.float(), section, 61,
                                           dtype, fp8)
    want_k = rotate_temporal(dequantize(k_codes[:, :61], k_scale[:, :61], torch.float32), tpos[:, :61], inv_freq,
                             section).to(dtype)
    assert keys.dtype == values.dtype == dtype and keys.shape == (2, 61, 32)
    assert torch.equal(values, dequantize(v_codes[:, :61], v_scale[:, :61], dtype))
    ulp = torch.finfo(dtype).eps * want_k.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((keys.float() - want_k.float()).abs() <= ulp).all()


@needs_triton
def test_quantized_attention_decodes_every_fp8_code():
    """One query that sees only its own slot returns that slot's value: every e4m3fn bit pattern (NaN included)
    decoded in the kernel equals torch's cast, 16 codes per call."""
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    inv_freq = rotary_inv_freq(16, 1_000_000.0, torch.device("cpu")).to(DEVICE)
    for row in patterns.view(16, 16):
        codes = row.view(1, 1, 16).to(DEVICE)
        scale = torch.ones(1, 1, dtype=torch.bfloat16, device=DEVICE)
        tpos = torch.zeros(1, 1, dtype=torch.int64, device=DEVICE)
        q = torch.zeros(1, 1, 16, device=DEVICE)
        out = quantized_attention_triton(q, torch.zeros_like(codes), scale, codes, scale, tpos, inv_freq, 2, start=0)
        expected = row.to(torch.float32).to(DEVICE)
        assert torch.equal(out.view(16).isnan(), expected.isnan())
        assert torch.equal(out.view(16)[~expected.isnan()], expected[~expected.isnan()])


@needs_triton
@pytest.mark.parametrize("codes", ["int8", "fp8"])
def test_cache_attention_reads_an_8_bit_cache_in_the_kernel(codes, monkeypatch):
    """A prefill chunk then decode steps through ``CacheAttention`` on an 8-bit cache: the kernel path (no
    dequantized copy) against the torch path (``EDGEKV_TRITON=0``) on the same cache contents."""
    from edgekv.attention import CacheAttention
    from edgekv.cache.specs import KV_DTYPES

    dtype = KV_DTYPES[codes]
    spec = CacheSpec.uniform(2, 2, 16, dtype)
    results = {}
    for backend in ("1", "0"):
        monkeypatch.setenv("EDGEKV_TRITON", backend)
        gen = torch.Generator().manual_seed(5)
        cache = CappedKVCache(spec, 32, device=DEVICE, compute_dtype=torch.float32,
                              rope=(rotary_inv_freq(16, 1_000_000.0, DEVICE), 2))
        outs = []
        for start, num_new in ((0, 12), (12, 1), (13, 1)):
            cache.write_meta(start, num_new, ChunkMeta(SlotKind.VISION, frame=0,
                                                       tpos=torch.arange(start, start + num_new) * 7))
            attend = CacheAttention(cache, start, num_new)
            for layer in range(2):
                q, k, v = (torch.randn(h, num_new, 16, generator=gen).to(DEVICE) for h in (4, 2, 2))
                outs.append(attend(layer, q, k, v))
            cache.commit(num_new)
        results[backend] = outs
    for got, expected in zip(results["1"], results["0"]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- TaR
def tar_metadata(meta: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return meta["tpos"], meta["frame"], meta["row"], meta["col"], meta["kind"], meta["recent"]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("unrotated", [True, False], ids=["unrotated", "raw"])
def test_tar_scores(dtype, unrotated):
    grid, dim, temporal = (3, 5), 24, 4  # D/2 = 12 pairs, padded to 16
    meta = toy_slots(2, 3, grid, pairs=5, recent_pairs=2, seed=5)
    n = meta["kind"].shape[2]
    k = cache_tensor(2, 3, n, n + 9, dim, dtype, seed=6)
    inv_freq = rotary_inv_freq(dim, 10000.0, DEVICE)
    got = check_op(tar_scores_triton, tar_scores_reference, (k, *tar_metadata(meta), grid, inv_freq, temporal, unrotated),
                   f"TaR {dtype}")
    assert got.shape == meta["kind"].shape and got.dtype == torch.float32
    assert (got[~meta["vision"]] == 0).all()
    assert (got[meta["vision"]] != 0).any()


# ---------------------------------------------------------------------------------------------- VaN
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_value_norms(dtype):
    v = cache_tensor(3, 2, 45, 51, 40, dtype, seed=7)  # D = 40 padded to 64
    check_op(value_norms_triton, value_norms_reference, (v,), f"VaN {dtype}")


@needs_triton
def test_layer_cv():
    meta = toy_slots(3, 2, (4, 4), pairs=6, recent_pairs=1, seed=8)
    norms = value_norms_reference(cache_tensor(3, 2, meta["kind"].shape[2], 90, 16, torch.float32, seed=9)) + 3.0
    norms[2] = 1.0  # a constant layer: CV exactly 0
    got = check_op(layer_cv_triton, layer_cv_reference, (norms, meta["vision"]), "CV")
    assert got[2] == 0


@needs_triton
@pytest.mark.parametrize("zero_padded", [False, True], ids=["present", "zeros"])
@pytest.mark.parametrize("sizes", [[7, 3, 1, 5], [1, 1, 1, 1], [5, 5, 7, 3]], ids=["mixed", "none", "large"])
def test_pooled_van(sizes, zero_padded):
    grid = (4, 6)
    meta = toy_slots(4, 2, grid, pairs=5, recent_pairs=1, past_kept=0.5, seed=10)
    n = meta["kind"].shape[2]
    norms = value_norms_reference(cache_tensor(4, 2, n, n, 16, torch.float32, seed=11))
    args = (norms, meta["frame"], meta["row"], meta["col"], meta["vision"], grid, sizes)
    got = check_op(lambda *a: pooled_van_triton(*a, zero_padded=zero_padded),
                   lambda *a, **kw: pooled_van_reference(*a, zero_padded=zero_padded, **kw), args,
                   f"pooled VaN {sizes} zero_padded={zero_padded}")
    assert torch.equal(got[~meta["vision"]], norms[~meta["vision"]])
    for layer, size in enumerate(sizes):
        if size == 1:
            assert torch.equal(got[layer], norms[layer])


@needs_triton
def test_pooled_van_in_frame_chunks(monkeypatch):
    """The kernel's dense planes over a few frames a pass (``POOL_CELLS`` small) pool every slot as one pass does
    (each cell holds one slot of one frame: the same sums in any order)."""
    from edgekv.kernels import van as van_module

    grid, sizes = (4, 6), [3, 1, 3, 1]  # small windows: the interpreter reads k^2 cells a slot
    meta = toy_slots(4, 2, grid, pairs=6, recent_pairs=1, past_kept=0.5, seed=12)
    n = meta["kind"].shape[2]
    norms = value_norms_reference(cache_tensor(4, 2, n, n, 16, torch.float32, seed=13))
    args = (norms, meta["frame"], meta["row"], meta["col"], meta["vision"], grid, sizes)
    whole = pooled_van_triton(*args)  # one pass (test_pooled_van holds the one-pass kernel to the reference)
    monkeypatch.setattr(van_module, "POOL_CELLS", 200)  # 2 frames a pass (4 pooled heads x 24 cells a frame)
    assert van_module.frame_chunks(7, 4 * 24) == (2, 4)
    chunked = pooled_van_triton(*args)
    assert torch.equal(chunked, whole) and not torch.equal(chunked, norms)


# ---------------------------------------------------------------------------------------------- compaction
def filled_cache(layers=2, heads=3, capacity=40, dim=24, length=31, dtype=torch.bfloat16, seed=12):
    spec = CacheSpec.uniform(layers, heads, dim, dtype)
    cache = CappedKVCache(spec, capacity, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    start, frame = 0, 0
    while start < length:
        num = min(6, length - start)
        cells = torch.arange(num)
        meta = ChunkMeta(SlotKind.VISION, frame=frame, rows=cells // 3, cols=cells % 3, tpos=torch.full((num,), 100 + frame))
        for layer in range(layers):
            kv = torch.randn(2, heads, num, dim, generator=gen).to(dtype)
            cache.write_layer(layer, start, kv[0].to(DEVICE), kv[1].to(DEVICE))
        cache.write_meta(start, num, meta)
        cache.commit(num)
        start, frame = start + num, frame + 1
    cache.sink[..., ::5] = True
    cache.row[:, :, length + 2] = 7  # stale metadata past the length (left by a truncate): reset like the cache does
    return cache


def random_keep(layers, heads, length, kept, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(length, generator=gen)[:kept].sort().values for _ in range(layers * heads)]
    return torch.stack(rows).view(layers, heads, kept)


def buffers(cache: CappedKVCache) -> dict[str, torch.Tensor]:
    return {"k": cache.k.clone(), "v": cache.v.clone(), **{name: getattr(cache, name).clone() for name in METADATA_FIELDS}}


def check_compaction(keep: torch.Tensor) -> None:
    cache = filled_cache()
    mine = buffers(cache)
    cache.compact(keep)  # the contract: exactly what CappedKVCache.compact leaves
    k, v = mine.pop("k"), mine.pop("v")
    compact_triton_(k, v, keep.to(DEVICE), **mine)
    for name, expected in buffers(cache).items():
        got = k if name == "k" else v if name == "v" else mine[name]
        assert torch.equal(got, expected), f"{name} differs after compaction"


@needs_triton
@pytest.mark.parametrize("kind", ["random", "identity", "drop-first", "empty"])
def test_compaction_matches_capped_cache(kind):
    layers, heads, length = 2, 3, 31
    if kind == "random":
        keep = random_keep(layers, heads, length, 23, seed=13)
    elif kind == "identity":  # every source is its own destination: the in-block aliasing case
        keep = torch.arange(length).expand(layers, heads, -1).contiguous()
    elif kind == "drop-first":
        keep = torch.arange(1, length).expand(layers, heads, -1).contiguous()
    else:
        keep = torch.empty(layers, heads, 0, dtype=torch.int64)
    check_compaction(keep)


@needs_triton
@settings(max_examples=12, deadline=None)
@given(kept=st.integers(1, 31), seed=st.integers(0, 10_000))
def test_compaction_random_keeps(kept, seed):
    check_compaction(random_keep(2, 3, 31, kept, seed))


def test_compaction_reference_without_scratch_matches_cache():
    cache = filled_cache()
    mine = buffers(cache)
    keep = random_keep(2, 3, 31, 17, seed=14)
    cache.compact(keep)
    k, v = mine.pop("k"), mine.pop("v")
    compact_reference_(k, v, keep.to(DEVICE), **mine)
    assert torch.equal(k, cache.k) and torch.equal(v, cache.v)
    assert all(torch.equal(mine[name], getattr(cache, name)) for name in METADATA_FIELDS)


@needs_triton
def test_compaction_op_dispatches_in_place():
    cache = filled_cache()
    keep = random_keep(2, 3, 31, 9, seed=15)
    expected = buffers(cache)
    k, v = expected.pop("k"), expected.pop("v")
    compact_reference_(k, v, keep.to(DEVICE), **expected)
    ptr = cache.k.data_ptr()
    compact_(cache.k, cache.v, keep.to(DEVICE), **{name: getattr(cache, name) for name in METADATA_FIELDS})
    assert cache.k.data_ptr() == ptr and torch.equal(cache.k, k) and torch.equal(cache.v, v)
    assert all(torch.equal(getattr(cache, name), expected[name]) for name in METADATA_FIELDS)


# ---------------------------------------------------------------------------------------------- int8 cache write
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim,section", [(32, 4), (40, 6)])
def test_quantize_write_is_torchs_codes(dtype, dim, section):
    """One launch writes an int8 cache's chunk (keys turned back to time-neutral, absmax scale rounded to bf16,
    codes rounded half to even) as the torch path does: the same scales and codes, but where the interpreter's
    trig differs from torch's in the last bit and moves a code across a tie (at most one step, rarely)."""
    from edgekv.kernels.quant_write import quantize_write_reference, quantize_write_triton
    from edgekv.model.rope import rotary_inv_freq

    gen = torch.Generator().manual_seed(41)
    heads, rows, capacity = 2, 9, 20
    k = (torch.randn(heads, rows, dim, generator=gen) * 2).to(DEVICE, dtype)
    v = (torch.randn(heads, rows, dim, generator=gen) * 2).to(DEVICE, dtype)
    v[1, 3] = 0.0  # an all-zero row: the tiny scale, codes 0
    tpos = torch.randint(0, 6000, (heads, capacity), generator=gen, dtype=torch.int32).to(DEVICE)
    inv_freq = rotary_inv_freq(dim, 1_000_000.0, DEVICE)
    codes = torch.zeros(2, heads, capacity, dim, dtype=torch.int8, device=DEVICE)
    scales = torch.zeros(2, heads, capacity, dtype=torch.bfloat16, device=DEVICE)
    start = 7
    quantize_write_triton(k, v, tpos[:, start:start + rows], inv_freq, section, codes[0, :, start:start + rows],
                          scales[0, :, start:start + rows], codes[1, :, start:start + rows], scales[1, :, start:start + rows])
    kq, ks, vq, vs = quantize_write_reference(k, v, tpos[:, start:start + rows], inv_freq, section)
    assert torch.equal(scales[0, :, start:start + rows], ks) and torch.equal(scales[1, :, start:start + rows], vs)
    assert torch.equal(codes[1, :, start:start + rows], vq)
    moved = codes[0, :, start:start + rows].int() - kq.int()
    assert moved.abs().max() <= 1 and (moved != 0).float().mean() <= 0.01
    untouched = torch.ones(capacity, dtype=torch.bool)
    untouched[start:start + rows] = False
    assert not codes[:, :, untouched].any() and not scales[:, :, untouched].any()  # nothing outside the chunk


@needs_triton
def test_quantize_write_rounds_ties_to_even():
    """Values that land exactly on .5 after the scale round to the even code, as torch.round does."""
    from edgekv.kernels.quant_write import quantize_write_reference, quantize_write_triton

    scale = 1.0078125  # bf16(127 / 127 * (1 + 2^-7)): the scale of a row whose absmax is 127
    v = torch.zeros(1, 1, 8)
    v[0, 0, :6] = torch.tensor([127.0, 0.5 * scale, 1.5 * scale, 2.5 * scale, -0.5 * scale, -2.5 * scale])
    k = torch.zeros_like(v)
    tpos = torch.zeros(1, 1, dtype=torch.int32)
    inv_freq = torch.ones(4)
    out_codes = torch.zeros(2, 1, 1, 8, dtype=torch.int8, device=DEVICE)
    out_scales = torch.zeros(2, 1, 1, dtype=torch.bfloat16, device=DEVICE)
    quantize_write_triton(k.to(DEVICE), v.to(DEVICE), tpos.to(DEVICE), inv_freq, 1, out_codes[0], out_scales[0],
                          out_codes[1], out_scales[1])
    _, _, vq, vs = quantize_write_reference(k, v, tpos, inv_freq, 1)
    assert torch.equal(out_codes[1].cpu(), vq) and torch.equal(out_scales[1].cpu(), vs)
    assert out_scales[1, 0, 0].item() == scale and out_codes[1, 0, 0, :6].tolist() == [126, 0, 2, 2, 0, -2]


# ---------------------------------------------------------------------------------------------- compiled, no GPU
def launches_of_every_kernel() -> None:
    """Call each launcher once on CPU tensors at 3B-like shapes (the launches are recorded, not run)."""
    for dtype, heads_q, visible in ((torch.bfloat16, 16, True), (torch.float32, 2, False)):
        q = torch.zeros(heads_q, 256, 128, dtype=dtype)
        k = torch.zeros(2, 6144, 128, dtype=dtype)
        attention_mass_triton(q, k, k, start=1000, visible=torch.ones(2, 1000, dtype=torch.bool) if visible else None)
        if heads_q == 16:  # the tuning knobs tools/gpu/attention_mass_3b.py times (pass 2 split, pass 1 blocks of 32)
            attention_mass_triton(q, k, k, start=1000, visible=torch.ones(2, 1000, dtype=torch.bool), mass_split=4,
                                  forward_block_m=32)
    meta = toy_slots(2, 2, (4, 4), pairs=3, recent_pairs=1)
    n = meta["kind"].shape[2]
    k = torch.zeros(2, 2, n, 128, dtype=torch.bfloat16)
    tar_scores_triton(k, *tar_metadata(meta), (4, 4), torch.ones(64), 16, True)
    norms = value_norms_triton(k)
    layer_cv_triton(norms, meta["vision"])
    pooled_van_triton(norms, meta["frame"], meta["row"], meta["col"], meta["vision"], (4, 4), [7, 1])
    fields = {name: meta[name] for name in ("kind", "frame", "row", "col", "tpos")}
    compact_triton_(k, k.clone(), torch.arange(n - 3).expand(2, 2, -1), sink=torch.zeros_like(meta["vision"]), **fields)
    for codes in CODES:  # the 8-bit cache's decode (split + combine) and a frame pair (dequantized once)
        for num_new, start in ((1, 2047), (256, 2048)):
            args = quantized_inputs(16, 2, num_new, start, 128, 6144, torch.bfloat16, codes, 16)
            quantized_attention_triton(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], start=start)
    # the decode graph's split attention over a bf16 cache (partials + combine) and its fused small work
    decode_attention_triton(torch.zeros(16, 1, 128, dtype=torch.bfloat16), *torch.zeros(2, 2, 6144, 128,
                            dtype=torch.bfloat16), torch.tensor([3000]))
    hidden = torch.zeros(1, 2048, dtype=torch.bfloat16)
    add_rms_norm(hidden, hidden.clone(), torch.ones(2048, dtype=torch.bfloat16), 1e-6)
    silu_mul(torch.zeros(11008, dtype=torch.bfloat16), torch.zeros(11008, dtype=torch.bfloat16))
    cache = torch.zeros(2, 2, 6144, 128, dtype=torch.bfloat16)
    rope_write(torch.zeros(2048, dtype=torch.bfloat16), *torch.zeros(2, 256, dtype=torch.bfloat16),
               *torch.ones(2, 128, dtype=torch.bfloat16), cache[0], cache[1], torch.tensor([5]))
    # the fused chunk layers (model.prefill_route: fused): a frame pair's 256 rows
    rope_rows(torch.zeros(256, 2560, dtype=torch.bfloat16), 16, 2, *torch.ones(2, 256, 128, dtype=torch.bfloat16))
    gate_up = torch.zeros(256, 22016, dtype=torch.bfloat16)
    silu_mul_rows(gate_up[:, :11008], gate_up[:, 11008:])
    # an int8 cache's write of a frame pair (one layer: 2 KV heads x 256 rows, keys and values)
    from edgekv.kernels.quant_write import quantize_write_triton

    codes = torch.zeros(2, 2, 6144, 128, dtype=torch.int8)
    scales = torch.zeros(2, 2, 6144, dtype=torch.bfloat16)
    quantize_write_triton(*torch.zeros(2, 2, 256, 128, dtype=torch.bfloat16), torch.zeros(2, 256, dtype=torch.int32),
                          torch.ones(64), 16, codes[0, :, :256], scales[0, :, :256], codes[1, :, :256], scales[1, :, :256])


@pytest.mark.slow
@pytest.mark.skipif(not triton_available() or INTERPRETED, reason="needs Triton's compiler, not its interpreter")
def test_kernels_compile_for_jetson_orin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU, still build every kernel down to a cubin for sm_87 (Jetson Orin): the interpreter
    does not type-check what the compiler does (scalar and block masks, loop-carried types, libdevice)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, mangle_type

    from edgekv.kernels import tar as tar_module

    launches = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kw: launches.append((self, args, kw)))
    monkeypatch.setattr(tar_module, "precise_trig", lambda: True)  # what a CUDA launch uses
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    launches_of_every_kernel()
    assert len(launches) == 27  # 25 + the attention-mass passes with their tuning knobs set
    for fn, args, kwargs in launches:
        bound = {**dict(zip(fn.arg_names, args)), **{key: v for key, v in kwargs.items() if key in fn.arg_names}}
        signature, constants = {}, {}
        for param in fn.params:
            value = bound[param.name]
            if param.is_constexpr or (type(value) is int and value == 1):  # Triton specializes ints equal to 1
                signature[param.name], constants[param.name] = "constexpr", value
            else:
                signature[param.name] = mangle_type(value)
        options = {key: v for key, v in kwargs.items() if key not in fn.arg_names}
        compiled = triton.compile(ASTSource(fn, signature, constexprs=constants), target=GPUTarget("cuda", 87, 32), options=options)
        assert compiled.asm["cubin"], fn.__name__


# ---------------------------------------------------------------------------------------------- GPU, 3B shapes
# Qwen2.5-VL-3B: 36 layers, 16 query heads, 2 KV heads, head_dim 128; a 448x448 frame pair = 16x16 = 256
# merged tokens; mrope_section[0] = 16 temporal rotary frequencies; M up to 6144.
LAYERS, HEADS_Q, HEADS_KV, HEAD_DIM, GRID_3B, PAIR = 36, 16, 2, 128, (16, 16), 256


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("start", [256, 2048, 6144 - 256])
def test_gpu_attention_mass_3b(dtype, start):
    q, k, v, visible = attention_inputs(HEADS_Q, HEADS_KV, PAIR, start, HEAD_DIM, 6144, dtype, 0.7, seed=16)
    check_attention(q, k, v, start, visible)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("split,block_m", [(2, 64), (4, 32), (8, 16)])
def test_gpu_attention_mass_knobs_3b(split, block_m):
    """The occupancy knobs at the gathered StateKV shape (1,044 visible keys and a pair): the attention and mass
    of the shipped launch, within the reference's error."""
    q, k, v, _ = attention_inputs(HEADS_Q, HEADS_KV, PAIR, 1044, HEAD_DIM, 1044 + PAIR, torch.bfloat16, None, seed=22)
    out, mass = attention_mass_triton(q, k, v, start=1044)
    got_out, got_mass = attention_mass_triton(q, k, v, start=1044, mass_split=split, forward_block_m=block_m)
    ref_out, ref_mass = attention_mass_reference(q, k, v, start=1044, compute_dtype=torch.float64)
    assert_within_2x(got_out, out, ref_out, f"out, split {split}, block_m {block_m}")
    assert_within_2x(got_mass, mass, ref_mass, f"mass, split {split}, block_m {block_m}")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("codes", CODES, ids=str)
@pytest.mark.parametrize("num_new,start", [(1, 6143), (PAIR, 2048)], ids=["decode", "pair"])
def test_gpu_quantized_attention_3b(codes, num_new, start):
    args = quantized_inputs(HEADS_Q, HEADS_KV, num_new, start, HEAD_DIM, 6144, torch.bfloat16, codes, 16, seed=21)
    check_quantized_attention(args, start)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_policy_kernels_3b(dtype):
    meta = toy_slots(LAYERS, HEADS_KV, GRID_3B, pairs=20, recent_pairs=2, prefix=64, past_kept=0.9, seed=17)
    n = meta["kind"].shape[2]
    k = cache_tensor(LAYERS, HEADS_KV, n, 6144, HEAD_DIM, dtype, seed=18)
    v = cache_tensor(LAYERS, HEADS_KV, n, 6144, HEAD_DIM, dtype, seed=19)
    inv_freq = rotary_inv_freq(HEAD_DIM, 1_000_000.0, DEVICE)
    check_op(tar_scores_triton, tar_scores_reference, (k, *tar_metadata(meta), GRID_3B, inv_freq, 16, True), "TaR 3B")
    norms = check_op(value_norms_triton, value_norms_reference, (v,), "VaN 3B")
    check_op(layer_cv_triton, layer_cv_reference, (norms, meta["vision"]), "CV 3B")
    sizes = [7, 5, 3, 1] * (LAYERS // 4)
    pool = (norms, meta["frame"], meta["row"], meta["col"], meta["vision"], GRID_3B, sizes)
    check_op(pooled_van_triton, pooled_van_reference, pool, "pooled VaN 3B")


@pytest.mark.gpu
@requires_cuda
def test_gpu_compaction_3b():
    length, capacity = 6144 - 256, 6144
    gen = torch.Generator().manual_seed(20)
    k = torch.randn(LAYERS, HEADS_KV, capacity, HEAD_DIM, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn_like(k)
    meta = {name: torch.randint(-1, 100, (LAYERS, HEADS_KV, capacity), generator=gen).to(DEVICE) for name in METADATA_FIELDS}
    meta = {"kind": meta["kind"].to(torch.int8), "sink": meta["sink"] > 50, "frame": meta["frame"].to(torch.int32),
            "row": meta["row"].to(torch.int16), "col": meta["col"].to(torch.int16), "tpos": meta["tpos"].to(torch.int32)}
    keep = random_keep(LAYERS, HEADS_KV, length, 4608, seed=21).to(DEVICE)
    ref = {name: t.clone() for name, t in meta.items()}
    ref_k, ref_v = k.clone(), v.clone()
    compact_reference_(ref_k, ref_v, keep, **ref)
    compact_triton_(k, v, keep, **meta)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    assert all(torch.equal(meta[name], ref[name]) for name in METADATA_FIELDS)


@pytest.mark.parametrize("unrotated", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tar_fast_torch_path_equals_reference(unrotated, dtype):
    """The CPU path (``tar_scores_torch``: norms from raw keys, R from the recent slots only, the inverse
    rotation moved onto the gathered reference) computes the reference's eq. 4 up to fp32 rounding."""
    from edgekv.kernels.tar import tar_scores_torch
    from edgekv.model.rope import rotary_inv_freq

    g = torch.Generator().manual_seed(7)
    layers, heads, n, dim, grid, section = 3, 2, 257, 32, (4, 5), 4
    k = (torch.randn(layers, heads, n, dim, generator=g) * 3).to(dtype)
    k[0, 0, 5] = 0  # a zero key: both clamp the norm the same way
    tpos = torch.randint(0, 6000, (layers, heads, n), generator=g)
    row = torch.randint(0, grid[0], (layers, heads, n), generator=g)
    col = torch.randint(0, grid[1], (layers, heads, n), generator=g)
    kind = torch.where(torch.rand(layers, heads, n, generator=g) < 0.85, VISION_KIND, 1)
    row[kind != VISION_KIND] = -1  # text slots carry no cell
    recent = (torch.rand(layers, heads, n, generator=g) < 0.15) & (kind == VISION_KIND)
    recent[2, 1] = False  # a (layer, head) with no recent slot: every reference is 0
    frame = torch.zeros(layers, heads, n, dtype=torch.long)
    inv_freq = rotary_inv_freq(dim, 1e6, device="cpu")
    args = (k, tpos, frame, row, col, kind, recent, grid, inv_freq, section, unrotated)
    want, got = tar_scores_reference(*args), tar_scores_torch(*args)
    assert got.dtype == torch.float32 and got.shape == (layers, heads, n)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert torch.all(got[kind != VISION_KIND] == 0) and torch.all(got[2, 1] == 0)


def test_tar_torch_path_without_rotation_table_equals_reference():
    """Negative temporal positions (never produced by the cache, but legal input) take the per-slot
    cos/sin branch of ``tar_scores_torch`` instead of the cached table: still eq. 4."""
    from edgekv.kernels.tar import tar_scores_torch

    meta = toy_slots(2, 2, (3, 4), pairs=5, recent_pairs=2, seed=31)
    n = meta["kind"].shape[2]
    k = cache_tensor(2, 2, n, n + 3, 32, torch.float32, seed=32)
    inv_freq = rotary_inv_freq(32, 1e6, "cpu")
    tpos = meta["tpos"] - 6000  # every slot negative
    args = (k, tpos, meta["frame"], meta["row"], meta["col"], meta["kind"], meta["recent"], (3, 4), inv_freq, 4, True)
    torch.testing.assert_close(tar_scores_torch(*args), tar_scores_reference(*args), atol=2e-6, rtol=1e-5)


def test_rotation_table_is_the_direct_evaluation_bit_for_bit():
    from edgekv.kernels import tar as tar_module

    inv_freq = rotary_inv_freq(128, 1e6, "cpu")[:16]
    cos, sin = tar_module.rotation_table(inv_freq, 3000)
    assert cos.shape[0] >= 3000 and cos.shape == sin.shape and cos.shape[1] == 16
    angle = torch.arange(cos.shape[0], dtype=torch.float32).unsqueeze(-1) * inv_freq
    assert torch.equal(cos, torch.cos(angle)) and torch.equal(sin, torch.sin(angle))
    assert tar_module.rotation_table(inv_freq, 100)[0] is cos  # cached: a shorter request reuses it
    grown = tar_module.rotation_table(inv_freq, cos.shape[0] + 1)[0]  # a longer one grows it
    assert grown.shape[0] > cos.shape[0] and torch.equal(grown[: cos.shape[0]], cos)


@pytest.mark.parametrize("sparse", [False, True], ids=["pair-numbers", "sparse-numbers"])
def test_frame_ranks_equal_unique(sparse):
    from edgekv.kernels.van import frame_ranks

    meta = toy_slots(3, 2, (4, 5), pairs=7, recent_pairs=2, past_kept=0.4, seed=33)
    frame = meta["frame"].long() * (10**7 if sparse else 3)  # sparse: beyond the presence table, torch.unique
    values, want = torch.unique(frame.masked_fill(~meta["vision"], -1), return_inverse=True)
    got, count = frame_ranks(frame, meta["vision"])
    assert count == values.numel() and torch.equal(got, want)
    empty, none = frame_ranks(frame[:, :, :0], meta["vision"][:, :, :0])
    assert none == 0 and empty.shape == (3, 2, 0)


@pytest.mark.parametrize("path", ["slot-windows", "dense-planes"])
@pytest.mark.parametrize("sizes", [[7, 3, 1, 5], [1, 1, 1, 1], [5, 5, 7, 3], [3, 3, 3, 3]], ids=str)
def test_pooled_van_cpu_path_is_the_reference_bit_for_bit(monkeypatch, sizes, path):
    """``pooled_van_torch`` (CPU) adds each window's cells in avg_pool2d's order: the same bits, on both
    sides of its dispatch rule (windows read at the slots / the reference's pooling of whole planes), with
    frames thinned unevenly per (layer, head) as compactions leave them, and sparse frame numbers."""
    from edgekv.kernels import van as van_module

    monkeypatch.setattr(van_module, "_DENSE_PLANES_PER_SLOT", 0 if path == "slot-windows" else 10**6)
    monkeypatch.setattr(van_module, "_WINDOW_READS", 1000)  # several gather chunks
    grid = (4, 6)
    for seed, sparse in ((34, False), (35, True)):
        # on the host even where CUDA is (the GPU's avg_pool2d adds in another order): this is the CPU path
        meta = {name: t.cpu() for name, t in toy_slots(4, 2, grid, pairs=9, recent_pairs=2, past_kept=0.3, seed=seed).items()}
        n = meta["kind"].shape[2]
        norms = value_norms_reference(cache_tensor(4, 2, n, n, 16, torch.float32, seed=seed + 10).cpu())
        frame = meta["frame"] * 1000003 if sparse else meta["frame"]
        args = (norms, frame, meta["row"], meta["col"], meta["vision"], grid, sizes)
        got = van_module.pooled_van_torch(*args)
        assert torch.equal(got, pooled_van_reference(*args))
        assert torch.equal(got[~meta["vision"]], norms[~meta["vision"]])
        zeros = van_module.pooled_van_torch(*args, zero_padded=True)
        assert torch.equal(zeros, pooled_van_reference(*args, zero_padded=True))
        if set(sizes) != {1}:  # absent cells count as zeros: never above the mean over present cells
            assert (zeros <= got + 1e-6).all() and (zeros < got - 1e-6).any()
    if set(sizes) != {1}:
        assert not torch.equal(got, norms)  # pooling changed something


@pytest.mark.parametrize("sizes", [[7, 3, 1, 5], [3, 3, 3, 3]], ids=str)
def test_pooled_van_cpu_path_in_frame_chunks_is_the_same_bits(monkeypatch, sizes):
    """Dense planes over a few frames at a time (``POOL_CELLS`` small: many passes) give the reference's bits."""
    from edgekv.kernels import van as van_module

    monkeypatch.setattr(van_module, "_DENSE_PLANES_PER_SLOT", 0)
    grid = (4, 6)
    meta = {name: t.cpu() for name, t in toy_slots(4, 2, grid, pairs=9, recent_pairs=2, past_kept=0.3, seed=37).items()}
    n = meta["kind"].shape[2]
    norms = value_norms_reference(cache_tensor(4, 2, n, n, 16, torch.float32, seed=38).cpu())
    args = (norms, meta["frame"], meta["row"], meta["col"], meta["vision"], grid, sizes)
    for cells in (1, 200, 10**6):  # one frame a pass (the floor), a few frames, all of them at once
        monkeypatch.setattr(van_module, "POOL_CELLS", cells)
        for zero_padded in (False, True):
            assert torch.equal(van_module.pooled_van_torch(*args, zero_padded=zero_padded),
                               pooled_van_reference(*args, zero_padded=zero_padded)), (cells, zero_padded)


def test_frame_chunks_bound_the_planes():
    from edgekv.kernels.van import POOL_CELLS, frame_chunks

    assert frame_chunks(0, 512) == (0, 0) or frame_chunks(0, 512)[1] == 0
    for frames, cells in [(1, 512), (48, 18432), (3600, 18432), (3600, 512), (5, 10**8)]:
        per_chunk, chunks = frame_chunks(frames, cells)
        assert per_chunk * (chunks - 1) < frames <= per_chunk * chunks
        assert per_chunk == 1 or per_chunk * cells <= POOL_CELLS
    assert frame_chunks(3600, 72 * 256) == (113, 32)  # every 3B layer pooling, 3,600 distinct frames held


def test_the_pooling_memory_does_not_grow_with_the_frames_held(monkeypatch):
    """The dense planes cover the distinct frames the cache still holds, a count that grows with the stream
    under StateKV and TaR/VaN (issue 32: ~135 MiB more over 1,000 3B pairs). Passes over chunks of frames keep
    the largest tensor the pooling makes the same for 50 and for 800 distinct frames."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from edgekv.kernels import van as van_module

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.numel() > 0:
                    Largest.largest = max(Largest.largest, t.numel() * t.element_size())
            return out

    monkeypatch.setattr(van_module, "_DENSE_PLANES_PER_SLOT", 0)
    monkeypatch.setattr(van_module, "POOL_CELLS", 1 << 14)
    layers, heads, n, grid = 3, 2, 800, (16, 16)
    largest = {}
    for frames in (50, 800):
        gen = torch.Generator().manual_seed(frames)
        frame = torch.randint(0, frames, (layers, heads, n), generator=gen, dtype=torch.int32)
        frame[..., :frames] = torch.arange(frames, dtype=torch.int32)  # every frame held somewhere
        row = torch.randint(0, grid[0], (layers, heads, n), generator=gen, dtype=torch.int16)
        col = torch.randint(0, grid[1], (layers, heads, n), generator=gen, dtype=torch.int16)
        vision = torch.ones(layers, heads, n, dtype=torch.bool)
        norms = torch.rand(layers, heads, n, generator=gen)
        Largest.largest = 0
        with Largest():
            van_module.pooled_van_torch(norms, frame, row, col, vision, grid, [5, 3, 7])
        largest[frames] = Largest.largest
    slot_bytes = layers * heads * n * 8 * 2  # [L, H, n, 2] fp32 sources and int64 metadata: the cache's own size
    assert largest[800] <= max(largest[50], 2 * 4 * (1 << 14), slot_bytes), largest


def test_pooled_van_cpu_path_refuses_wrong_pool_sizes():
    from edgekv.kernels.van import pooled_van_torch

    meta = toy_slots(2, 1, (3, 3), pairs=3, recent_pairs=1, seed=36)
    norms = torch.rand(meta["kind"].shape)
    with pytest.raises(ValueError, match="one pool size per layer: 2 layers, 3 sizes"):
        pooled_van_torch(norms, meta["frame"], meta["row"], meta["col"], meta["vision"], (3, 3), [3, 3, 3])


@pytest.mark.gpu
@requires_cuda
def test_gpu_quantize_write_3b():
    """The int8 cache's one-launch write at the 3B shape (a frame pair, one layer) against the torch path on CUDA:
    libdevice trig against torch's, precise division, no fused multiply-adds."""
    from edgekv.kernels.quant_write import quantize_write_reference, quantize_write_triton
    from edgekv.model.rope import rotary_inv_freq

    gen = torch.Generator().manual_seed(43)
    k, v = (torch.randn(2, HEADS_KV, PAIR, HEAD_DIM, generator=gen) * 3).to(DEVICE, torch.bfloat16)
    tpos = torch.randint(0, 60_000, (HEADS_KV, PAIR), generator=gen, dtype=torch.int32).to(DEVICE)
    inv_freq = rotary_inv_freq(HEAD_DIM, 1_000_000.0, DEVICE)
    codes = torch.zeros(2, HEADS_KV, PAIR, HEAD_DIM, dtype=torch.int8, device=DEVICE)
    scales = torch.zeros(2, HEADS_KV, PAIR, dtype=torch.bfloat16, device=DEVICE)
    quantize_write_triton(k, v, tpos, inv_freq, 16, codes[0], scales[0], codes[1], scales[1])
    kq, ks, vq, vs = quantize_write_reference(k, v, tpos, inv_freq, 16)
    assert torch.equal(scales[1], vs) and torch.equal(codes[1], vq)
    assert (scales[0] != ks).float().mean() <= 0.01
    moved = codes[0].int() - kq.int()
    assert moved.abs().max() <= 1 and (moved != 0).float().mean() <= 1e-3
