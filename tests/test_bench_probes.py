"""``edgekv bench`` and ``edgekv eval needle`` run as a user runs them, with odd arguments and output paths: a mistake
is one line on stderr naming the option and exit 2, found before the run, and no figure is silently wrong (a
negative budget's hours, a p90 under the median, a setting given twice counted twice)."""

from __future__ import annotations

import json

import pytest

from edgekv.apps.cli import main


def _one_line_naming(capsys, flag: str) -> str:
    err = capsys.readouterr().err
    assert flag in err and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------------------------------------- the benches
SMALL_COMPRESSION = ["bench", "compression", "--layers", "1", "--kv-heads", "1", "--tokens", "60", "--head-dim", "16",
                     "--grid", "4", "4", "--dtypes", "fp32", "--policies", "van", "--repeats", "1", "--threads", "1"]


@pytest.mark.parametrize("extra, flag", [(["--dtypes", "fp64"], "--dtypes"), (["--dtypes", " , "], "--dtypes"),
                                         (["--policies", "h2o"], "--policies"), (["--repeats", "0"], "--repeats"),
                                         (["--layers", "0"], "--layers"), (["--grid", "0", "4"], "--grid")])
def test_bench_compression_mistakes_are_one_line_and_exit_2(extra, flag, tmp_path, capsys):
    """An unknown name in a comma list exited 1 (a SystemExit with text); --layers 0 was a traceback, --repeats 0
    'no median for empty data', --dtypes ' , ' wrote the JSON and then divided by zero in the plot."""
    out = tmp_path / "c.json"
    assert main([*SMALL_COMPRESSION, *extra, "--json", str(out), "--plot", ""]) == 2
    _one_line_naming(capsys, flag)
    assert not out.exists()


def test_a_name_given_twice_in_a_comma_list_is_measured_once():
    from edgekv.apps.bench.common import comma_choices

    assert comma_choices("fp32, bf16,fp32", ("fp32", "bf16"), "--dtypes", "dtype") == ["fp32", "bf16"]


def test_one_path_for_the_json_and_the_png_is_refused_before_the_run(tmp_path, capsys):
    """It ran, wrote the JSON, wrote the PNG over it and said 'wrote' twice, exit 0."""
    same = tmp_path / "figures.png"
    assert main([*SMALL_COMPRESSION, "--json", str(same), "--plot", str(same)]) == 2
    _one_line_naming(capsys, "--json and --plot")
    assert not same.exists()


def test_the_output_folders_exist_before_a_bench_runs(tmp_path, monkeypatch):
    """bench soak wrote its figures without making their folder: Ctrl-C after hours, or the end, lost them to a
    missing folder (exit 2). Every bench now finds its folders made when it starts."""
    from edgekv.apps.bench import soak

    seen = {}

    def fake_soak(args):
        seen["json"] = (tmp_path / "a" / "b").is_dir()
        seen["plot"] = (tmp_path / "c").is_dir()
        return 0

    monkeypatch.setattr(soak, "run_soak", fake_soak)
    assert main(["bench", "soak", "--pairs", "1", "--json", str(tmp_path / "a" / "b" / "s.json"),
                 "--plot", str(tmp_path / "c" / "s.png")]) == 0
    assert seen == {"json": True, "plot": True}


@pytest.mark.parametrize("extra, flag", [(["--hours", "nan"], "--hours"), (["--hours", "-1"], "--hours"),
                                         (["--pairs", "0"], "--pairs"),
                                         (["--pairs", "2", "--sample-s", "0"], "--sample-s"),
                                         (["--pairs", "2", "--sample-every-pairs", "0"], "--sample-every-pairs")])
def test_bench_soak_checks_its_length_and_sampling_first(extra, flag, tmp_path, capsys):
    """--hours nan never ended; --hours -1 and --pairs 0 were an IndexError, the sampling 0s a ZeroDivisionError —
    after the model loaded. (The model here does not exist: the check must come before it is read.)"""
    assert main(["bench", "soak", *extra, "--model", str(tmp_path / "no-model"), "--json", str(tmp_path / "s.json"),
                 "--plot", ""]) == 2
    _one_line_naming(capsys, flag)


