"""Answer benchmarks: ``edgekv eval needle`` (toy model) and ``edgekv eval videoqa`` (dataset layouts)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from edgekv.eval.needle import age_bin, ceiling_scene, needle_stream, summarize
from edgekv.toy.questions import ALL_FAMILIES
from edgekv.eval.videoqa import extract_letter, load_mlvu, load_videomme, prompt


# ---------------------------------------------------------------------------------------------- needle
def test_needle_stream_places_events_at_their_ages_and_asks_about_them():
    stream = needle_stream(400, (8, 128, 300), seed=3, events=3)
    assert sorted(400 - e.first_pair for e in stream.scene.events) == [8, 128, 300]
    assert len({e.shape for e in stream.scene.events}) == 3 and len({e.color for e in stream.scene.events}) == 3
    checkpoints = sorted({p.checkpoint for p in stream.probes})
    assert checkpoints == [100, 200, 300, 400]
    for probe in stream.probes:
        assert all(e.last_pair < probe.checkpoint for e in probe.seen)  # only what was shown before
        if probe.age is not None and probe.qa.family != "order":
            (event,) = [e for e in probe.seen if e in probe.qa.about]
            assert probe.age == probe.checkpoint - event.first_pair
    assert [p.qa.answer for p in stream.probes if p.checkpoint == 100] == ["zero"]  # nothing shown yet
    second = [p for p in stream.probes if p.checkpoint == 200]  # one event shown, at pair 100
    assert {p.qa.answer for p in second if p.qa.family == "count"} == {"one", "zero"}
    assert all(p.qa.answer == "no" for p in second if p.qa.family == "exists" and p.age is None)


def test_ceiling_stream_keeps_the_order_and_nothing_else():
    stream = needle_stream(300, (10, 200, 250), seed=1)
    seen = tuple(stream.scene.events)
    scene, length = ceiling_scene(seen, seed=1, fps=2.0)
    assert [(e.shape, e.color) for e in scene.events] == [(e.shape, e.color) for e in seen]
    assert length < 20 and all(b.first_pair > a.last_pair for a, b in zip(scene.events, scene.events[1:]))


def test_summary_bins_and_ratios():
    rows = [{"length": 10, "budget": 5, "bytes": 1, "policy": "p", "family": "color", "age": age, "correct": ok,
             "ceiling_correct": ceiling} for age, ok, ceiling in ((2, True, True), (3, False, True), (40, True, True),
                                                                   (None, True, False))]
    entry = summarize(rows)["L=10 M=5 p"]
    first = entry["by_age"]["0-3"]
    assert {k: first[k] for k in ("n", "accuracy", "ceiling", "ratio")} == {"n": 2, "accuracy": 0.5, "ceiling": 1.0,
                                                                           "ratio": 0.5}
    assert first["ci95"][0] < 0.5 < first["ci95"][1] and first["ceiling_ci95"][1] == 1.0  # Wilson, 1 of 2 / 2 of 2
    assert entry["by_age"]["16-63"]["ratio"] == 1.0
    assert entry["by_age"]["none"]["ratio"] is None  # ceiling 0: no ratio
    assert age_bin(5000) == "4096+"


def test_frontier_names_the_largest_cap_where_a_policy_falls_under_90_percent_of_its_ceiling():
    from edgekv.eval.cli import format_frontier
    from edgekv.eval.needle import frontier, summarize

    records = []
    # per policy, cap (tokens) -> (young correct of 10, old correct of 10); every ceiling answers 8 of 10
    plan = {"infinipot_v": {4000: (9, 8), 1000: (8, 8), 250: (8, 7)},
            "sliding_window": {4000: (9, 2), 1000: (8, 1), 250: (8, 0)}}
    for policy, caps in plan.items():
        for budget, (young, old) in caps.items():
            for age, right in ((10, young), (900, old)):
                for i in range(10):
                    records.append({"length": 1000, "budget": budget, "bytes": budget * 100, "policy": policy,
                                    "family": "color", "kind": "color", "correct": i < right, "age": age,
                                    "ceiling_correct": i < 8, "ceiling_full": None, "size": 112, "cap": None,
                                    "cap_actual": budget / 16000})
    result = frontier(summarize(records))
    window, pot = result["L=1000 sliding_window"], result["L=1000 infinipot_v"]
    assert [c["budget"] for c in pot["caps"]] == [4000, 1000, 250]  # largest cap first
    assert pot["caps"][0]["ratio"] == round(17 / 16, 4) and pot["caps"][2]["old_ratio"] == round(7 / 8, 4)
    assert pot["breaks_at"] is None and pot["old_breaks_at"] == 250 / 16000  # old events: 7/8 = 0.875 at 1/64
    assert window["breaks_at"] == 4000 / 16000 and window["old_breaks_at"] == 4000 / 16000  # 11/16 = 0.69
    text = format_frontier(result)
    assert "L=1000 infinipot_v: all questions holds to 1/64, events >= 256 pairs old breaks at 1/64" in text
    assert "L=1000 sliding_window: all questions breaks at 1/4" in text
    assert pot["family_breaks_at"] == {"color": None} and window["family_breaks_at"] == {"color": 4000 / 16000}
    assert "by question family: color breaks at 1/4 (n=20)" in text.split("\n")[1]  # FAMILY_MIN_N questions


def test_frontier_flags_a_full_cache_ceiling_under_the_short_streams():
    """Where the toy's full cache on the long stream answers under 90 % of its short streams (its long memory does
    not hold at that length), every policy "holds" against that ceiling: the frontier says so, with the verdict
    against the short streams beside it; a full cache at the short figure gets no caution."""
    from edgekv.eval.cli import format_frontier
    from edgekv.eval.needle import frontier, summarize

    def records(full_right: int) -> list[dict]:
        out = []
        for budget, right in ((4000, 7), (1000, 6)):  # of 10; short streams 8 of 10
            for i in range(10):
                out.append({"length": 10000, "budget": budget, "bytes": budget, "policy": "infinipot_v",
                            "family": "color", "kind": "color", "correct": i < right, "age": 3000,
                            "ceiling_correct": i < 8, "ceiling_full": i < full_right, "size": 112, "cap": None,
                            "cap_actual": budget / 160000})
        return out

    low = frontier(summarize(records(4)))["L=10000 infinipot_v"]
    assert low["full_vs_short"] == 0.5 and low["breaks_at"] is None  # 0.7 / 0.4 and 0.6 / 0.4: "holds"
    assert [c["short_ratio"] for c in low["caps"]] == [0.875, 0.75] and low["short_breaks_at"] == 4000 / 160000
    text = format_frontier({"L=10000 infinipot_v": low})
    assert "CAUTION: the full cache on the long stream reads 0.50 of the short streams" in text
    assert text.endswith("against the short streams all questions breaks at 1/40")
    some = records(4)
    for r in some[:3] + some[10:13]:  # the full cache run on some streams only: compared on those questions
        r["ceiling_full"] = None
    # 1/7 over 5/7 on the questions the full cache answered, not over the short streams' 13/20
    assert frontier(summarize(some))["L=10000 infinipot_v"]["full_vs_short"] == pytest.approx(0.2, abs=1e-3)
    fine = frontier(summarize(records(8)))["L=10000 infinipot_v"]
    assert fine["full_vs_short"] == 1.0 and fine["breaks_at"] == 4000 / 160000
    assert "CAUTION" not in format_frontier({"x": fine})
    # the full cache's video spanning more temporal positions than the model's max_position_embeddings (a
    # 10,000-pair stream at 2 fps on the toy): flagged, whatever its accuracy; no figures, no flag (older JSON)
    spanned = records(8)
    for r in spanned:
        r.update(span_positions=20000, trained_positions=8192)
    past = frontier(summarize(spanned))["L=10000 infinipot_v"]
    assert past["full_past_trained"] is True and past["full_span_positions"] == 20000
    assert "full cache's video spans 20,000 temporal positions, past the model's max_position_embeddings (8,192)" \
        in format_frontier({"x": past})
    for r in spanned:
        r["ceiling_full"] = None  # the full cache not run: nothing to flag
    assert frontier(summarize(spanned))["L=10000 infinipot_v"]["full_past_trained"] is None
    assert fine["full_past_trained"] is None


def test_frontier_per_question_family_finds_the_family_a_policy_loses():
    """A policy that keeps colour but loses ``where`` breaks in the family figures, not in the pooled ones."""
    from edgekv.eval.cli import format_frontier
    from edgekv.eval.needle import frontier, summarize

    records = []
    for budget, where_right in ((4000, 20), (1000, 16)):  # ceiling: 20 of 20 each family
        for family, right in (("color", 20), ("shape", 20), ("exists", 20), ("where", where_right)):
            for i in range(20):
                records.append({"length": 1000, "budget": budget, "bytes": budget, "policy": "infinipot_v",
                                "family": family, "kind": family, "correct": i < right, "age": 10 + (i % 2) * 300,
                                "ceiling_correct": True, "ceiling_full": None, "size": 112, "cap": None,
                                "cap_actual": budget / 16000})
    item = frontier(summarize(records))["L=1000 infinipot_v"]
    assert item["breaks_at"] is None  # 76 of 80 pooled: 0.95
    assert item["family_breaks_at"] == {"color": None, "exists": None, "shape": None, "where": 1000 / 16000}
    assert item["caps"][1]["by_family"]["where"] == {"n": 20, "ratio": 0.8}
    assert "by question family: where breaks at 1/16 (n=20)" in format_frontier({"x": item})
    few = frontier(summarize([r for r in records if r["family"] != "where" or r["age"] == 10]))["L=1000 infinipot_v"]
    assert few["caps"][1]["by_family"]["where"]["n"] == 10 and few["family_breaks_at"]["where"] is None  # too few


def test_wilson_interval_matches_known_values():
    from edgekv.eval.stats import proportion, wilson

    # Agresti & Coull (1998) eq. 2 at z = 1.96, by hand: 0 of 10 -> (0, 0.2775); 5 of 10 -> (0.2366, 0.7634)
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson(10, 10)[1] == pytest.approx(1.0) and wilson(0, 0) == (0.0, 1.0)
    assert proportion(3, 4) == {"n": 4, "correct": 3, "accuracy": 0.75, "ci95": [0.3006, 0.9544]}
    with pytest.raises(ValueError, match="successes <= trials"):
        wilson(5, 4)


def test_repeated_needles_ask_second_colour_binding_and_counts_across_gaps():
    from edgekv.eval.needle import GAP_SPAN, probe_family
    from edgekv.toy.questions import ALL_FAMILIES

    stream = needle_stream(2000, (8, 128, 600, 1500, 1900), seed=5, events=3, kinds=ALL_FAMILIES, repeats=2)
    events = stream.scene.events
    assert len(events) == 5 and len({(e.shape, e.color) for e in events}) == 5
    shapes = [e.shape for e in events]
    assert any(shapes.count(s) >= 2 for s in shapes)  # a shape came back (in another colour)
    last = [p for p in stream.probes if p.checkpoint == 2000]
    kinds = {probe_family(p) for p in last}
    assert {"second", "binding", "where"} & kinds and len({p.qa.question for p in last}) == len(last)
    for probe in last:
        if probe.qa.family == "count" and len(probe.qa.about) >= 2:
            span = max(e.first_pair for e in probe.qa.about) - min(e.first_pair for e in probe.qa.about)
            assert probe_family(probe) == ("count_gap" if span >= GAP_SPAN else "count")
            assert probe.qa.answer in ("two", "three")
        if probe.qa.family == "second":
            repeated = sorted((e for e in events if e.shape in probe.qa.question), key=lambda e: e.first_pair)
            assert probe.qa.answer == repeated[1].color
    plain = needle_stream(2000, (8, 128, 600, 1500, 1900), seed=5, events=3)
    assert all(p.qa.family in ("color", "shape", "exists", "order", "count") for p in plain.probes)


def test_world_needle_streams_and_their_ceilings_share_the_background():
    from edgekv.video.world import WorldScene

    stream = needle_stream(300, (10, 200, 250), seed=2, family="stripes", style="world", size=224)
    assert isinstance(stream.scene, WorldScene) and stream.scene.family == "stripes"
    assert stream.scene.frame(0).shape == (224, 224, 3)
    assert min(e.radius for e in stream.scene.events) >= 14  # world sizes (one grid cell and up)
    scene, _ = ceiling_scene(tuple(stream.scene.events), 2, 2.0, family=stream.family, style=stream.style, size=224)
    assert scene.family == "stripes" and scene.style == stream.style


def test_busy_needle_streams_pass_objects_and_lures_through_the_stream_and_its_ceilings(capsys):
    import re

    from edgekv.apps.cli import main
    from edgekv.toy.questions import COLORS, SHAPES

    stream = needle_stream(300, (10, 200, 250), seed=2, family="stripes", busy=1.0, lures=1.0)
    assert stream.scene.style.transients == 1.0 and stream.scene.style.lures == 1.0
    passing = [c for pair in range(300) for c in stream.scene.transients(pair)]
    assert len(passing) > 150 and all(c.color in COLORS and c.shape not in SHAPES for c in passing)
    scene, _ = ceiling_scene(tuple(stream.scene.events), 2, 2.0, family=stream.family, style=stream.style)
    assert scene.style == stream.style  # the ceiling streams are as busy
    # the events, their ages and the questions do not depend on what passes
    quiet = needle_stream(300, (10, 200, 250), seed=2, family="stripes")
    assert [e.describe() for e in quiet.scene.events] == [e.describe() for e in stream.scene.events]
    assert [p.qa for p in quiet.probes] == [p.qa for p in stream.probes]
    with pytest.raises(ValueError, match="classic family"):
        needle_stream(300, (10, 200), seed=2, busy=0.5)
    for args, message in ((["--busy", "2"], "--busy: passing objects per frame pair in \\[0, 1\\], got 2.0"),
                          (["--families", "photo", "--lures", "0.5"], "mild streams have none: give --busy"),
                          (["--busy", "0.5"], "classic renderer \\(family events\\) draws no passing objects")):
        assert main(["eval", "needle", *args]) == 2
        assert re.search(message, capsys.readouterr().err)


def test_free_lure_colors_are_those_no_event_of_the_stream_wears_in_the_stream_and_its_ceilings(capsys):
    import re

    from edgekv.apps.cli import main
    from edgekv.toy.questions import COLORS

    stream = needle_stream(300, (10, 200, 250), seed=2, family="stripes", busy=1.0, lures=1.0, lure_colors="free",
                           lure_shapes=("ring",))
    worn = {e.color for e in stream.scene.events}
    assert len(worn) == 3 and stream.scene.style.lure_colors == tuple(c for c in COLORS if c not in worn)
    passing = [c for pair in range(300) for c in stream.scene.transients(pair)]
    assert len(passing) > 150 and {c.color for c in passing} == set(COLORS) - worn
    assert {c.shape for c in passing} == {"ring"}
    scene, _ = ceiling_scene(tuple(stream.scene.events[:1]), 2, 2.0, family=stream.family, style=stream.style)
    assert scene.style.lure_colors == stream.scene.style.lure_colors  # the long stream's palette, not the short's
    lured = needle_stream(300, (10, 200, 250), seed=2, family="stripes", busy=1.0, lures=1.0)
    assert [p.qa for p in lured.probes] == [p.qa for p in stream.probes]  # the same questions
    with pytest.raises(ValueError, match="every vocabulary colour"):
        needle_stream(2000, tuple(range(1, 2000, 50)), seed=2, family="stripes", events=6, repeats=2, busy=1.0,
                      lures=1.0, lure_colors="free")
    for args, message in ((["--lure-colors", "free"], "--lure-colors / --lure-shapes: .* --lures is 0"),
                          (["--busy", "0.2", "--lures", "1", "--lure-colors", "red,orange"],
                           "--lure-colors: unknown orange"),
                          (["--busy", "0.2", "--lures", "1", "--lure-shapes", "ring,circle"],
                           "--lure-shapes: unknown circle \\(of star, ring, hexagon, ellipse\\)")):
        assert main(["eval", "needle", "--families", "photo", *args]) == 2
        assert re.search(message, capsys.readouterr().err)


def test_caps_are_shares_of_the_stream_with_a_floor():
    import argparse

    from edgekv.eval.cli import _fractions
    from edgekv.eval.needle import cap_budget

    assert _fractions("1/4,1/256,0.5") == (0.25, 1 / 256, 0.5)
    with pytest.raises(argparse.ArgumentTypeError, match="in \\(0, 1\\]"):
        _fractions("3/2")
    assert cap_budget(1 / 8, 2000, 112, 64) == 4000
    assert cap_budget(1 / 256, 10000, 224, 64) == 2500
    assert cap_budget(1 / 256, 2000, 112, 64) == 32 + 4 * 16 + 64  # the floor: prefix, four pairs, reserve


def test_eval_needle_refuses_a_full_cache_run_that_no_cap_can_hold_before_running(tmp_path, capsys):
    """``--policies full`` runs only at a cap that holds the whole stream: with none, the command says so (and what
    to give) before any stream is drawn, instead of running every stream for nothing; a figure of a run where every
    policy was skipped says so instead of failing to draw."""
    from edgekv.apps.cli import main
    from edgekv.eval.needle import plot

    out = tmp_path / "needle.json"
    assert main(["eval", "needle", "--lengths", "250", "--caps", "1", "--policies", "full", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "a 250-pair stream at 112x112 needs 4096 tokens and the largest cap gives 4000" in err
    assert "--budgets 4096" in err and not out.exists()
    plot({"records": []}, tmp_path / "empty.png")
    assert (tmp_path / "empty.png").stat().st_size > 1000


@pytest.mark.slow
def test_eval_needle_with_caps_world_families_and_every_question_kind(tmp_path):
    """The command with the issue-27 options: caps as shares, a world family, every question kind, the
    full-cache ceiling on the long stream; intervals in the summary, accuracy against the cap in the PNG."""
    from edgekv.apps.cli import main

    out = tmp_path / "needle.json"
    code = main(["eval", "needle", "--lengths", "80", "--caps", "1/2,1/8", "--policies", "sliding_window",
                 "--streams", "1", "--ages", "4,40,70", "--families", "gradient", "--style", "world", "--kinds", "all",
                 "--repeats", "1", "--json", str(out), "--plot", str(tmp_path / "needle.png"), "--threads", "1",
                 "--oracle"])
    assert code == 0 and (tmp_path / "needle.png").stat().st_size > 10_000
    result = json.loads(out.read_text())
    assert set(result["summary"]) == {"L=80 M=640 sliding_window", "L=80 M=160 sliding_window"}
    for entry in result["summary"].values():
        rows = [r for r in result["records"] if r["budget"] == entry["budget"]]
        assert entry["cap"] in (0.5, 0.125) and entry["ceiling_full_n"] == len(rows) == entry["ceiling_oracle_n"]
        assert entry["ceiling_oracle"] == pytest.approx(np.mean([r["ceiling_oracle"] for r in rows]), abs=1e-3)
        low, high = entry["ci95"]
        assert low <= entry["accuracy"] <= high
    # the full cache's video at 2 fps spans 2 positions a pair, within the toy's 8,192: no position caution
    item = result["frontier"]["L=80 sliding_window"]
    assert (item["full_span_positions"], item["trained_positions"], item["full_past_trained"]) == (160, 8192, False)
    assert {type(r["ceiling_oracle"]) for r in result["records"]} == {bool}
    assert {r["background"] for r in result["records"]} == {"gradient"}
    assert main(["eval", "needle", "--kinds", "colour", "--json", str(out)]) == 2
    assert main(["eval", "needle", "--oracle", "--full-max-tokens", "0", "--json", str(out)]) == 2


def test_oracle_cut_keeps_only_the_needle_pairs_and_puts_the_cache_back():
    """``oracle_cut``: inside, the cache holds the prefix and every token of the named pairs, nothing else of the
    video, and answers from them; after, every slot (K, V, metadata) and the length are as before, so the stream
    goes on and answers as if nothing happened."""
    import torch

    from edgekv.cache.capped import METADATA_FIELDS, SlotKind
    from edgekv.eval.needle import PolicyRun, encode_stream, oracle_cut, runtime_for

    stream = needle_stream(13, (4, 9), seed=5, events=2)
    runtime = runtime_for("builtin:toy", PolicyRun("full"), 32 + 16 * 13 + 64, 2.0, 64)
    replay = encode_stream(runtime, stream.scene, 13)
    session = runtime.session()
    session.vision = replay
    for pair in range(12):
        for frame in stream.scene.pair_frames(pair):
            session.ingest(frame)
    cache = session.cache
    n = cache.length
    before = {name: getattr(cache, name)[:, :, :n].clone() for name in ("k", "v", *METADATA_FIELDS)}
    question = "How many times did the circle appear?"
    answer = session.ask(question, max_new_tokens=2).text
    needles = {e.first_pair for e in stream.scene.events}
    with oracle_cut(session, needles):
        vision = cache.kind[:, :, :cache.length] == int(SlotKind.VISION)
        assert set(cache.frame[:, :, :cache.length][vision].tolist()) == needles
        assert int(vision[0, 0].sum()) == 16 * len(needles)  # every token of each needle pair
        assert cache.length == int((before["kind"][0, 0] != int(SlotKind.VISION)).sum()) + 16 * len(needles)
        session.ask(question, max_new_tokens=2)
    assert cache.length == n
    for name, value in before.items():
        assert torch.equal(getattr(cache, name)[:, :, :n], value), name
    assert session.ask(question, max_new_tokens=2).text == answer
    for frame in stream.scene.pair_frames(12):  # the stream goes on after it
        session.ingest(frame)
    assert cache.length == n + 16 and int(cache.frame[0, 0, n]) == 12


@pytest.mark.slow
def test_eval_needle_command_end_to_end(tmp_path):
    """The shipped toy model through the real command: a window too short for old events forgets them,
    the full cache keeps them; figures are written."""
    from edgekv.apps.cli import main

    out = tmp_path / "needle.json"
    code = main(["eval", "needle", "--lengths", "120", "--budgets", "600,2200", "--policies",
                 "full,sliding_window,infinipot_v", "--streams", "2", "--ages", "4,90,110", "--json", str(out),
                 "--plot", str(tmp_path / "needle.png"), "--threads", "1"])
    assert code == 0 and (tmp_path / "needle.png").stat().st_size > 10_000
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert "L=120 M=600 full" not in summary  # full only where the stream fits
    full = summary["L=120 M=2200 full"]
    assert full["accuracy"] >= 0.6  # the shipped toy scores 0.72 here (chance over these questions: ~0.35)
    window = summary["L=120 M=600 sliding_window"]["by_age"]
    old = [v for k, v in window.items() if k in ("64-255",)]
    assert old and old[0]["accuracy"] < 0.7 * old[0]["ceiling"]  # events older than the window are forgotten
    for record in result["records"]:
        assert record["bytes"] > 0 and record["predicted"] is not None


def test_eval_needle_with_an_archive_recalls_events_older_than_the_window(tmp_path, capsys):
    """``--archive`` runs each policy twice, without and with a fresh archive (recall at every question);
    archive.* options reach only the archive runs; recalled old events are answered where the window forgot."""
    from edgekv.apps.cli import main

    out = tmp_path / "needle.json"
    code = main(["eval", "needle", "--lengths", "120", "--budgets", "600", "--policies", "sliding_window",
                 "--archive", "--option", "archive.top_k=4", "--streams", "2", "--ages", "4,90,110",
                 "--json", str(out), "--plot", str(tmp_path / "needle.png"), "--threads", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "pairs recalled" in printed
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"L=120 M=600 sliding_window", "L=120 M=600 sliding_window +archive archive.top_k=4"}
    plain = summary["L=120 M=600 sliding_window"]["by_age"]["64-255"]
    recalled = summary["L=120 M=600 sliding_window +archive archive.top_k=4"]["by_age"]["64-255"]
    # measured on these 28 questions, attention scoring: the shipped (round-10) toy 0.18 without the archive,
    # 1.00 with it (ceiling 1.00); round 7 0.11 -> 0.93, round 3 0.11 -> 0.82, round 4 0.18 -> 0.89, round 5
    # 0.14 -> 0.86 (ReKV's cosine scoring: 0.64 with round 3, 0.32 with round 4)
    assert recalled["accuracy"] >= plain["accuracy"] + 0.4
    assert recalled["accuracy"] >= 0.75 * recalled["ceiling"]


def test_eval_needle_skips_statekv_sinks_a_cap_cannot_hold(tmp_path, capsys):
    """StateKV's B sinks live inside the cap: at a cap of B or fewer slots its run is skipped with a line saying so,
    and the other runs (B below the cap, other policies) go on and are written (a 1/64 cap of a 2,000-pair stream
    once ended the whole command at B = 1024, losing every figure before it). So is a B under the cap that leaves
    a compression no room beside the prefix and the recent pairs (B = 64 at the 160-slot floor ended a command)."""
    from edgekv.apps.cli import main

    out = tmp_path / "needle.json"
    code = main(["eval", "needle", "--lengths", "80", "--budgets", "400", "--policies", "statekv,sliding_window",
                 "--sinks", "128,300,512", "--streams", "1", "--ages", "4,40,70", "--json", str(out),
                 "--plot", "", "--threads", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "statekv B=512                skipped: B=512 sinks do not fit a cap of 400 slots" in printed
    assert "statekv B=300                skipped: the compression target C = 0.75 x (M - text_reserve) = " in printed
    assert "and 300 sinks: the minimum is" in printed
    assert set(json.loads(out.read_text())["summary"]) == {"L=80 M=400 statekv B=128", "L=80 M=400 sliding_window"}


def test_eval_needle_skips_archive_runs_whose_recall_a_cap_cannot_hold(tmp_path, capsys):
    """An archive run reserves archive.top_k pairs of the cap for what it recalls: at a cap that cannot hold them
    beside the prefix, two pairs and the text reserve the run is skipped with a line, and the others go on (the
    1/256 floor of 160 slots with top_k = 4 once ended a whole command)."""
    from edgekv.apps.cli import main

    out = tmp_path / "needle.json"
    code = main(["eval", "needle", "--lengths", "80", "--budgets", "170", "--policies", "sliding_window",
                 "--archive", "--option", "archive.top_k=4", "--streams", "1", "--ages", "4,40,70",
                 "--json", str(out), "--plot", "", "--threads", "1"])
    assert code == 0
    assert ("skipped: 170 slots cannot hold the prefix, two pairs, the text reserve and the 4 recalled pairs of "
            "archive.top_k") in capsys.readouterr().out
    assert set(json.loads(out.read_text())["summary"]) == {"L=80 M=170 sliding_window"}


def test_eval_needle_compares_kv_dtypes_at_equal_bytes(tmp_path, capsys):
    """``--kv-dtypes fp16,int8,fp8``: each run once per dtype; the 8-bit ones get the slots that the fp16 cache
    of M tokens takes in bytes (scales and metadata counted), so their caches cost no more than fp16's."""
    from edgekv.apps.cli import main
    from edgekv.cache.specs import KV_DTYPES, CacheSpec
    from edgekv.eval.needle import equal_bytes_slots

    def spec_of(name):  # the shipped toy's cache: 4 layers, 2 KV heads of head_dim 16
        return CacheSpec.uniform(4, 2, 16, KV_DTYPES[name])

    assert equal_bytes_slots(spec_of, 600, "fp16", "fp16") == 600
    int8_toy = equal_bytes_slots(spec_of, 600, "fp16", "int8")
    assert spec_of("int8").bytes_for(int8_toy) <= spec_of("fp16").bytes_for(600) < spec_of("int8").bytes_for(int8_toy + 1)
    assert equal_bytes_slots(spec_of, 600, "fp16", "fp32") < 600 < int8_toy

    out = tmp_path / "needle.json"
    code = main(["eval", "needle", "--lengths", "120", "--budgets", "600", "--policies", "sliding_window",
                 "--kv-dtypes", "fp16,int8,fp8", "--streams", "1", "--ages", "4,90,110", "--json", str(out),
                 "--plot", str(tmp_path / "needle.png"), "--threads", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    assert f"sliding_window kv_dtype=int8 ({int8_toy} slots)" in printed
    assert "frontier L=120 sliding_window kv_dtype=fp8: all questions" in printed
    frontier = json.loads(out.read_text())["frontier"]
    assert set(frontier) == {f"L=120 sliding_window kv_dtype={d}" for d in ("fp16", "int8", "fp8")}
    summary = json.loads(out.read_text())["summary"]
    labels = {f"L=120 M=600 sliding_window kv_dtype={d}": d for d in ("fp16", "int8", "fp8")}
    assert set(summary) == set(labels)
    fp16 = summary["L=120 M=600 sliding_window kv_dtype=fp16"]
    assert summary["L=120 M=600 sliding_window kv_dtype=int8"]["slots"] == int8_toy
    assert fp16["slots"] == 600
    for label, dtype in labels.items():
        entry = summary[label]
        assert entry["budget"] == 600 and entry["bytes"] <= fp16["bytes"]
        if dtype != "fp16":
            assert entry["slots"] > 1.4 * 600  # the toy's head_dim 16: ~1.5x the slots (1.9x at the 3B shape)
            assert entry["bytes"] > 0.98 * fp16["bytes"]
    with pytest.raises(SystemExit):
        main(["eval", "needle", "--kv-dtypes", "int4"])


# ---------------------------------------------------------------------------------------------- eval toy
def test_the_held_out_set_answered_in_parts_gives_the_whole_set_s_figures():
    """``evaluate(part=(i, n))`` on each part, merged, is ``evaluate`` on the whole set (what the card test does
    in two processes); a part outside the set is refused."""
    from edgekv.eval.toy_accuracy import evaluate, merge_parts

    whole = evaluate("builtin:toy", count=4, seed=5)
    merged = merge_parts([evaluate("builtin:toy", count=4, seed=5, part=(i, 2)) for i in range(2)])
    assert whole.pop("seconds") >= 0 and merged.pop("seconds") >= 0
    assert merged == whole and whole["streams"] == 4 and sum(whole["questions"].values()) > 4
    with pytest.raises(ValueError, match="part"):
        evaluate("builtin:toy", count=4, part=(2, 2))


def test_an_interrupted_eval_toy_keeps_the_streams_it_answered(tmp_path, monkeypatch, capsys):
    """Ctrl-C in `eval toy` lost every figure; now the streams answered before it are written (the one under way
    dropped: a stream counts whole, with its long run), marked `interrupted`, exit 130; with nothing answered the
    interrupt goes on."""
    import edgekv.eval.toy_accuracy as toy_accuracy
    from edgekv.apps.cli import main
    from edgekv.session.stream import StreamSession as Session

    real, asked = Session.ask, []

    def cut_at(limit):
        def ask(self, *args, **kwargs):
            asked.append(1)
            if len(asked) == limit:
                raise KeyboardInterrupt
            return real(self, *args, **kwargs)
        return ask

    questions = sum(len(s.questions) for s in toy_accuracy.heldout_streams(2, seed=5))
    monkeypatch.setattr(Session, "ask", cut_at(questions + 1))  # in the third stream's first question
    out = tmp_path / "cut.json"
    try:
        code = main(["eval", "toy", "--streams", "4", "--seed", "5", "--json", str(out)])
    except KeyboardInterrupt:  # (not let through: it would end the test run itself)
        pytest.fail("the interrupt ended eval toy and its figures were lost")
    result = json.loads(out.read_text())
    assert code == 130 and result["interrupted"] == {"streams_done": 2, "streams": 4}
    assert result["streams"] == 2 and sum(result["questions"].values()) == questions
    assert "interrupted" in capsys.readouterr().err
    # the families path: the first family whole, the second cut in its second stream (each stream also asked long)
    asked.clear()
    first = toy_accuracy.heldout_streams(2, seed=5)
    per_family = 2 * sum(len(s.questions) for s in first)  # short and long answers
    monkeypatch.setattr(Session, "ask", cut_at(per_family + 2 * len(first[0].questions) + 1))
    out = tmp_path / "families.json"
    try:
        code = main(["eval", "toy", "--streams", "2", "--seed", "5", "--families", "events,gradient,noise",
                     "--long", "60", "--json", str(out)])
    except KeyboardInterrupt:
        pytest.fail("the interrupt ended eval toy --families and its figures were lost")
    result = json.loads(out.read_text())
    assert code == 130 and list(result["families"]) == ["events", "gradient"]
    assert result["interrupted"] == {"family": "gradient", "streams_done": 1, "streams": 2, "families_left": ["noise"]}
    assert result["families"]["events"]["streams"] == 2 and result["families"]["gradient"]["streams"] == 1
    cut = result["families"]["gradient"]
    assert cut["long"]["streams"] == 1 and cut["all"]["n"] == len(first[0].questions) == cut["long"]["long_all"]["n"]
    monkeypatch.setattr(Session, "ask", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # nothing answered: nothing to keep
        toy_accuracy.evaluate("builtin:toy", count=2, seed=5)


def test_events_spread_over_a_long_stream_keep_every_answer():
    from edgekv.eval.toy_accuracy import heldout_streams, spread_events
    from edgekv.toy.questions import ALL_FAMILIES, sample_question

    for stream in heldout_streams(20, seed=3):
        events = list(stream.scene.events)
        spread = spread_events(events, stream.pairs, 2000, np.random.default_rng(1))
        assert [(e.shape, e.color, e.center, e.radius, e.pairs) for e in spread] == \
            [(e.shape, e.color, e.center, e.radius, e.pairs) for e in events]
        assert all(b.first_pair - a.first_pair >= a2.first_pair - a1.first_pair
                   for a, b, a1, a2 in zip(spread, spread[1:], events, events[1:]))
        assert not spread or spread[-1].last_pair < 2000
        for family in ALL_FAMILIES:
            one = sample_question(events, family, np.random.default_rng(5))
            other = sample_question(spread, family, np.random.default_rng(5))
            assert (one and (one.question, one.answer)) == (other and (other.question, other.answer))


@pytest.mark.slow
def test_eval_toy_on_other_backgrounds_and_long_streams(tmp_path):
    """``eval toy --families``: the card's streams on another background and inside long streams, with
    intervals; the shipped renderer's figures are the plain command's."""
    from edgekv.apps.cli import main

    out = tmp_path / "toy.json"
    assert main(["eval", "toy", "--streams", "4", "--families", "events,gradient+noise", "--long", "60",
                 "--long-streams", "2", "--questions", "all", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["families"]) == ["events", "gradient+noise"]
    for entry in result["families"].values():
        assert entry["all"]["n"] == sum(v["n"] for v in entry["by_question"].values())
        assert entry["long"]["short_all"]["n"] == entry["long"]["long_all"]["n"] > 0
        for figures in entry["by_question"].values():
            assert figures["ci95"][0] <= figures["accuracy"] <= figures["ci95"][1]
        for question, table in entry["confusion"].items():  # answer -> what the toy said, right ones on the diagonal
            figures = entry["by_question"][question]
            assert sum(sum(row.values()) for row in table.values()) == figures["n"]
            assert sum(row.get(answer, 0) for answer, row in table.items()) == figures["correct"]
    plain = tmp_path / "plain.json"
    assert main(["eval", "toy", "--streams", "4", "--json", str(plain)]) == 0
    base = json.loads(plain.read_text())["accuracy"]
    assert {q: v["accuracy"] for q, v in result["families"]["events"]["by_question"].items() if q in base} == base
    assert main(["eval", "toy", "--families", "marble"]) == 2


# ---------------------------------------------------------------------------------------------- videoqa
def _write_video(path: Path, frames: int = 8, size=(96, 128)) -> None:
    cv2 = pytest.importorskip("cv2")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 4.0, (size[1], size[0]))
    rng = np.random.default_rng(len(str(path)))
    for _ in range(frames):
        writer.write(rng.integers(0, 256, size=(*size, 3), dtype=np.uint8))
    writer.release()
    assert path.stat().st_size > 0


def _mlvu(root: Path) -> Path:
    items = [{"video": "a.avi", "duration": 2, "question": "What happens?", "candidates": ["x", "y", "z", "w"],
              "answer": "z", "question_type": "plotQA"},
             {"video": "b.avi", "duration": 2, "question": "Who?", "candidates": ["p", "q", "r", "s"], "answer": "p",
              "question_type": "plotQA"}]
    (root / "json").mkdir(parents=True)
    (root / "json" / "1_plotQA.json").write_text(json.dumps(items))
    (root / "json" / "8_sub_scene.json").write_text(json.dumps([{"video": "a.avi", "question": "Describe",
                                                                  "answer": "long text"}]))  # not multiple choice
    for name in ("a.avi", "b.avi"):
        _write_video(root / "video" / "1_plotQA" / name)
    return root


def _videomme(root: Path, fmt: str) -> Path:
    rows = [{"video_id": "001", "duration": "short", "domain": "Knowledge", "sub_category": "x", "url": "u",
             "videoID": "vid1", "question_id": "001-1", "task_type": "Counting Problem", "question": "How many?",
             "options": ["A. one", "B. two", "C. three", "D. four"], "answer": "B"},
            {"video_id": "001", "duration": "short", "domain": "Knowledge", "sub_category": "x", "url": "u",
             "videoID": "vid1", "question_id": "001-2", "task_type": "Object Recognition", "question": "What?",
             "options": ["A. cat", "B. dog", "C. car", "D. cup"], "answer": "D"}]
    folder = root / "videomme"
    folder.mkdir(parents=True)
    if fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), folder / "test-00000-of-00001.parquet")
    else:
        (folder / "test.json").write_text(json.dumps(rows))
    _write_video(root / "data" / "vid1.avi")
    return root


def test_mlvu_layout_is_read_and_prompted_like_infinipot_v(tmp_path):
    items = load_mlvu(_mlvu(tmp_path / "MLVU"))
    assert [i.answer for i in items] == ["C", "A"]  # generation tasks are left out
    assert items[0].task == "plotQA" and items[0].video.name == "a.avi"
    assert prompt(items[0], "mlvu", "infinipot_v") == (
        "Question: What happens?\nOptions:\n(A) x\n(B) y\n(C) z\n(D) w\n"
        "Respond with only the letter (A, B, C or D) of the correct option.")


@pytest.mark.parametrize("fmt", ["parquet", "json"])
def test_videomme_layout_is_read(tmp_path, fmt):
    items = load_videomme(_videomme(tmp_path / "vmme", fmt))
    assert [i.answer for i in items] == ["B", "D"] and items[0].video.name == "vid1.avi"
    assert prompt(items[0], "videomme", "infinipot_v").endswith(
        "Respond with only the letter (A, B, C, or D) of the correct option.")
    assert "A. one" in prompt(items[0], "videomme", "infinipot_v")


def test_mlvu_and_videomme_annotations_that_cannot_be_read_are_refused_naming_the_file(tmp_path):
    """A non-UTF-8 annotation file was refused with the decoder's message alone (no file named); options given as
    one string had each of its characters read as an option."""
    from edgekv.eval.qa_item import DatasetError

    mlvu = _mlvu(tmp_path / "MLVU")
    annotation = mlvu / "json" / "1_plotQA.json"
    annotation.write_bytes(b"\xff\xfe[")
    with pytest.raises(DatasetError, match="1_plotQA.json: not a readable JSON file"):
        load_mlvu(mlvu)
    annotation.write_text(json.dumps([{"video": "a.avi", "question": "Q?", "candidates": "xyzw", "answer": "z"}]))
    with pytest.raises(DatasetError, match="1_plotQA.json: item 0 .*not a list"):
        load_mlvu(mlvu)
    vmme = _videomme(tmp_path / "vmme", "json")
    rows = json.loads((vmme / "videomme" / "test.json").read_text())
    (vmme / "videomme" / "test.json").write_text(json.dumps([{**rows[0], "options": "ABCD"}]))
    with pytest.raises(DatasetError, match="row 0 .*not a list"):
        load_videomme(vmme)
    (vmme / "videomme" / "test.json").write_bytes(b"\xff\xfe[")
    with pytest.raises(DatasetError, match="test.json: not a readable JSON file"):
        load_videomme(vmme)
    (vmme / "videomme" / "test.json").write_text(json.dumps(rows[0]))  # an object, not a list of rows
    with pytest.raises(DatasetError, match="test.json: expected a JSON list"):
        load_videomme(vmme)


@pytest.mark.parametrize("reply, letter", [("B", "B"), ("(D) four", "D"), ("The answer is A.", "A"),
                                           ("[C]", "C"), ("no idea", ""), ("Answer: B", "B"), ("Based on it", "")])
def test_letter_extraction(reply, letter):
    assert extract_letter(reply) == letter


def test_a_reply_with_no_option_letter_is_scored_wrong_and_counted():
    """Not read as C (a free guess that is right one time in four when C is the key): wrong, as Video-MME's scorer
    has it, and counted in the summary."""
    from edgekv.eval.videoqa import summarize

    records = [{"task": "t", "answer": "C", "predicted": extract_letter(reply, 4), "reply": reply}
               for reply in ("I cannot tell.", "C", "(A)")]
    for record in records:
        record["correct"] = record["predicted"] == record["answer"]
    summary = summarize(records, "mlvu")
    assert [r["correct"] for r in records] == [False, True, False]
    assert summary["no_letter"] == 1 and summary["overall"] == pytest.approx(33.33)


def test_eval_videoqa_runs_resumes_and_refuses_a_bad_layout(tmp_path, tiny_checkpoint, capsys):
    from edgekv.apps.cli import main

    data = _mlvu(tmp_path / "MLVU")
    out = tmp_path / "out"
    args = ["eval", "videoqa", "--model", str(tiny_checkpoint), "--dataset", "mlvu", "--data", str(data),
            "--resolution", "56", "56", "--fps", "2", "--max-tokens", "768", "--text-reserve", "384", "--dtype", "fp32",
            "--out", str(out)]
    assert main(args) == 0
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2
    # MLVU's own rule reads the continuation of "Best option:(" (a random model's is anything: scored as it is)
    assert all((row["scored_by"], row["answer_prefix"]) == ("mlvu", "Best option:(") for row in map(json.loads, lines))
    # MLVU's own budget (its VideoChat2 run's 100 new tokens); each line says how the reply ended
    assert all(row["max_new_tokens"] == 100 and row["finish_reason"] in ("stop", "length")
               for row in map(json.loads, lines))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["budget_tokens"] == 768 and summary["policy"] == "infinipot_v"
    assert summary["accuracy"]["questions"] == 2 and "plotQA" in summary["accuracy"]["per_task"]
    assert summary["accuracy"]["all"]["n"] == 2 and len(summary["accuracy"]["tasks"]["plotQA"]["ci95"]) == 2
    assert summary["questions_asked"] == "after the whole video"
    assert {json.loads(line)["frames_seen"] for line in lines} == {4}  # 8 frames at 4 fps, sampled at 2 fps
    assert summary["throughput"]["ingest_frames_per_s_mean"] > 0
    cut = sum(json.loads(line)["finish_reason"] == "length" for line in lines)
    assert summary["accuracy"]["cut_at_max_new_tokens"] == cut
    assert main(args) == 0  # resumed: nothing asked again
    assert len((out / "results.jsonl").read_text().splitlines()) == 2
    capsys.readouterr()
    assert main(["eval", "videoqa", "--model", str(tiny_checkpoint), "--dataset", "videomme",
                 "--data", str(data), "--out", str(out)]) == 2
    assert "no Video-MME annotations" in capsys.readouterr().err


def test_toy_confusion_tallies_answers_against_predictions():
    from edgekv.eval.toy_accuracy import confusion

    table = confusion([("one", "one"), ("one", "two"), ("two", "two"), ("one", "two"), ("zero", "<unk>")])
    assert table == {"one": {"one": 1, "two": 2}, "two": {"two": 1}, "zero": {"<unk>": 1}}
    assert confusion([]) == {}


# ---------------------------------------------------------------------------------------------- eval compare
def _needle_file(path: Path, runs: dict[str, list[bool]], caps=(0.0625,), streams=2) -> Path:
    """A needle JSON whose runs answered the same questions: ``runs`` maps a policy label to its answers, in
    order over (cap, stream, question)."""
    records = []
    for policy, answers in runs.items():
        it = iter(answers)
        for cap in caps:
            for stream in range(streams):
                for q in range(len(answers) // (len(caps) * streams)):
                    records.append({"length": 2000, "stream": stream, "budget": int(cap * 32000), "policy": policy,
                                    "question": f"Was there a red shape {q}?", "answer": "yes", "checkpoint": 2000,
                                    "size": 112, "background": "photo", "cap": cap, "correct": next(it)})
    path.write_text(json.dumps({"records": records}))
    return path


def test_eval_compare_pairs_questions_and_tests_the_discordant_ones(tmp_path, capsys):
    from edgekv.apps.cli import main
    from edgekv.eval.compare import compare, mcnemar_exact

    a = [True] * 16 + [False] * 4         # 2 streams x 10 questions
    b = [True] * 4 + [False] * 6 + [True] * 10  # loses 6 of A's in stream 0, wins A's 4 misses in stream 1
    one = _needle_file(tmp_path / "one.json", {"infinipot_v": a, "tar": b})
    result = compare(f"{one}@infinipot_v", f"{one}@tar")
    cell = result["cells"][0]
    assert (cell["n"], cell["a"], cell["b"], cell["only_a"], cell["only_b"]) == (20, 0.8, 0.7, 6, 4)
    half = 1.959964 * math.sqrt(10 - 2 ** 2 / 20) / 20  # Wald, matched pairs: ((b + c) - (c - b)^2 / n) / n^2
    assert cell["diff"] == -0.1 and cell["ci95"] == [round(-0.1 - half, 4), round(-0.1 + half, 4)]
    assert cell["p_mcnemar"] == round(mcnemar_exact(6, 4), 4) == round(2 * (1 + 10 + 45 + 120 + 210) / 1024, 4)
    assert cell["streams"] == {"b_better": 1, "b_worse": 1, "equal": 0}  # stream 0 lost 6, stream 1 won 4
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(0, 10) < 0.002
    # across files: the same streams under another setting
    two = _needle_file(tmp_path / "two.json", {"infinipot_v": b})
    assert main(["eval", "compare", f"{one}@infinipot_v", str(two), "--json", str(tmp_path / "c.json")]) == 0
    assert "B-A -0.100" in capsys.readouterr().out
    assert json.loads((tmp_path / "c.json").read_text())["all"]["n"] == 20


def test_eval_compare_refuses_what_it_cannot_pair(tmp_path, capsys):
    from edgekv.apps.cli import main

    one = _needle_file(tmp_path / "one.json", {"infinipot_v": [True] * 4, "tar": [False] * 4})
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"records": [{"length": 500, "stream": 0, "budget": 100, "policy": "tar",
                                              "question": "q", "answer": "yes", "checkpoint": 1, "correct": True}]}))
    (tmp_path / "bad.json").write_text("{not json")
    for a, b, said in ((str(one), f"{one}@tar", "holds 2 runs, name one"),
                       (f"{one}@van", f"{one}@tar", "no run 'van'"),
                       (f"{one}@tar", str(other), "share no question"),
                       (str(tmp_path / "bad.json"), str(other), "not JSON"),
                       (str(tmp_path / "none.json"), str(other), "cannot read it")):
        assert main(["eval", "compare", a, b]) == 2
        assert said in capsys.readouterr().err


