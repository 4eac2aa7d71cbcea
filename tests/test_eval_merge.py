"""``edgekv eval merge``: needle runs made in parts, put back into what one run would have written."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from edgekv.apps.cli import main
from edgekv.eval.merge import merge

TINY = ["--lengths", "80", "--budgets", "400", "--streams", "1", "--ages", "4,40,70", "--seed", "3", "--threads", "1"]


def _needle(tmp_path, name: str, *args: str) -> str:
    out = tmp_path / f"{name}.json"
    assert main(["eval", "needle", *TINY, *args, "--json", str(out), "--plot", str(tmp_path / f"{name}.png")]) == 0
    return str(out)


def _rows(result: dict) -> Counter:
    return Counter(json.dumps(r, sort_keys=True) for r in result["records"])


def test_parts_run_apart_merge_into_the_run_of_everything(tmp_path, capsys):
    """One process with the full-cache ceiling and sliding_window, another with infinipot_v and no full cache:
    merged, they are the single run of both policies record for record, summary and frontier alike (the second
    part's ratios are against the first part's full cache)."""
    whole = json.loads(open(_needle(tmp_path, "whole", "--policies", "sliding_window,infinipot_v")).read())
    one = _needle(tmp_path, "one", "--policies", "sliding_window")
    two = _needle(tmp_path, "two", "--policies", "infinipot_v", "--full-max-tokens", "0")
    assert all(r["ceiling_full"] is None for r in json.loads(open(two).read())["records"])
    out = tmp_path / "merged.json"
    capsys.readouterr()
    assert main(["eval", "merge", one, two, "--json", str(out), "--plot", str(tmp_path / "merged.png")]) == 0
    printed = capsys.readouterr().out
    assert "frontier L=80 infinipot_v: all questions" in printed and f"wrote {out}" in printed
    assert (tmp_path / "merged.png").stat().st_size > 10_000
    merged = json.loads(out.read_text())
    assert _rows(merged) == _rows(whole)
    assert merged["summary"] == whole["summary"] and merged["frontier"] == whole["frontier"]
    assert merged["summary"]["L=80 M=400 infinipot_v"]["ceiling_full"] is not None
    assert merged["config"]["runs"] == ["sliding_window", "infinipot_v"] and merged["config"]["merged_from"] == [one, two]
    assert merged["config"]["full_max_tokens"] == 40000


def _part(path, policy="tar", seed=7, questions=(("Was there a red circle?", "yes", True),), full=None, **config):
    records = [{"length": 500, "stream": 0, "budget": 100, "policy": policy, "question": q, "answer": a,
                "checkpoint": 400, "age": 30, "family": "exists", "size": 112, "background": "photo", "cap": None, "correct": True,
                "ceiling_correct": short, "ceiling_full": full, "bytes": 1, "slots": 100}
               for q, a, short in questions]
    config = {"model": "builtin:toy", "seed": seed, "streams": 1, "runs": [policy], "kv_dtypes": [],
              "full_max_tokens": 0 if full is None else 40000, **config}
    path.write_text(json.dumps({"config": config, "records": records}))
    return str(path)


def test_merge_refuses_parts_that_are_not_the_same_streams(tmp_path, capsys):
    base = _part(tmp_path / "a.json", full=True)
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "plain.json").write_text(json.dumps({"records": [{"policy": "tar"}]}))
    cases = (
        ([base, _part(tmp_path / "b.json", policy="van", seed=8)], "drew different streams: seed is 8 against 7"),
        ([base, _part(tmp_path / "c.json")], "both ran 'tar' at M=100"),
        ([base, _part(tmp_path / "g.json", policy="van", lure_colors="free")],  # a part from before lure_colors: []
         "drew different streams: lure_colors is 'free' against []"),
        ([base, _part(tmp_path / "d.json", policy="van", questions=(("Was there a red circle?", "no", True),))],
         "asked stream 0 (photo, L=500, 112px) different questions"),
        ([base, _part(tmp_path / "e.json", policy="van", questions=(("Was there a red circle?", "yes", False),))],
         "different questions or got other short-stream answers"),
        ([base, _part(tmp_path / "f.json", policy="van", full=False)], "disagree on the ceiling full of"),
        ([base, str(tmp_path / "bad.json")], "not JSON"),
        ([base, str(tmp_path / "plain.json")], "needs its config and records"),
        ([base, str(tmp_path / "missing.json")], "cannot read it"),
        ([base], "at least two"),
        ([base, str(tmp_path / "." / "a.json")], "a.json is given twice"),
    )
    for parts, said in cases:
        with pytest.raises(ValueError) as caught:
            merge(parts)
        assert said in str(caught.value), (said, str(caught.value))
    assert main(["eval", "merge", base, str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgekv eval merge: ") and "bad.json: not JSON" in err


def test_merge_shares_the_ceiling_with_the_parts_that_did_not_run_it(tmp_path):
    questions = (("Was there a red circle?", "yes", True), ("Which shape was blue?", "square", False))
    with_full = _part(tmp_path / "a.json", questions=questions, full=True)
    without = _part(tmp_path / "b.json", policy="van", questions=questions)
    merged = merge([without, with_full])
    # a part written before lure_colors / lure_shapes existed drew the streams of one that gives them as ()
    assert merge([with_full, _part(tmp_path / "c.json", policy="van", questions=questions, lure_colors=[],
                                   lure_shapes=[])])["records"]
    assert {r["policy"]: r["ceiling_full"] for r in merged["records"]} == {"tar": True, "van": True}
    assert merged["summary"]["L=500 M=100 van"]["ceiling_full"] == 1.0
    assert merged["config"]["runs"] == ["van", "tar"] and merged["config"]["full_max_tokens"] == 40000


def test_an_interrupted_needle_run_keeps_its_whole_streams_and_merge_refuses_it(tmp_path, monkeypatch, capsys):
    """Ctrl-C in a long `eval needle` lost every figure; now the streams every run finished on are written (the
    one under way dropped, so each policy answered the same questions), marked `interrupted`, exit 130; merging
    such a part with a whole one would compare policies on different streams, so merge refuses it."""
    import edgekv.eval.needle as needle

    real, calls = needle.run_stream, []

    def cut_at_the_fourth(runtime, scene, pairs, *args, **kwargs):  # per stream: the full cache, then infinipot_v
        if pairs == 80:  # the long stream's runs (each question's short-stream ceiling runs on its own scene)
            calls.append(1)
            if len(calls) == 4:
                raise KeyboardInterrupt
        return real(runtime, scene, pairs, *args, **kwargs)

    monkeypatch.setattr(needle, "run_stream", cut_at_the_fourth)
    out = tmp_path / "cut.json"
    args = ["eval", "needle", *TINY, "--streams", "3", "--policies", "infinipot_v", "--json", str(out),
            "--plot", str(tmp_path / "cut.png")]
    try:
        code = main(args)
    except KeyboardInterrupt:  # (not let through: it would end the test run itself)
        pytest.fail("the interrupt ended eval needle and its figures were lost")
    assert code == 130 and len(calls) == 4
    result = json.loads(out.read_text())
    assert result["interrupted"] == {"streams_done": 1}
    assert {r["stream"] for r in result["records"]} == {0} and "L=80 M=400 infinipot_v" in result["summary"]
    assert "interrupted: the figures are of 1 whole stream(s)" in capsys.readouterr().out
    other = _part(tmp_path / "other.json")
    with pytest.raises(ValueError, match="cut.json was interrupted .*1 whole stream"):
        merge([str(out), other])
    calls.clear()
    monkeypatch.setattr(needle, "run_stream", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # nothing finished: nothing to keep, the interrupt goes on
        needle.evaluate(needle.NeedleConfig(model="builtin:toy", lengths=(80,), budgets=(400,), streams=1,
                                            ages=(4, 40, 70)), log=lambda line: None)
