"""`edgekv plan` on the real Qwen2.5-VL-3B shape (config.json only, no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgekv.apps.cli import main
from edgekv.calibration.plan import check_config, plan
from edgekv.model.tiny import PRESETS


@pytest.fixture
def model_3b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["3b"].config.to_hf_dict()))
    return tmp_path


def test_bytes_per_token_is_the_3b_kv_shape_plus_metadata(model_3b):
    result = plan(64, model_3b)
    kv = 2 * 36 * 2 * 128 * 2                # K and V, 36 layers, 2 KV heads, head_dim 128, bf16
    metadata = 36 * 2 * 14 + 128 * 2 + 2 * 14  # slot metadata + compaction scratch
    assert result.bytes_per_token == kv + metadata
    assert 3.5 < result.weight_bytes / 2**30 < 7.5  # ~3.75 B parameters in bf16
    assert result.tokens_per_pair == 256


def test_monotone_in_device_memory_and_clear_when_too_small(model_3b):
    sizes = [plan(gb, model_3b).max_tokens for gb in (10, 11, 12)]
    assert sizes[0] < sizes[1] < sizes[2]
    with pytest.raises(ValueError, match="short by"):
        plan(6, model_3b)


def test_impossible_inputs_are_refused_by_name(model_3b, capsys):
    """A negative device or reserve, a zero weight size and a grid the vision tower cannot cut were planned as if
    meant (a 100-pixel side as 3 merged patches)."""
    with pytest.raises(ValueError, match="the device memory must be positive .*got -1"):
        plan(-1, model_3b)
    with pytest.raises(ValueError, match="the reserve must be 0 or more .*; the resolution's width 100 is not a "
                                         "positive multiple of 28"):
        plan(64, model_3b, resolution=(448, 100), reserve_gb=-2)
    with pytest.raises(ValueError, match="the weights' size must be positive"):
        plan(64, model_3b, weights_gb=0)
    assert main(["plan", "--device-memory", "0", "--model", str(model_3b)]) == 2
    assert "edgekv plan: the device memory must be positive (GB), got 0.0" in capsys.readouterr().err


def test_plan_checks_the_shipped_demo_config(capsys):
    """`--config configs/cpu-demo.yaml` (model.path builtin:toy) failed: 'builtin:toy/config.json: no config.json'."""
    demo = Path(__file__).resolve().parents[1] / "configs" / "cpu-demo.yaml"
    assert main(["plan", "--device-memory", "8", "--config", str(demo)]) == 0
    assert f"{demo}: cache.max_tokens 640 fits" in capsys.readouterr().out
    # and with --model builtin:toy beside it: the flash lines read the builtin's config.json too (they failed so)
    assert main(["plan", "--device-memory", "8", "--config", str(demo), "--model", "builtin:toy"]) == 0
    assert "a frame pair of 16 tokens is" in capsys.readouterr().out


def test_plan_command_prints_the_budget(model_3b, capsys):
    assert main(["plan", "--device-memory", "64", "--model", str(model_3b)]) == 0
    out = capsys.readouterr().out
    assert "cache.max_tokens:" in out and "not measured on a device" in out


def test_quantized_weights_let_an_8gb_device_fit_and_big_devices_cap_at_the_position_range(model_3b):
    small = plan(8, model_3b, weights_gb=2.9)
    assert small.max_tokens > 2 * small.tokens_per_pair + small.text_reserve_tokens
    assert plan(6, model_3b, weights_gb=2.9).max_tokens < small.max_tokens
    assert plan(64, model_3b).capped_by_positions


# ---------------------------------------------------------------------------------------------- 4-bit weights (issue 29)
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
       "modules_to_not_convert": ["visual"]}
ORIN_NANO = Path(__file__).resolve().parents[1] / "configs" / "orin-nano-8gb.yaml"


@pytest.fixture
def model_3b_awq(tmp_path):
    config = PRESETS["3b"].config.to_hf_dict()
    config["quantization_config"] = AWQ
    (tmp_path / "awq").mkdir()
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    return tmp_path / "awq"


def test_four_bit_weights_are_counted_from_the_quantization_config(model_3b, model_3b_awq):
    dense, quantized = plan(64, model_3b, weight_dtype="fp16"), plan(64, model_3b_awq, weight_dtype="fp16")
    d, inter, kv = 2048, 11008, 256
    linears = 36 * [(d, d), (d, kv), (d, kv), (d, d), (d, inter), (d, inter), (inter, d)]
    weights = sum(k * n for k, n in linears)
    four_bit = sum(k * n // 2 + (k // 128) * n * 2 + (k // 128) * n // 2 for k, n in linears)
    assert dense.weight_bytes - quantized.weight_bytes == weights * 2 - four_bit
    assert 2.9 < quantized.weight_bytes / 2**30 < 3.4 and "4-bit AWQ" in quantized.summary()


def test_an_int8_head_counts_the_tied_table_once_in_int8(model_3b_awq):
    as_loaded = plan(8, model_3b_awq, weight_dtype="fp16", resolution=(336, 336))
    int8 = plan(8, model_3b_awq, weight_dtype="fp16", resolution=(336, 336), lm_head="int8")
    vocab, d = 151936, 2048
    assert as_loaded.weight_bytes - int8.weight_bytes == vocab * d * 2 - (vocab * d + vocab * (d // 128) * 4)
    assert int8.max_tokens >= as_loaded.max_tokens and "int8 head" in int8.weights_note
    from edgekv.apps.cli import main

    assert main(["plan", "--device-memory", "8", "--model", str(model_3b_awq), "--dtype", "fp16", "--resolution", "336",
                 "336", "--lm-head", "int8"]) == 0


def test_orin_nano_config_fits_with_four_bit_weights_and_not_without(model_3b, model_3b_awq):
    result, verdict = check_config(ORIN_NANO, 8, model_dir=model_3b_awq)
    assert "cache.max_tokens 6144 fits" in verdict and result.max_tokens >= 6144
    assert result.tokens_per_pair == 144  # the config's 336x336 grid
    with pytest.raises(ValueError, match="short by 1.22 GiB"):
        check_config(ORIN_NANO, 8, model_dir=model_3b)


def test_a_cap_the_device_cannot_hold_is_refused_naming_the_key(model_3b_awq, tmp_path):
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(ORIN_NANO.read_text().replace("max_tokens: 6144", "max_tokens: 60000"))
    with pytest.raises(ValueError, match=r"cache\.max_tokens 60000 does not fit"):
        check_config(deploy, 7.44, model_dir=model_3b_awq)


def test_plan_command_checks_a_config(model_3b_awq, capsys):
    assert main(["plan", "--device-memory", "8", "--config", str(ORIN_NANO), "--model", str(model_3b_awq)]) == 0
    out = capsys.readouterr().out
    assert "4-bit AWQ decoder linears" in out and "cache.max_tokens 6144 fits" in out


def test_unsupported_quantization_config_is_refused_by_plan(model_3b_awq):
    config = json.loads((model_3b_awq / "config.json").read_text())
    config["quantization_config"]["bits"] = 3
    (model_3b_awq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config\.bits"):
        plan(8, model_3b_awq)


def _machine(root: Path, total_kb: int, jetson: bool) -> Path:
    (root / "proc").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(f"MemTotal: {total_kb} kB\nMemFree: 1000000 kB\nBuffers: 0 kB\n"
                                           "Cached: 0 kB\n")
    if jetson:
        (root / "etc").mkdir()
        (root / "etc" / "nv_tegra_release").write_text("# R36 (release), REVISION: 4.3\n")
    return root


def test_the_plan_reads_the_memory_of_the_machine_it_runs_on(tmp_path, monkeypatch):
    """Without ``--device-memory`` (on the device itself): a Jetson's unified memory whatever model.device says,
    a GPU's memory for cuda, the RAM for cpu; cuda without a GPU is refused naming the flag."""
    from edgekv.calibration.plan import memory_here

    orin_nano = _machine(tmp_path / "nano", 7802232, jetson=True)  # MemTotal of an 8 GB board after carve-outs
    for device in ("auto", "cuda", "cpu"):
        gib, where = memory_here(device, root=orin_nano)
        assert gib == pytest.approx(7802232 / 2**20) and "Jetson's unified memory" in where
    desktop = _machine(tmp_path / "desktop", 32 * 2**20, jetson=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    gib, where = memory_here("auto", root=desktop)
    assert gib == pytest.approx(32.0) and "RAM" in where and "model.device auto" in where
    with pytest.raises(ValueError, match="no CUDA GPU here: give --device-memory"):
        memory_here("cuda:1", root=desktop)

    class Props:
        name, total_memory = "NVIDIA H200", 150_000_000_000

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda index: Props)
    gib, where = memory_here("auto", root=desktop)
    assert gib == pytest.approx(150e9 / 2**30) and "GPU 0 (NVIDIA H200" in where
    assert memory_here("cpu", root=desktop)[0] == pytest.approx(32.0)  # a CPU deployment on a GPU machine