def test_eval_compare_refuses_runs_of_other_streams(tmp_path, capsys):
    """Runs of another --seed share a question's key (stream, checkpoint, question, answer) now and then; those
    were paired and tested as the same questions, exit 0."""
    from edgekv.apps.cli import main

    config = {"model": "builtin:toy", "streams": 2, "seed": 1, "families": ["events"]}
    one = _needle_file(tmp_path / "one.json", {"infinipot_v": [True] * 4})
    two = _needle_file(tmp_path / "two.json", {"tar": [True, False] * 2})
    for path, seed in ((one, 1), (two, 2)):
        path.write_text(json.dumps({**json.loads(path.read_text()), "config": {**config, "seed": seed}}))
    assert main(["eval", "compare", str(one), str(two)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "drew different streams: seed is 1 against 2" in err
    two.write_text(json.dumps({**json.loads(two.read_text()), "config": config}))  # the same streams: compared
    assert main(["eval", "compare", str(one), str(two)]) == 0 and "B-A -0.500" in capsys.readouterr().out


def test_needle_blame_tool_adds_the_background_back_a_window_at_a_time(tmp_path):
    """``tools/needle_blame.py``: one ingest; the last checkpoint's questions asked of the whole cache, of the needle
    pairs alone and of the needle pairs plus each window of background pairs (every background pair in exactly one
    window); the whole cache answers as ``eval needle``'s full cache does on the same stream."""
    import importlib.util

    tool = Path(__file__).parents[1] / "tools" / "needle_blame.py"
    spec = importlib.util.spec_from_file_location("needle_blame", tool)
    blame = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(blame)
    out = tmp_path / "blame.json"
    result = blame.main(["--length", "40", "--seed", "3", "--family", "gradient", "--window", "16",
                         "--out", str(out)])
    stream = needle_stream(40, (2, 8, 32), 3000, 6, family="gradient", kinds=ALL_FAMILIES, repeats=2, style="world")
    needles = {p for e in stream.scene.events for p in range(max(0, e.first_pair - 3), e.last_pair + 1)}
    covered = [p for w in result["windows"] for p in range(w["pairs"][0], w["pairs"][1] + 1) if p not in needles]
    assert sorted(covered) == [p for p in range(40) if p not in needles]
    assert result["questions"] == len([p for p in stream.probes if p.checkpoint == 40]) > 0
    assert result["full"]  # the shipped toy misreads two of this stream's questions: the comparison below bites
    assert all(set(m) == {"question", "answer", "said"} for m in result["full"] + result["needles_only"])
    assert json.loads(out.read_text())["windows"] == result["windows"]

    from edgekv.apps.cli import main

    needle_out = tmp_path / "needle.json"
    assert main(["eval", "needle", "--lengths", "40", "--ages", "2,8,32", "--events", "6", "--repeats", "2",
                 "--kinds", "all", "--families", "gradient", "--style", "world", "--streams", "1", "--seed", "3",
                 "--caps", "1/4", "--policies", "sliding_window", "--oracle", "--json", str(needle_out),
                 "--plot", str(tmp_path / "n.png")]) == 0
    records = [r for r in json.loads(needle_out.read_text())["records"] if r["checkpoint"] == 40]
    assert {r["question"] for r in records if not r["ceiling_full"]} == {m["question"] for m in result["full"]}
    assert {r["question"] for r in records if not r["ceiling_oracle"]} == {m["question"] for m in result["needles_only"]}


def test_toy_near_white_tool_sorts_answers_by_near_white_share_and_caps_only_the_background(tmp_path):
    """``tools/toy_near_white.py``: the card's held-out streams on one family, answered as ``eval toy --families``
    answers them, sorted into near-white bins that partition them; ``--cap`` redraws the same streams with the
    background (only) capped."""
    import importlib.util

    from edgekv.eval.toy_accuracy import evaluate_families, heldout_streams, scene_for
    from edgekv.video.events import COLOR_BGR

    tool = Path(__file__).parents[1] / "tools" / "toy_near_white.py"
    spec = importlib.util.spec_from_file_location("toy_near_white", tool)
    near = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(near)
    out = tmp_path / "near.json"
    result = near.main(["--family", "gradient", "--streams", "4", "--cap", "120", "--out", str(out)])
    reference = evaluate_families("builtin:toy", ("gradient",), count=4)["families"]["gradient"]
    assert result["as_drawn"]["all"] == reference["all"]
    assert result["as_drawn"]["by_question"] == reference["by_question"]
    assert sum(b["all"]["n"] for b in result["as_drawn"]["bins"] if b["all"]) == reference["all"]["n"]
    assert result["capped"]["all"]["n"] == reference["all"]["n"]
    assert json.loads(out.read_text())["capped"] == json.loads(json.dumps(result["capped"]))
    # the capped scene: the events in their colours, the background at most the cap (no noise here), the same scene
    stream = heldout_streams(4)[1]
    scene = scene_for(stream, "gradient")
    event = stream.scene.events[0]
    frame_index = 2 * event.first_pair
    same = near.capped(scene, 255.0)
    assert np.array_equal(same.frame(frame_index), scene.frame(frame_index))
    plain = scene_for(stream, "gradient", style=scene.style.__class__(noise=0.0))
    low = near.capped(plain, 120.0).frame(frame_index)
    shown = plain.mask(event)
    assert np.all(low[shown] == COLOR_BGR[event.color])
    assert low[~shown].max() <= 120 and plain.frame(frame_index)[~shown].max() > 120
    assert near.near_white_share(scene, stream.pairs) == pytest.approx(
        float((np.stack([scene.frame(2 * p) for p in range(0, stream.pairs, 4)]).min(axis=3) > 200).mean()))


def test_frontier_pairs_each_cap_with_the_full_cache_and_prints_the_p_of_a_break():
    """A cap under 90 % of the full cache on the long stream is tested against it on the same questions (exact
    McNemar on the discordant ones), and the verdict prints that p."""
    from edgekv.eval.cli import format_frontier
    from edgekv.eval.compare import mcnemar_exact
    from edgekv.eval.needle import frontier, summarize

    records = []
    # 40 questions; the full cache answers the first 30; the 1/4 cap 29 of them, the 1/64 cap 20 of them plus 2
    # the full cache misses
    for budget, right in ((4000, set(range(29))), (250, set(range(20)) | {35, 36})):
        for i in range(40):
            records.append({"length": 1000, "budget": budget, "bytes": budget, "policy": "infinipot_v",
                            "family": "color", "kind": "color", "correct": i in right, "age": 10,
                            "ceiling_correct": i < 32, "ceiling_full": i < 30, "size": 112, "cap": None,
                            "cap_actual": budget / 16000})
    summary = summarize(records)
    assert summary["L=1000 M=250 infinipot_v"]["vs_full"] == {"only_cap": 2, "only_full": 10,
                                                             "p_mcnemar": round(mcnemar_exact(2, 10), 4)}
    item = frontier(summary)["L=1000 infinipot_v"]
    assert item["caps"][0]["vs_full"]["only_full"] == 1 and item["breaks_at"] == 250 / 16000  # 22 / 30 = 0.73
    assert (f"all questions breaks at 1/64 (McNemar p {mcnemar_exact(2, 10):.3f} against the full cache on the same "
            "questions: 10 right only with it, 2 only with the cap)") in format_frontier({"x": item})
    for r in records:
        r["ceiling_full"] = None  # no full cache run: no pairing, the verdict as before
    plain = frontier(summarize(records))["L=1000 infinipot_v"]
    assert plain["caps"][1]["vs_full"] is None and "McNemar" not in format_frontier({"x": plain})
    item["caps"][1]["vs_full"]["p_mcnemar"] = 0.0004
    assert "breaks at 1/64 (McNemar p < 0.001 against" in format_frontier({"x": item})
