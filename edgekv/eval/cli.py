"""``edgekv eval needle`` and ``edgekv eval videoqa``: argument parsing (the work lives beside this file)."""

from __future__ import annotations

import argparse
import sys

from edgekv.helpformat import HelpFormatter
from edgekv.threads import threads_argument

ALL_POLICIES = ("full", "sliding_window", "uniform_frames", "sink_recent", "tar", "van", "infinipot_v",
                "adaptive_infinipot_v", "statekv")
DEFAULT_POLICIES = tuple(name for name in ALL_POLICIES if name != "adaptive_infinipot_v")  # opt-in (issue 14)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return tuple(dict.fromkeys(values))  # a length, cap or B given twice ran twice: every question counted twice


def _fractions(text: str) -> tuple[float, ...]:
    """``"1/4,1/16,0.01"`` -> (0.25, 0.0625, 0.01): shares in (0, 1]."""
    values = []
    for item in (v.strip() for v in text.split(",") if v.strip()):
        top, slash, bottom = item.partition("/")
        try:
            value = float(top) / float(bottom) if slash else float(item)
        except (ValueError, ZeroDivisionError):
            raise argparse.ArgumentTypeError(f"expected shares like 1/4,1/16,0.01, got {item!r}") from None
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"a cap share must be in (0, 1], got {item!r}")
        if value not in values:  # 1/4 and 0.25 are one cap, run once
            values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"expected shares like 1/4,1/16, got {text!r}")
    return tuple(values)


def _kv_dtypes(text: str) -> tuple[str, ...]:
    from edgekv.cache.specs import KV_DTYPES

    names = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [n for n in names if n not in KV_DTYPES]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct K/V dtypes from {', '.join(KV_DTYPES)}, got {text!r}")
    return names


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (a cache key), got {text!r}")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, value


