"""`edgekv bench stream` on a chosen device and dtype: the flags reach the runtime, bad values name their flag,
``--sinks`` turns one policy into StateKV and its capped-full twin, and the GPU-memory and energy figures
are computed as documented (hand-made rows; NVML faked at the ``pynvml`` boundary; the CUDA allocator
faked at the bench's own seam). One ``gpu`` test runs the real thing on CUDA. Nothing here asserts a
speed or depends on timing."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

import edgekv
from edgekv.apps.bench import stream
from edgekv.apps.cli import main
from edgekv.monitor.nvml import NvmlEnergy
from edgekv.monitor.tegrastats import ReaderError

# tiny preset at 112x112: 4x4 merged tokens per pair. M = 512 (question room) + the prefix + about 8 pairs,
# so a dozen pairs compress; B = 32 sinks fit beside the prefix and the recent pair.
TOKENS_PER_PAIR = 16
MAX_TOKENS = 680


def bench(tiny_checkpoint, tmp_path, *extra: str) -> tuple[int, dict | None]:
    out = tmp_path / "stream.json"
    code = main(["bench", "stream", "--model", str(tiny_checkpoint), "--frames", "24", "--resolution", "112", "112",
                 "--max-tokens", str(MAX_TOKENS), "--no-hf", "--threads", "1", "--json", str(out),
                 "--plot", str(tmp_path / "stream.png"), *extra])
    return code, (json.loads(out.read_text()) if out.is_file() else None)


# ---------------------------------------------------------------------------------------------- end to end, CPU
def test_device_and_dtype_reach_the_runtime_and_cpu_reports_no_gpu_or_energy(tiny_checkpoint, tmp_path, capsys,
                                                                              monkeypatch):
    seen = []
    original = edgekv.Runtime.from_pretrained.__func__

    def spy(cls, model_dir, **overrides):
        seen.append(overrides["model"])
        return original(cls, model_dir, **overrides)

    monkeypatch.setattr(edgekv.Runtime, "from_pretrained", classmethod(spy))
    code, data = bench(tiny_checkpoint, tmp_path, "--device", "cpu", "--dtype", "bf16", "--policy", "statekv",
                       "--sinks", "32,0")
    assert code == 0
    assert seen == [{"dtype": "bf16", "device": "cpu"}]  # the weights load once for both runs
    printed = capsys.readouterr().out
    assert "edgekv on cpu in bf16" in printed and "phase split synchronized" in printed
    assert "statekv B=0 runs as infinipot_v" in printed and printed.count("energy: not measured") == 2

    summary = data["summary"]
    assert summary["device"] == "cpu" and summary["dtype"] == "bf16" and summary["phase_split_synchronized"] is True
    assert summary["runs"] == ["statekv B=32", "infinipot_v"]
    statekv, capped_full = data["results"]
    assert (statekv["policy"], statekv["sinks"]) == ("statekv", 32)
    assert (capped_full["policy"], capped_full["sinks"]) == ("infinipot_v", 0)
    assert capped_full["prefill_attends"] == "the whole capped cache"
    for result in (statekv, capped_full):
        rows = result["rows"]
        assert len(rows) == 12 and result["summary"]["compressions"] > 0 and result["stats"]["sink_tokens"] == (
            32 if result is statekv else 0)
        assert all(r["ingest_wall_ms"] > 0 and r["tokens_added"] == TOKENS_PER_PAIR for r in rows)
        assert not any(key.startswith("gpu_") for r in rows for key in r) and result["gpu_at_session_start"] is None
        assert "gpu_peak_mb_early" not in result["summary"]
        assert result["energy_j"] is None and result["j_per_frame"] is None and result["j_per_token"] is None
        assert "cpu" in result["energy_unavailable"]
        assert result["energy_frames"] == 24
        assert result["energy_tokens"] == result["stats"]["prefix_tokens"] + 12 * TOKENS_PER_PAIR


def test_statekv_next_to_infinipot_v_is_the_same_pair_of_runs(tiny_checkpoint, tmp_path):
    code, data = bench(tiny_checkpoint, tmp_path, "--frames", "6", "--policy", "statekv,infinipot_v", "--sinks", "32")
    assert code == 0 and data["summary"]["runs"] == ["statekv B=32", "infinipot_v"]


def test_an_8_bit_cache_is_benched_in_fewer_bytes(tiny_checkpoint, tmp_path):
    code, wide = bench(tiny_checkpoint, tmp_path, "--frames", "6", "--dtype", "bf16")
    assert code == 0 and wide["summary"]["kv_dtype"] == "the model's dtype"
    code, narrow = bench(tiny_checkpoint, tmp_path, "--frames", "6", "--dtype", "bf16", "--kv-dtype", "int8")
    assert code == 0 and narrow["summary"]["kv_dtype"] == "int8" and len(narrow["results"][0]["rows"]) == 3
    # 8-bit codes + a bf16 scale a slot and head against 16-bit keys and values, the slots' metadata beside both:
    # 0.66x at the toy's head_dim 16 (the scale is an eighth of a key there)
    assert narrow["results"][0]["stats"]["cache_capacity_bytes"] < 0.7 * wide["results"][0]["stats"]["cache_capacity_bytes"]


def test_the_vision_route_is_recorded_and_a_cpu_graph_refused(tiny_checkpoint, tmp_path, capsys):
    code, data = bench(tiny_checkpoint, tmp_path, "--frames", "4", "--vision-route", "eager")
    assert code == 0 and data["summary"]["vision_route"] == "eager" and "vision tower: eager" in capsys.readouterr().out
    code, _ = bench(tiny_checkpoint, tmp_path, "--frames", "4", "--vision-route", "graph", "--json", str(tmp_path / "x"))
    assert code == 2 and "vision_route: graph: a CUDA graph needs a CUDA device" in capsys.readouterr().err


def test_the_vision_mlp_width_is_chosen_and_recorded(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """--vision-mlp-width sets model.vision_mlp_width; the width the tower ran at is in the summary. The tiny
    tower's 128 is aligned to 8, so the multiple is raised to 48 here (-> 144); on the CPU auto keeps 128."""
    import edgekv.runtime

    monkeypatch.setattr(edgekv.runtime, "VISION_MLP_MULTIPLE", 48)
    for choice, width in (("padded", 144), ("as_loaded", 128), ("auto", 128)):
        code, data = bench(tiny_checkpoint, tmp_path, "--frames", "4", "--vision-mlp-width", choice)
        assert code == 0 and data["summary"]["vision_mlp_width"] == width
        assert f"(MLP width {width})" in capsys.readouterr().out