def test_plan_without_device_memory_plans_for_this_machine(model_3b, capsys, monkeypatch):
    import edgekv.calibration.plan as plan_module

    monkeypatch.setattr(plan_module, "memory_here", lambda device="auto", root="/": (61.37, f"fake ({device})"))
    assert main(["plan", "--model", str(model_3b)]) == 0
    out = capsys.readouterr().out
    assert "device memory 61.37 GiB: fake (auto)" in out and "device memory           61.37 GiB" in out
    demo = Path(__file__).resolve().parents[1] / "configs" / "cpu-demo.yaml"
    assert main(["plan", "--config", str(demo)]) == 0  # model.device cpu: the config's device is asked for
    out = capsys.readouterr().out
    assert "fake (cpu)" in out and f"{demo}: cache.max_tokens 640 fits" in out


def test_plan_says_how_far_back_the_archive_and_the_evidence_frames_reach(model_3b, tmp_path, capsys):
    """A frame pair's archive record at the 3B shape is what the writer appends (KVShape.record_bytes: 36 layers of
    bf16 K/V for 256 tokens, index keys, checksums, ~9 MiB), so archive.max_gib 16 holds ~1,800 pairs — half an hour
    at two cameras' worth of pairs (two sources at 1 fps: 1 pair a second in all) — and 256 MiB of evidence frames
    at 320 px hold hours."""
    from edgekv.archive.store import KVShape

    config = tmp_path / "deploy.yaml"
    config.write_text(f"""model: {{path: {model_3b}, dtype: bf16}}
video:
  fps: 1.0
  resolution: [448, 448]
  sources: [{{name: front, source: 0}}, {{name: back, source: 1}}]
cache: {{max_tokens: 8192}}
archive: {{dir: {tmp_path / 'archive'}, max_gib: 16, frames_mib: 256, frames_px: 320}}
""")
    assert main(["plan", "--device-memory", "16", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    record = KVShape(36, 2, 128, "bfloat16", 2).record_bytes(256)
    assert 9 * 2**20 < record < 9.5 * 2**20  # 36 x 2 x 2 x 256 x 128 x 2 bytes of K/V, and the rest
    pairs = 16 * 2**30 // record
    assert f"a frame pair of 256 tokens is {record / 2**20:.2f} MiB on flash" in out
    assert f"hold {pairs:,} pairs: {pairs / 60:.0f} min of video at 1 pair(s) a second (all cameras)" in out
    assert "evidence frames: archive.frames_mib 256 MiB at 320 px (about 16.1 KiB a frame on disk" in out
    assert "hold about 4.5 h" in out
    assert main(["plan", "--device-memory", "16", "--model", str(model_3b)]) == 0  # the defaults: 0.5 pairs a second
    assert f"hold {pairs:,} pairs: 1.0 h of video at 0.5 pair(s) a second" in capsys.readouterr().out
    # archive.kv_dtype int8: 8-bit codes and a bf16 scale per (layer, head, token): about twice the pairs
    from edgekv.calibration.plan import flash_lines
    from edgekv.config import EdgeKVConfig

    eight = KVShape(36, 2, 128, "int8", 2).record_bytes(256)
    lines = flash_lines(EdgeKVConfig().with_overrides(archive={"kv_dtype": "int8"}), model_3b, 256)
    assert f"is {eight / 2**20:.2f} MiB on flash (int8 (archive.kv_dtype) K/V" in lines[0]
    assert f"hold {16 * 2**30 // eight:,} pairs" in lines[1] and 1.9 < record / eight < 2
    lines = flash_lines(EdgeKVConfig().with_overrides(cache={"kv_dtype": "int8"}), model_3b, 256)  # the cache's own
    assert f"is {eight / 2**20:.2f} MiB on flash (int8 (cache.kv_dtype) K/V" in lines[0]
    # archive.kv_dtype int4: two codes a byte, keys' scales per channel, values' per token: 3.8x the bf16 pairs
    four = KVShape(36, 2, 128, "int4", 2).record_bytes(256)
    lines = flash_lines(EdgeKVConfig().with_overrides(archive={"kv_dtype": "int4"}), model_3b, 256)
    assert f"is {four / 2**20:.2f} MiB on flash (int4 (archive.kv_dtype) K/V" in lines[0]
    assert f"hold {16 * 2**30 // four:,} pairs" in lines[1] and 3.7 < record / four < 3.9 and 1.9 < eight / four < 2


def test_plan_says_what_the_memory_writes_to_flash_a_day(model_3b, tmp_path, capsys):
    """Flash wears by what is written: at the 3B shape the archive appends a ~9 MiB record a pair (hundreds of GB a
    day at a pair every two seconds), each snapshot rewrites the whole cache, the evidence frames' log writes each
    JPEG twice; with --flash-tbw, the years until a flash's rating is written."""
    from edgekv.archive.store import KVShape
    from edgekv.calibration.plan import flash_lines
    from edgekv.config import EdgeKVConfig

    record = KVShape(36, 2, 128, "bfloat16", 2).record_bytes(256)
    config = EdgeKVConfig().with_overrides(
        model={"dtype": "bf16"}, cache={"max_tokens": 6144}, state={"dir": str(tmp_path / "s"), "every_s": 300},
        archive={"dir": str(tmp_path / "a"), "frames_mib": 256, "frames_px": 320})
    day = 86400
    archive, snapshots = record * 0.5 * day, 6144 * 38156 * day / 300  # 38,156 bytes a token (test above)
    frames = 2 * (5 + 2) * 4096 * 0.5 * day  # a 16.1 KiB JPEG in 5 pages, 2 b-tree pages, each written twice
    total = archive + snapshots + frames
    line = flash_lines(config, model_3b, 256, flash_tbw=600)[-2:]
    assert line[0].startswith("writes to flash a day, at 0.5 pair(s) a second: ")
    assert f"archive {archive / 1e9:,.1f} GB" in line[0] and f"snapshots {snapshots / 1e9:,.1f} GB" in line[0]
    assert f"evidence frames {frames / 1e9:,.1f} GB" in line[0] and f"; {total / 1e9:,.1f} GB a day" in line[0]
    assert 400e9 < total < 500e9
    assert f"has that written in {600e12 / (total * 365):,.1f} years" in line[1]
    # an 8-bit archive halves its share; without state.dir or archive.dir nothing is written, what would be is said
    lines = flash_lines(config.with_overrides(archive={"kv_dtype": "int8"}), model_3b, 256)
    eight = KVShape(36, 2, 128, "int8", 2).record_bytes(256) * 0.5 * day
    assert f"archive {eight / 1e9:,.1f} GB" in lines[-2] and "check the flash's rating" in lines[-1]
    assert "nothing is written; were they set" in flash_lines(EdgeKVConfig(), model_3b, 256)[-2]
    assert main(["plan", "--device-memory", "16", "--model", str(model_3b), "--flash-tbw", "150"]) == 0
    assert "a flash rated 150 TBW (--flash-tbw) has that written in" in capsys.readouterr().out


def test_a_cap_over_the_position_ceiling_that_memory_holds_fits_with_a_note(tmp_path, capsys):
    """The shipped toy at the default cap (6144 tokens, 4 MiB): `edgekv plan --config` said "does not fit 23.54 GB"
    and exited 2, and --check printed the same with a raw float, while the daemon runs it and answers right. The
    plan's 4096 there is half the toy's position range, not memory."""
    deploy = tmp_path / "toy.yaml"
    deploy.write_text("model: {path: 'builtin:toy'}\nvideo: {resolution: [112, 112]}\n")
    result, verdict = check_config(deploy, 23.54029083251953)
    assert result.max_tokens == 4096 and result.capped_by_positions
    assert "cache.max_tokens 6144 fits (4 MiB;" in verdict and "half the model's position range" in verdict
    assert main(["plan", "--device-memory", "23.54029083251953", "--config", str(deploy)]) == 0


def test_plan_says_when_the_archive_index_bound_decides_how_far_back_it_reaches(model_3b):
    """Small records on a large disk are many pairs, each an index row in RAM; the archive keeps its index within
    ``archive.max_index_mib`` (an eighth of the RAM by default) by letting the oldest segments go, so the plan's reach
    is the bound's, not the disk's."""
    from edgekv.archive.store import KVShape
    from edgekv.calibration.plan import flash_lines
    from edgekv.config import EdgeKVConfig

    shape = KVShape(36, 2, 128, "int4", 2)
    record, entry = shape.record_bytes(64), shape.index_entry_bytes()
    lines = flash_lines(EdgeKVConfig().with_overrides(archive={"kv_dtype": "int4", "max_gib": 64, "max_index_mib": 32}),
                        model_3b, 64)
    kept = 32 * 2**20 // entry
    assert 64 * 2**30 // record > kept  # the disk would hold more than the bound keeps
    assert (f"the index's bound in RAM (archive.max_index_mib, 32 MiB) keeps the newest {kept:,}: "
            in lines[1]), lines[1]
    lines = flash_lines(EdgeKVConfig().with_overrides(archive={"max_index_mib": 1024}), model_3b, 256)
    assert "its index" in lines[1] and "bound" not in lines[1]  # 16 GiB of bf16 pairs: the disk decides