@pytest.mark.parametrize("budget", ["-1", "0", "nan"])
def test_bench_frames_refuses_a_budget_that_holds_nothing(budget, tmp_path, capsys):
    """--frames-mib -1 printed and saved negative hours, exit 0; nan was 'cannot convert float NaN to integer'."""
    out = tmp_path / "f.json"
    assert main(["bench", "frames", "--sources", "synthetic:world", "--px", "160", "--frames", "1", "--frames-mib",
                 budget, "--json", str(out), "--plot", ""]) == 2
    _one_line_naming(capsys, "--frames-mib")
    assert not out.exists()


def test_p90_is_never_under_the_median():
    """int(0.9 * (n - 1)) picked the minimum of two samples: a p90 under the median in bench frames / keepalive."""
    from edgekv.apps.bench.frames import _spread
    from edgekv.apps.bench.keepalive import _summary

    for values in ([1.0, 2.0], [3.0, 1.0, 2.0], [float(v) for v in range(10)]):
        spread, summary = _spread(values), _summary(values)
        assert spread["median"] <= spread["p90"] <= max(values)
        assert summary["median_ms"] <= summary["p90_ms"] <= max(values)
    assert _spread([float(v) for v in range(1, 11)])["p90"] == 9.0  # nearest rank: the 9th of 10


@pytest.mark.parametrize("extra, flag", [(["--wait", "spin"], "--wait"), (["--frames", "1"], "--frames"),
                                         (["--resolution", "50"], "--resolution")])
def test_bench_threads_mistakes_are_named_before_any_child_runs(extra, flag, tmp_path, capsys):
    """--wait spin exited 1; --frames 1 and --resolution 50 came back as the tail of a child's traceback."""
    assert main(["bench", "threads", "--threads", "1", "--wait", "PASSIVE", "--frames", "4", "--resolution", "56",
                 *extra, "--model", str(tmp_path / "no-model"), "--json", str(tmp_path / "t.json"), "--plot", ""]) == 2
    _one_line_naming(capsys, flag)


# ---------------------------------------------------------------------------------------------- eval needle / merge
NEEDLE = ["eval", "needle", "--lengths", "40", "--events", "1", "--ages", "10", "--budgets", "400", "--threads", "1"]


def test_eval_needle_refuses_no_streams(tmp_path, capsys):
    """--streams 0 (or -1) wrote a JSON of no records and exit 0."""
    out = tmp_path / "n.json"
    for streams in ("0", "-1"):
        assert main([*NEEDLE, "--policies", "sliding_window", "--streams", streams, "--json", str(out),
                     "--plot", ""]) == 2
        _one_line_naming(capsys, "--streams")
    assert not out.exists()


def test_eval_needle_and_merge_refuse_one_path_for_json_and_png(tmp_path, capsys):
    same = str(tmp_path / "n.png")
    assert main([*NEEDLE, "--policies", "sliding_window", "--streams", "1", "--json", same, "--plot", same]) == 2
    _one_line_naming(capsys, "--json and --plot")
    assert main(["eval", "merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json", same,
                 "--plot", same]) == 2
    _one_line_naming(capsys, "--json and --plot")


def test_eval_needle_runs_a_setting_given_twice_once(tmp_path):
    """--policies sliding_window,sliding_window --budgets 400,400 ran it four times: every question counted four
    times in the one summary entry, its 95 % interval as if from four times the questions."""
    once, twice = tmp_path / "once.json", tmp_path / "twice.json"
    assert main([*NEEDLE, "--policies", "sliding_window", "--streams", "1", "--full-max-tokens", "0",
                 "--json", str(once), "--plot", ""]) == 0
    assert main([*NEEDLE, "--policies", "sliding_window,sliding_window", "--budgets", "400,400", "--streams", "1",
                 "--full-max-tokens", "0", "--json", str(twice), "--plot", ""]) == 0
    a, b = json.loads(once.read_text()), json.loads(twice.read_text())
    assert len(b["records"]) == len(a["records"]) > 0
    assert b["summary"] == a["summary"]


def test_eval_needle_number_lists_drop_repeats():
    from edgekv.eval.cli import _fractions, _ints

    assert _ints("400,400,200") == (400, 200)
    assert _fractions("1/4,0.25,1/16") == (0.25, 0.0625)