def test_an_empty_plot_path_writes_no_png(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["bench", "stream", "--model", str(tiny_checkpoint), "--frames", "4", "--resolution", "112", "112",
                 "--no-hf", "--json", "s.json", "--plot", ""])
    assert code == 0 and (tmp_path / "s.json").is_file() and not list(tmp_path.glob("*.png"))


def test_stream_variants():
    assert stream.stream_variants(["statekv"], [1024, 0])[0] == [("statekv", 1024), ("infinipot_v", 0)]
    runs, notes = stream.stream_variants(["statekv", "infinipot_v"], [1024, 0])
    assert runs == [("statekv", 1024), ("infinipot_v", 0)] and any("twice" in n for n in notes)
    runs, notes = stream.stream_variants(["infinipot_v", "full"], [1024])
    assert runs == [("infinipot_v", 0), ("full", 0)] and any("statekv only" in n for n in notes)
    with pytest.raises(ValueError, match="--sinks"):
        stream.stream_variants(["statekv"], None)


# ---------------------------------------------------------------------------------------------- bad values
@pytest.mark.parametrize("flag, value", [("--device", "gpu"), ("--device", "cuda:x"), ("--dtype", "int8"),
                                         ("--sinks", "1k"), ("--sinks", "-1")])
def test_a_bad_value_is_refused_naming_its_flag(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "stream", flag, value, "--json", str(tmp_path / "x.json")])
    assert exit_.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_before_anything_loads(tmp_path, capsys):
    assert main(["bench", "stream", "--device", "cuda", "--no-hf", "--json", str(tmp_path / "x.json")]) == 2
    assert "--device cuda: no CUDA device is available" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_off_cpu_the_transformers_side_must_be_skipped(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(stream, "resolve_bench_device", lambda name: torch.device("cuda"))
    assert main(["bench", "stream", "--device", "cuda", "--json", str(tmp_path / "x.json")]) == 2
    assert "add --no-hf" in capsys.readouterr().err


def test_statekv_without_sinks_is_refused(tmp_path, capsys):
    assert main(["bench", "stream", "--policy", "statekv", "--json", str(tmp_path / "x.json")]) == 2
    assert "--policy statekv needs --sinks" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- GPU + energy plumbing
class FakeMeter:
    """An NVML energy counter that goes up 1 J at every reading."""

    where = "GPU GPU-fake"

    def __init__(self) -> None:
        self.mj, self.closed = 7_000_000, False

    def read_mj(self) -> int:
        self.mj += 1000
        return self.mj

    def close(self) -> None:
        self.closed = True


def test_gpu_and_energy_figures_flow_into_rows_summary_and_print(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    meters = []

    def fake_meter(device):
        meters.append(FakeMeter())
        return meters[-1], None

    monkeypatch.setattr(stream, "energy_meter", fake_meter)
    monkeypatch.setattr(stream, "_gpu_memory",
                        lambda device: {"gpu_allocated_mb": 100.0, "gpu_reserved_mb": 128.0, "gpu_peak_mb": 110.0})
    code, data = bench(tiny_checkpoint, tmp_path, "--policy", "infinipot_v")
    assert code == 0 and len(meters) == 1 and meters[0].closed
    (result,) = data["results"]
    rows, summary = result["rows"], result["summary"]
    n = len(rows)
    # readings: one before the session, one per pair, one at the end -> 1 J each after the first
    assert [r["energy_j"] for r in rows] == [float(i + 1) for i in range(n)]
    assert result["energy_j"] == n + 1.0 and result["energy_source"] == "NVML total energy counter, GPU GPU-fake"
    assert result["j_per_frame"] == pytest.approx((n + 1.0) / (2 * n))
    tokens = result["stats"]["prefix_tokens"] + n * TOKENS_PER_PAIR
    assert result["energy_tokens"] == tokens and result["j_per_token"] == pytest.approx((n + 1.0) / tokens)
    assert result["energy_unavailable"] is None
    first = next(i for i, r in enumerate(rows) if r["compression_ms"] > 0)
    assert summary["energy_j_after_first_compression"] == rows[-1]["energy_j"] - rows[first - 1]["energy_j"]
    assert summary["j_per_frame_after_first_compression"] == pytest.approx(
        summary["energy_j_after_first_compression"] / (2 * (n - first)))
    assert all(r["gpu_peak_mb"] == 110.0 for r in rows) and summary["gpu_peak_late_over_early"] == 1.0
    assert result["gpu_at_session_start"]["gpu_allocated_mb"] == 100.0
    printed = capsys.readouterr().out
    assert "GPU memory: peak 110.0 MiB" in printed and "J/frame" in printed and "J/token" in printed


def test_an_nvml_reading_that_fails_mid_run_drops_the_energy_not_the_run():
    class Flaky(FakeMeter):
        def read_mj(self) -> int:
            if self.mj > 7_001_000:
                raise ReaderError("counter gone")
            return super().read_mj()

    window = stream.EnergyWindow(Flaky(), None)
    window.start()
    assert window.joules() == 1.0
    assert window.joules() is None and "counter gone" in window.why_not and window.meter is None


def test_gpu_memory_summary_compares_the_first_and_last_pairs_after_the_first_compression():
    rows = [{"pair": i, "compressions": 0 if i < 10 else 1 + (i - 10) // 5, "gpu_allocated_mb": 50.0,
             "gpu_peak_mb": 500.0 if i < 10 else 60.0 + (i >= 40)} for i in range(50)]
    got = stream.gpu_memory_summary(rows, window=10)
    assert got["gpu_peak_from"] == "the first compression" and got["gpu_peak_window_pairs"] == 10
    assert got["gpu_peak_mb_early"] == 60.0 and got["gpu_peak_mb_late"] == 61.0  # pairs 10-19 vs 40-49
    assert got["gpu_peak_late_over_early"] == pytest.approx(61.0 / 60.0) and got["gpu_peak_mb_max"] == 500.0
    halves = stream.gpu_memory_summary(rows[:16], window=10)  # 6 pairs after the first compression: 3 vs 3
    assert halves["gpu_peak_window_pairs"] == 3 and halves["gpu_peak_mb_early"] == halves["gpu_peak_mb_late"] == 60.0
    never = stream.gpu_memory_summary([dict(r, compressions=0) for r in rows[:8]], window=10)
    assert never["gpu_peak_from"].startswith("the first pair") and never["gpu_peak_window_pairs"] == 4
    assert stream.gpu_memory_summary([{"pair": 0, "compressions": 0}]) == {}  # CPU rows: nothing to say


def test_wall_compression_estimate_by_hand():
    # pairs at 10 ms; pairs 3 and 7 compress and take 16 and 14 ms; pair 9 (the last) compresses with no next pair
    walls = [10.0, 10.0, 10.0, 16.0, 10.0, 10.0, 10.0, 14.0, 10.0, 30.0]
    counts = [0, 0, 0, 1, 1, 1, 1, 2, 2, 3]
    rows = [{"pair": i, "ingest_wall_ms": w, "compressions": c} for i, (w, c) in enumerate(zip(walls, counts))]
    got = stream.wall_compression_estimate(rows)
    assert got["compression_wall_pairs"] == 2 and got["compression_ms_wall_median"] == pytest.approx(5.0)
    assert got["compression_share_wall"] == pytest.approx(10.0 / sum(walls))
    assert stream.wall_compression_estimate([{"pair": 0, "ingest_ms": 1.0}]) == {}


def test_energy_figures_by_hand():
    got = stream.energy_figures(120.0, 60.0, pairs=30, tokens=20 + 30 * 256)
    assert got["j_per_frame"] == 2.0 and got["mean_power_w"] == 2.0 and got["energy_frames"] == 60
    assert got["j_per_token"] == pytest.approx(120.0 / 7700)
    empty = stream.energy_figures(None, 60.0, pairs=30, tokens=7700)
    assert empty["energy_j"] is None and empty["j_per_frame"] is None and empty["j_per_token"] is None


# ---------------------------------------------------------------------------------------------- NVML (fake pynvml)
class FakeNVMLError(Exception):
    pass


def fake_pynvml(energy=None, uuids=("GPU-1234",), supported=True) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    module.NVMLError = FakeNVMLError
    module.calls = []
    readings = iter(energy or [])

    def handle_by_uuid(uuid):
        if uuid not in uuids:
            raise FakeNVMLError("Not Found")
        return ("uuid", uuid)

    def total_energy(handle):
        module.calls.append(handle)
        if not supported:
            raise FakeNVMLError("Not Supported")
        value = next(readings, None)
        if value is None:
            raise FakeNVMLError("GPU is lost")
        return value

    module.nvmlInit = lambda: module.calls.append("init")
    module.nvmlShutdown = lambda: module.calls.append("shutdown")
    module.nvmlDeviceGetHandleByIndex = lambda index: ("index", index)
    module.nvmlDeviceGetHandleByUUID = handle_by_uuid
    module.nvmlDeviceGetTotalEnergyConsumption = total_energy
    return module


def test_nvml_energy_reads_the_total_energy_counter(monkeypatch):
    nvml = fake_pynvml(energy=[1_000, 1_000, 251_500])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    meter = NvmlEnergy(uuid="GPU-1234")  # the first reading checks the counter is there
    assert meter.where == "GPU GPU-1234"
    before, after = meter.read_mj(), meter.read_mj()
    assert after - before == 250_500 and nvml.calls[1] == ("uuid", "GPU-1234")
    with pytest.raises(ReaderError, match="did not answer: GPU is lost"):
        meter.read_mj()
    meter.close()
    assert nvml.calls[-1] == "shutdown"
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(energy=[5, 6]))
    by_index = NvmlEnergy(index=1)
    assert by_index.where == "NVML GPU index 1" and by_index.read_mj() == 6


def test_nvml_energy_unavailable_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(supported=False))
    with pytest.raises(ReaderError, match="no total energy counter for GPU 0: Not Supported"):
        NvmlEnergy(index=0)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(energy=[1]))
    with pytest.raises(ReaderError, match="GPU GPU-other: Not Found"):
        NvmlEnergy(uuid="GPU-other")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    with pytest.raises(ReaderError, match="nvidia-ml-py"):
        NvmlEnergy()