def _lure_looks(args: argparse.Namespace, problems: list[str]) -> tuple[str | tuple[str, ...], tuple[str, ...]]:
    """(lure_colors, lure_shapes) of NeedleConfig from --lure-colors / --lure-shapes; what is wrong goes to
    ``problems``."""
    from edgekv.video.events import COLORS
    from edgekv.video.world import DISTRACTOR_SHAPES

    text = args.lure_colors.strip()
    colors: str | tuple[str, ...] = "free" if text == "free" else () if text in ("any", "") else \
        tuple(c.strip() for c in text.split(",") if c.strip())
    shapes = tuple(s.strip() for s in args.lure_shapes.split(",") if s.strip())
    if isinstance(colors, tuple) and (unknown := [c for c in colors if c not in COLORS]):
        problems.append(f"--lure-colors: unknown {', '.join(unknown)} (any, free, or of {', '.join(COLORS)})")
    if unknown := [s for s in shapes if s not in DISTRACTOR_SHAPES]:
        problems.append(f"--lure-shapes: unknown {', '.join(unknown)} (of {', '.join(DISTRACTOR_SHAPES)})")
    if (colors or shapes) and not args.lures:
        problems.append("--lure-colors / --lure-shapes: the looks of the lures, and --lures is 0: give --lures")
    return colors, shapes


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval", required=True)
    needle = sub.add_parser(
        "needle", formatter_class=HelpFormatter,
        help="toy-model answer accuracy per cache policy x cap x stream length x event age (JSON + PNG)")
    needle.add_argument("--model", default="builtin:toy",
                        help="a toy checkpoint dir (builtin:toy = the shipped one; builtin:toy-224 its 224 x 224 "
                             "variant, for --sizes 224)")
    needle.add_argument("--lengths", type=_ints, default=(2000,), help="stream lengths in frame pairs")
    needle.add_argument("--budgets", type=_ints, default=None,
                        help="cache caps M in tokens (default 4000 when --caps is not given)")
    needle.add_argument("--caps", type=_fractions, default=(),
                        help="cache caps as shares of the stream's video tokens, e.g. 1/4,1/16,1/64,1/256 "
                             "(at least the prefix, four frame pairs and the text reserve)")
    needle.add_argument("--families", default="events",
                        help="background family per stream, in turn: events (the classic renderer) or world "
                             "families / groups (edgekv.video.world: procedural, photos, videos, all)")
    needle.add_argument("--style", choices=("mild", "world"), default="mild",
                        help="world streams: mild (only the background differs) or world (random camera, light, "
                             "JPEG, out-of-vocabulary distractors, occlusion, event sizes one cell to a quarter frame)")
    needle.add_argument("--busy", type=float, default=0.0,
                        help="world families: out-of-vocabulary objects passing through the frame, per frame pair "
                             "(0-1, each on screen 1-6 pairs; whatever --style draws): a busy scene where what the "
                             "cache must keep competes with what is new but never asked about")
    needle.add_argument("--lures", type=float, default=0.0,
                        help="the share (0-1) of the passing objects drawn in the vocabulary's colours (a red star, "
                             "a blue ring): as salient as a needle to a cache that cannot know the question")
    needle.add_argument("--lure-colors", default="any",
                        help="the colours of the lures: any of the vocabulary's, free (those no event of the stream "
                             "wears: no lure shares a question's colour) or a comma-separated list")
    needle.add_argument("--lure-shapes", default="",
                        help="the shapes of the lures, a comma-separated list of star, ring, hexagon, ellipse "
                             "(default: any of them)")
    needle.add_argument("--sizes", type=_ints, default=(112,), help="frame sides: 112 (16 tokens per pair), 224 (64)")
    needle.add_argument("--kinds", default="base",
                        help="question families: base (colour, shape, exists, order, count), all (also where, "
                             "second, binding) or a comma-separated list")
    needle.add_argument("--repeats", type=int, default=0,
                        help="events that bring a needle's shape back in another colour at another age (counts "
                             "across gaps: count_gap; second colour; binding)")
    needle.add_argument("--full-max-tokens", type=int, default=40000,
                        help="run the full cache on the long stream (the ceiling) where it needs at most this "
                             "many tokens; 0: never")
    needle.add_argument("--oracle", action="store_true",
                        help="the full cache (where it runs) also answers cut down to the needle pairs seen so far "
                             "and the 3 before each, as the short streams show them: what a cache that knew the "
                             "questions would answer; apart from the full cache, the background's distraction "
                             "(ceiling_oracle per record)")
    needle.add_argument("--kv-dtypes", type=_kv_dtypes, default=(),
                        help="compare K/V storage dtypes at equal bytes: every run once per dtype, each given the "
                             "slots that the first dtype's cache of M tokens takes in bytes (e.g. fp16,int8,fp8)")
    needle.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help=f"comma-separated policies ({', '.join(ALL_POLICIES)})")
    needle.add_argument("--sinks", type=_ints, default=(256, 1024), help="StateKV sink budgets B for 'statekv'")
    needle.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                        help="extra cache key for every run (SECTION.KEY for another section), e.g. tar_rope=raw, "
                             "tar_ratio=0.25, rebase_position=2048, archive.top_k=16")
    needle.add_argument("--archive", action="store_true",
                        help="also run every policy with a fresh archive on flash and recall at each question "
                             "(archive.* options apply, e.g. --option archive.top_k=16)")
    needle.add_argument("--streams", type=int, default=4, help="streams per length")
    needle.add_argument("--events", type=int, default=3, help="needle events per stream")
    needle.add_argument("--ages", type=_ints, default=None, help="event ages in pairs before the end")
    needle.add_argument("--fps", type=float, default=2.0)
    needle.add_argument("--seed", type=int, default=0)
    needle.add_argument("--threads", type=threads_argument, default=1,
                        help="torch CPU threads (the toy's matrices are tiny: one thread avoids sync waits)")
    needle.add_argument("--json", default="out/eval-needle.json")
    needle.add_argument("--plot", default="out/eval-needle.png", help="PNG to write ('' to skip)")
    needle.set_defaults(run=_run_needle)

    compare = sub.add_parser(
        "compare", formatter_class=HelpFormatter,
        help="two needle runs on the same streams, question by question: both accuracies per cap, the paired "
             "difference with its 95 %% interval, McNemar's exact p and per-stream better / worse counts")
    compare.add_argument("a", metavar="A", help="an `eval needle --json` file, or FILE@POLICY when it holds several "
                                              "runs (the label as printed, e.g. 'infinipot_v kv_dtype=int8')")
    compare.add_argument("b", metavar="B", help="the same for the setting compared against A")
    compare.add_argument("--json", default=None, help="also write the figures here")
    compare.set_defaults(run=_run_compare)

    merge = sub.add_parser(
        "merge", formatter_class=HelpFormatter,
        help="needle runs made in parts on the same streams (e.g. one policy a process) as one result: each "
             "question's full-cache ceiling shared by every part, the summary, frontier and figure made anew")
    merge.add_argument("parts", metavar="PART", nargs="+", help="`eval needle --json` files of the same streams")
    merge.add_argument("--json", default="out/eval-needle-merged.json")
    merge.add_argument("--plot", default="out/eval-needle-merged.png", help="PNG to write ('' to skip)")
    merge.set_defaults(run=_run_merge)

    from edgekv.eval.toy_accuracy import add_toy_arguments

    add_toy_arguments(sub.add_parser(
        "toy", formatter_class=HelpFormatter,
        help="the toy model's accuracy per question family on the fixed held-out set (full cache)"))

    from edgekv.eval.videoqa import add_videoqa_arguments

    add_videoqa_arguments(sub.add_parser(
        "videoqa", formatter_class=HelpFormatter,
        help="accuracy of real Qwen2.5-VL weights on MLVU, Video-MME (after each video) or OVO-Bench, "
             "StreamingBench, RVS-Ego/Movie (questions at their timestamps while the video streams); local files"))