def test_energy_meter_on_cpu_says_why():
    meter, why = stream.energy_meter(torch.device("cpu"))
    assert meter is None and "cpu" in why


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_stream_reports_gpu_memory_per_pair(tiny_checkpoint, tmp_path, capsys):
    code, data = bench(tiny_checkpoint, tmp_path, "--frames", "8", "--device", "cuda", "--dtype", "bf16",
                       "--policy", "statekv", "--sinks", "32,0")
    assert code == 0
    assert data["summary"]["phase_split_synchronized"] is True and data["summary"]["device"].startswith("cuda")
    for result in data["results"]:
        assert len(result["rows"]) == 4
        for r in result["rows"]:
            assert r["gpu_allocated_mb"] > 0 and r["gpu_peak_mb"] >= r["gpu_allocated_mb"] > 0
        assert (result["energy_j"] is None) == (result["energy_unavailable"] is not None)
    assert "phase split synchronized" in capsys.readouterr().out


def test_a_run_that_fails_keeps_the_others_figures_and_exits_non_zero(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    original = stream._run_edgekv

    def out_of_memory_for_statekv(runtime, frames, args, policy, sinks):
        if policy == "statekv":
            raise RuntimeError("CUDA out of memory (simulated)")
        return original(runtime, frames, args, policy, sinks)

    monkeypatch.setattr(stream, "_run_edgekv", out_of_memory_for_statekv)
    code, data = bench(tiny_checkpoint, tmp_path, "--frames", "6", "--policy", "statekv", "--sinks", "32,0")
    assert code == 1
    failed, capped_full = data["results"]
    assert "out of memory" in failed["failed"] and failed["rows"] == [] and len(capped_full["rows"]) == 3
    assert "failed runs: statekv B=32" in capsys.readouterr().out


def test_the_bench_session_synchronizes_its_phases(tiny_checkpoint, monkeypatch):
    """The stream bench turns on ``session.sync_phases``; ingest then asks the device to synchronize at each phase
    boundary (on CUDA: here a fake device type stands in, and the sync is counted, not run)."""
    import numpy as np

    import edgekv
    from edgekv.session import ingest as ingest_module

    rt = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cpu", "dtype": "fp32"},
                                        video={"resolution": [56, 56]}, cache={"max_tokens": 1024})
    session = rt.session()
    calls = []
    monkeypatch.setattr(ingest_module.torch.cuda, "synchronize", lambda device=None: calls.append(device))

    class FakeCuda:
        type = "cuda"

    frame = np.zeros((56, 56, 3), dtype=np.uint8)
    session.ingest(frame, t=0.0)
    session.ingest(frame, t=0.5)
    assert calls == []  # off by default: a service never stalls on a sync
    session.sync_phases = True
    real = session.device
    session.device = FakeCuda()
    try:
        session.ingestor._mark()
        session.ingestor._mark()
    finally:
        session.device = real
    assert len(calls) == 2