def _run_needle(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from edgekv.eval.needle import DEFAULT_AGES, NeedleConfig, PolicyRun, evaluate, save

    if args.threads:
        from edgekv.threads import apply_threads

        apply_threads(args.threads)
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in ALL_POLICIES]
    if unknown:
        print(f"edgekv eval needle: --policies: unknown {', '.join(unknown)} (known: {', '.join(ALL_POLICIES)})",
              file=sys.stderr)
        return 2
    options = tuple(args.option)
    runs = []
    for name in dict.fromkeys(names):  # a policy named twice ran twice: its accuracy's interval over doubled n
        for archive in ((False, True) if args.archive and name != "full" else (False,)):
            # archive.* options belong to the runs that have an archive only
            own = options if archive else tuple(o for o in options if not o[0].startswith("archive."))
            if name == "statekv":
                runs.extend(PolicyRun(name, sinks, own, archive) for sinks in args.sinks)
            else:
                runs.append(PolicyRun(name, 0, own, archive))
    from edgekv.toy.questions import ALL_FAMILIES, FAMILIES

    kinds = {"base": FAMILIES, "all": ALL_FAMILIES}.get(args.kinds) or tuple(
        k.strip() for k in args.kinds.split(",") if k.strip())
    problems = [k for k in kinds if k not in ALL_FAMILIES]
    families = tuple(f.strip() for f in args.families.split(",") if f.strip())
    try:
        if families != ("events",):
            from edgekv.video.world import family_problem, parse_families

            families = tuple(n for name in families for n in (("events",) if name == "events" else parse_families(name)))
            problems += [p for f in families if f != "events" and (p := family_problem(f))]
    except ValueError as exc:
        problems.append(str(exc))
    if not 0 <= args.busy <= 1:
        problems.append(f"--busy: passing objects per frame pair in [0, 1], got {args.busy}")
    if not 0 <= args.lures <= 1:
        problems.append(f"--lures: a share in [0, 1], got {args.lures}")
    elif args.lures and not args.busy and args.style == "mild":
        problems.append("--lures: a share of the passing objects, and mild streams have none: give --busy")
    elif (args.busy or args.lures) and "events" in families:
        problems.append("--busy / --lures: the classic renderer (family events) draws no passing objects; choose world "
                        "families (--families photo,cells, ...)")
    lure_colors, lure_shapes = _lure_looks(args, problems)
    if args.streams < 1 or args.events < 0:  # 0 streams wrote an empty result and exit 0
        problems.append(f"--streams at least 1 and --events at least 0, got {args.streams} and {args.events}")
    if args.json and args.plot and Path(args.json).resolve() == Path(args.plot).resolve():
        problems.append(f"--json and --plot are the same file {args.json!r}: the figure would replace the JSON")
    if args.oracle and args.full_max_tokens <= 0:
        problems.append("--oracle cuts the full cache down to the needle pairs, and --full-max-tokens 0 never runs it")
    if problems or any(size % 28 for size in args.sizes) or args.repeats < 0:
        detail = "; ".join(problems) or "--sizes must be multiples of 28 and --repeats at least 0"
        if any(k not in ALL_FAMILIES for k in kinds):
            detail = f"--kinds: unknown {', '.join(k for k in kinds if k not in ALL_FAMILIES)} (known: " \
                     f"{', '.join(ALL_FAMILIES)}, base, all)"
        print(f"edgekv eval needle: {detail}", file=sys.stderr)
        return 2
    budgets = args.budgets if args.budgets is not None else (() if args.caps else (4000,))
    if names and all(name == "full" for name in names):  # the full cache runs only where the whole stream fits
        from edgekv.eval.needle import _tokens_needed, cap_budget, tokens_per_pair

        reserve = NeedleConfig.reserve
        short = [(size, length, need, most) for size in args.sizes for length in args.lengths
                 if (need := _tokens_needed(None, length, reserve, tokens_per_pair(size)))
                 > (most := max([*budgets, *(cap_budget(c, length, size, reserve) for c in args.caps)], default=0))]
        if short:
            size, length, need, most = short[0]
            print(f"edgekv eval needle: --policies full runs only at a cap that holds the whole stream: a {length}-pair "
                  f"stream at {size}x{size} needs {need} tokens and the largest cap gives {most} (give --budgets "
                  f"{need} or more; the full cache also runs beside every other policy, --full-max-tokens)",
                  file=sys.stderr)
            return 2
    config = NeedleConfig(model=args.model, lengths=args.lengths, budgets=budgets, runs=tuple(runs),
                          ages=args.ages or DEFAULT_AGES, streams=args.streams, events=args.events, fps=args.fps,
                          seed=args.seed, families=families, style=args.style, sizes=args.sizes, kinds=kinds,
                          repeats=args.repeats, caps=args.caps, full_max_tokens=args.full_max_tokens,
                          kv_dtypes=args.kv_dtypes, busy=args.busy, lures=args.lures, oracle=args.oracle,
                          lure_colors=lure_colors, lure_shapes=lure_shapes)
    result = evaluate(config)
    save(result, args.json, args.plot)
    print(format_summary(result["summary"]))
    print(format_frontier(result["frontier"]))
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    if "interrupted" in result:  # the figures of the whole streams are written; the exit says it was cut short
        print(f"interrupted: the figures are of {result['interrupted']['streams_done']} whole stream(s), not of "
              f"--streams {args.streams} (eval merge refuses such a part)")
        return 130
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from edgekv.eval.compare import compare, format_comparison

    try:
        result = compare(args.a, args.b)
    except ValueError as exc:
        print(f"edgekv eval compare: {exc}", file=sys.stderr)
        return 2
    print(format_comparison(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0


def _run_merge(args: argparse.Namespace) -> int:
    from pathlib import Path

    from edgekv.eval.merge import merge
    from edgekv.eval.needle import save

    if args.json and args.plot and Path(args.json).resolve() == Path(args.plot).resolve():
        print(f"edgekv eval merge: --json and --plot are the same file {args.json!r}: the figure would replace the "
              f"JSON", file=sys.stderr)
        return 2
    try:
        result = merge(args.parts)
    except ValueError as exc:
        print(f"edgekv eval merge: {exc}", file=sys.stderr)
        return 2
    save(result, args.json, args.plot)
    print(format_summary(result["summary"]))
    print(format_frontier(result["frontier"]))
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def format_summary(summary: dict) -> str:
    lines = []
    for entry in summary.values():
        ages = "  ".join(f"{b}:{v['accuracy']:.2f}/{v['ceiling']:.2f}" for b, v in entry["by_age"].items())
        size = f" {entry['size']}px" if entry.get("size", 112) != 112 else ""
        cap = f" ({entry['cap_actual'] and '1/%.0f' % (1 / entry['cap_actual'])})" if entry.get("cap") else ""
        full = (f", full cache on this stream {entry['ceiling_full']:.3f}" if entry.get("ceiling_full") is not None
                else "")
        full += (f", cut to the needle pairs {entry['ceiling_oracle']:.3f}" if entry.get("ceiling_oracle") is not None
                 else "")
        low, high = entry.get("ci95", (float("nan"), float("nan")))
        slots = entry.get("slots", entry["budget"])
        policy = entry["policy"] + (f" ({slots} slots)" if slots != entry["budget"] else "")
        lines.append(f"L={entry['length']:5d}{size} M={entry['budget']:6d}{cap} {policy:28s} acc "
                     f"{entry['accuracy']:.3f} [{low:.2f}-{high:.2f}] (ceiling {entry['ceiling']:.3f}{full})  "
                     f"by age acc/ceiling: {ages}")
    return "\n".join(lines)


def format_frontier(frontier: dict) -> str:
    """One line per policy: the ratio to the ceiling at each cap and the largest cap where it breaks."""
    from edgekv.eval.needle import share_label

    lines = []
    for label, item in frontier.items():
        threshold = item["threshold"]

        def number(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"

        ratios = "  ".join(f"{share_label(c['cap'])} {number(c['ratio'])}/{number(c['old_ratio'])}"
                           for c in item["caps"])

        def verdict(key: str) -> str:
            cap = item[key]
            if cap is not None:
                paired = next(c.get("vs_full") for c in item["caps"] if c["cap"] == cap) \
                    if key == "breaks_at" else None
                tested = ""
                if paired:
                    p = paired["p_mcnemar"]
                    tested = (f" (McNemar p {'< 0.001' if p < 0.001 else f'{p:.3f}'} against the full cache on the "
                              f"same questions: {paired['only_full']} right only with it, {paired['only_cap']} only "
                              f"with the cap)")
                return f"breaks at {share_label(cap)}{tested}"
            return f"holds to {share_label(item['caps'][-1]['cap'])}"

        def asked(family: str, cap: float) -> int:
            return next(c["by_family"][family]["n"] for c in item["caps"] if c["cap"] == cap)

        broken = [(f, cap) for f, cap in item.get("family_breaks_at", {}).items() if cap is not None]
        families = ("; by question family: " + ", ".join(
            f"{f} breaks at {share_label(cap)} (n={asked(f, cap)})" for f, cap in broken)) if broken else ""
        low = item.get("full_vs_short")
        caution = (f"; CAUTION: the full cache on the long stream reads {low:.2f} of the short streams here, a "
                   f"ceiling under the toy's own (its long memory does not hold at this length); against the short "
                   f"streams all questions {verdict('short_breaks_at')}"
                   if low is not None and low < threshold else "")
        if item.get("full_past_trained"):
            caution += (f"; CAUTION: the full cache's video spans {item['full_span_positions']:,} temporal positions, "
                        f"past the model's max_position_embeddings ({item['trained_positions']:,}): its attention "
                        f"reaches distances the model was not trained on (a capped cache is re-based to span at "
                        f"most its slots x the pair spacing)")
        lines.append(f"frontier {label}: all questions {verdict('breaks_at')}, events >= 256 pairs old "
                     f"{verdict('old_breaks_at')} (breaking: under {threshold:.0%} of the ceiling; accuracy / "
                     f"ceiling, all / old, per cap: {ratios}){families}{caution}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    return args.run(args)
