"""``edgekv train-toy OUT_DIR [--steps N --seed S]``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edgekv.helpformat import HelpFormatter
from edgekv.threads import threads_argument


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where the checkpoint is written")
    parser.add_argument("--steps", type=int, default=4000, help="question-answering optimizer steps")
    parser.add_argument("--vision-steps", type=int, default=2000,
                        help="vision warm-up steps first (shape and colour per token, 32 frame pairs a step)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8, help="streams per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    parser.add_argument("--width", type=int, default=64, help="LM hidden size (4 query heads of width/4, 2 KV heads)")
    parser.add_argument("--layers", type=int, default=4, help="LM decoder layers")
    parser.add_argument("--vision-width", type=int, default=64,
                        help="vision tower hidden size of a new model (4 heads, MLP 2x; --init keeps its own)")
    parser.add_argument("--vision-depth", type=int, default=4,
                        help="vision tower blocks of a new model (full attention in every second one)")
    parser.add_argument("--init", metavar="DIR", default=None,
                        help="go on from this toy checkpoint (its width and layers) instead of random weights")
    parser.add_argument("--grow-layers", type=int, default=0, metavar="N",
                        help="with --init: deepen its LM by N layers first (copies of the layer below with "
                             "zeroed residual branches: the same answers at step 0)")
    parser.add_argument("--grow-vision", type=int, default=0, metavar="N",
                        help="with --init: append N blocks to its vision tower first (the same way)")
    parser.add_argument("--grow-width", type=int, default=0, metavar="W",
                        help="with --init: widen its LM to hidden size W first, a multiple of its own (new "
                             "dimensions, heads' dimensions and MLP units that start at zero: the same answers at "
                             "step 0, up to rounding)")
    parser.add_argument("--reshape-heads", default=None, metavar="H:KV",
                        help="with --init: cut its LM attention into H query heads on KV key/value heads (head_dim "
                             "width / H) and make it new (o_proj zero: the rest of the toy as it was), e.g. 2:2 — "
                             "wider heads have more slowly turning rotary pairs to match content across a stream "
                             "(issue 27); with --distill-logits the teacher is --init as it was")
    parser.add_argument("--hard-negatives", type=float, default=0.0, metavar="F",
                        help="average the auxiliary 'no' term over only this share (0-1] of the background tokens, "
                             "those read least as background (look-alikes); 0: all of them")
    parser.add_argument("--attend-weight", type=float, default=0.0, metavar="W",
                        help="add W x -log(the share of LM layer 1's attention that each answer's query gives to the "
                             "tokens of the events it asks about; issue 27: lures take it); 0: off")
    parser.add_argument("--avoid-weight", type=float, default=0.0, metavar="W",
                        help="add W x -log(1 - the share of each attention head's mass that each question's answer "
                             "query gives to the lures' tokens), in the LM layers --avoid-layers, on lured world "
                             "samples (issue 27); 0: off")
    parser.add_argument("--avoid-layers", default=None, metavar="LIST",
                        help="comma-separated LM layers --avoid-weight steers (default 1,2,3)")
    parser.add_argument("--avoid-among", choices=("all", "video", "needles"), default=None,  # train.AVOID_AMONG
                        help="what --avoid-weight takes the lures' share of: all of each head's attention (default), "
                             "only its attention on video tokens (then looking at the prompt instead does not "
                             "lower it), or its attention on the lures and the tokens of the events asked about "
                             "(-log(1 + lures / needles): only reading the needles above the lures lowers it)")
    parser.add_argument("--distill-weight", type=float, default=0.0, metavar="W",
                        help="with --init: add W x KL(teacher || student) between the attentions of each answer's "
                             "query in the LM layers --distill-layers, the teacher a frozen copy of --init whose "
                             "questions do not see the lures' tokens there (issue 27); 0: off")
    parser.add_argument("--distill-logits", type=float, default=0.0, metavar="W",
                        help="with --init: add W x KL(teacher || student) between the answers' next-token "
                             "distributions, the same teacher; 0: off")
    parser.add_argument("--distill-teacher", default=None, metavar="DIR",
                        help="the teacher of --distill-weight / --distill-logits: this toy checkpoint instead of "
                             "--init (the same LM depth and heads)")
    parser.add_argument("--distill-layers", default=None, metavar="LIST",
                        help="comma-separated LM layers the teacher hides the lures in (default 1,2,3)")
    parser.add_argument("--rope-theta", type=float, default=None, metavar="T",
                        help="the LM's M-RoPE base (default: --init's, else the 3B's 1e6); with --init another base "
                             "re-bases its rotary frequencies first. A larger base leaves more of a head's rotary "
                             "pairs turning slowly enough to match content across a long stream")
    parser.add_argument("--max-positions", type=int, default=None, metavar="N",
                        help="draw the samples' temporal positions over 0..N and write N as the checkpoint's "
                             "max_position_embeddings (default: --init's, else 8192); a full cache on a stream "
                             "spanning more (pairs x 2 at 2 fps) reaches distances the toy never trained on")
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="also write the model every N steps beside OUT_DIR, as OUT_DIR-stepN, each with the "
                             "round's card cut at that step (to evaluate a round's path); 0: only the last")
    parser.add_argument("--vision-lr", type=float, default=2e-3, metavar="LR",
                        help="the vision warm-up's peak learning rate (lower to go on from an --init tower)")
    parser.add_argument("--vision-lures", type=float, default=0.0, metavar="F",
                        help="share (0-1) of the warm-up's world pairs that also show up to three look-alikes "
                             "(out-of-vocabulary shapes in the vocabulary's colours) labelled none")
    parser.add_argument("--curriculum", choices=("full", "refine", "world", "world-long", "world-224", "world-scratch",
                                                 "world-where", "world-where-long", "world-mild",
                                                 "world-mild-hard", "world-mild-count",
                                                 "world-mild-apart", "world-mild-where", "world-mild-224",
                                                 "world-lures", "world-lures-dense", "world-lures-dilute",
                                                 "world-mild-tone",
                                                 "world-mild-224-long", "world-mild-224-dilute",
                                                 "world-mild-224-distinct", "world-mild-224-dilute-distinct",
                                                 "world-mild-224-dilute-far", "world-mild-exposed",
                                                 "world-mild-224-exposed", "world-mild-exposed-dilute",
                                                 "world-lures-exposed-dilute", "world-lures-where-dilute",
                                                 "world-lures-free-dilute",
                                                 "world-lures-exposed-dilute-x256", "world-lures-exposed-dilute-x1024",
                                                 "world-lures-224"),
                        default="full",
                        help="training stages: full (from one event up; from scratch), refine (several events of "
                             "3-4 distinct shapes, long sparse thinned streams; for further rounds with --init), "
                             "world (85 %% of streams in the randomized world, every question family), world-long "
                             "(world with contexts of 64-256 kept pairs, most of them distractor pairs), world-224 "
                             "(world with 4-40 kept pairs, for --size 224), world-scratch (from one event to long "
                             "contexts, all in the world: for a new model), world-where (world asking where three "
                             "times as often: for a tower warmed up to tell where its tokens are), world-where-long "
                             "(world-long asking where as often), world-mild (world-where-long with half of "
                             "the world streams mild: the classic renderer's events and camera on world "
                             "backgrounds), world-mild-hard (world-mild asking order and count twice as often), "
                             "world-mild-count (world-mild-hard asking count three times, half the events two pairs "
                             "long), world-mild-apart (world-mild-count where a shape never comes back in the pair "
                             "right after it left, as in the card's streams), world-mild-where (world-mild-apart "
                             "asking where 6 times in 17 draws instead of 3 in 14), world-mild-224 (world-mild-where "
                             "with a quarter of the kept pairs, for --size 224 going on from a 112 x 112 toy), "
                             "world-lures (world-mild-where with half of the world streams busy with lures: "
                             "out-of-vocabulary shapes in the vocabulary's colours passing through), world-lures-dense "
                             "(world-lures with three quarters of the world streams lured and 24 background "
                             "renderings a sample: for a round after world-lures), world-lures-dilute (world-lures-dense "
                             "with three quarters of the samples diluted and every background pair rendered anew), "
                             "world-mild-tone "
                             "(world-mild-apart with half of the world streams on a re-graded background: gamma, "
                             "contrast, saturation and hue drawn per stream), world-mild-224-long (world-mild-224 "
                             "with its long stage's contexts 1.5 times as long, one stream a batch), "
                             "world-mild-224-dilute (world-mild-224 with three quarters of the samples diluted: each "
                             "background pair weighs as 1-64 of them in attention, as in a stream that much longer), "
                             "world-mild-224-distinct (world-mild-224 with every background pair of a world sample "
                             "rendered anew), world-mild-224-dilute-distinct (both), world-mild-224-dilute-far "
                             "(world-mild-224-dilute-distinct diluted up to 256 times instead of 64), "
                             "world-mild-exposed (world-mild-apart with half of the world streams on an over-exposed "
                             "background: gain up to 1.5-3 over part of the frame, clipped to white), "
                             "world-mild-224-exposed (world-mild-224-dilute-distinct with the same), "
                             "world-mild-exposed-dilute (world-mild-exposed with three quarters of the samples "
                             "diluted and every background pair rendered anew), world-lures-exposed-dilute "
                             "(world-mild-exposed-dilute with half of the world streams busy with lures), "
                             "world-lures-where-dilute (world-lures-exposed-dilute with `where` asked six times), "
                             "world-lures-free-dilute (world-lures-where-dilute with three quarters of the world "
                             "streams lured, half of those in colours no event of theirs wears), "
                             "world-lures-exposed-dilute-x256 / -x1024 (world-lures-exposed-dilute diluted up to 256 / "
                             "1,024 times instead of 64: for streams of ~10,000 pairs), world-lures-224 "
                             "(world-mild-224-exposed with half of the world streams busy with lures)")
    parser.add_argument("--families", default=None,
                        help="background families of the world curricula, comma-separated names or groups "
                             "(procedural, photos, videos, all; default all available)")
    parser.add_argument("--holdout", default=None,
                        help="background families never drawn in training (default cells,skimage,tree; 'none')")
    parser.add_argument("--size", type=int, default=112, choices=(112, 224),
                        help="frame side in px: 112 (16 tokens per frame pair) or 224 (64)")
    parser.add_argument("--train-vision", action="store_true",
                        help="keep training the vision tower with the answers after the warm-up (default: frozen)")
    parser.add_argument("--freeze-vision", action="store_true",
                        help="with --vision-steps 0: keep the tower as --init has it (default: trained with the "
                             "answers)")
    parser.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                        help="draw batches in the training process instead of one step ahead in a worker process "
                             "(prefetch without it: %(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="where the model trains: cpu, cuda or cuda:N (batches are drawn on the host)")
    parser.add_argument("--fp32-products", action="store_true",
                        help="on a GPU, keep the matrix products in fp32 (default: TF32 on the tensor cores)")
    parser.add_argument("--workers", type=int, default=0,
                        help="draw the batches in N processes, each step from its own seeded generators (a "
                             "different draw than the default single stream, the same for any N; what a GPU needs)")
    parser.add_argument("--recompute", action="store_true",
                        help="run each layer again in the backward pass instead of keeping its activations: the "
                             "same gradients in the memory of one layer's attention (long contexts on a CPU)")
    parser.add_argument("--threads", type=threads_argument, default=None, help="torch CPU threads")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--eval-samples", type=int, default=64,
                        help="training-distribution samples scored (teacher-forced) at every log line")
    parser.add_argument("--heldout-streams", type=int, default=200,
                        help="held-out streams for the model card's accuracy (edgekv eval toy); 0 = skip")
    parser.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from edgekv.toy.train import AVOID_LAYERS, train

    if args.steps < 1 or args.batch_size < 1 or args.vision_steps < 0 or args.layers < 1:
        print("edgekv train-toy: --steps, --batch-size and --layers must be at least 1, --vision-steps at least 0")
        return 2
    if args.width < 32 or args.width % 16:
        print(f"edgekv train-toy: --width must be a multiple of 16 and at least 32, got {args.width}")
        return 2
    if args.vision_width < 32 or args.vision_width % 16 or args.vision_depth < 1:
        print("edgekv train-toy: --vision-width must be a multiple of 16 and at least 32, --vision-depth at least 1; "
              f"got {args.vision_width} / {args.vision_depth}")
        return 2
    if min(args.grow_layers, args.grow_vision) < 0 or ((args.grow_layers or args.grow_vision) and args.init is None):
        print(f"edgekv train-toy: --grow-layers / --grow-vision deepen an --init checkpoint by N >= 0; got "
              f"{args.grow_layers} / {args.grow_vision}{' without --init' if args.init is None else ''}")
        return 2
    if args.grow_width < 0 or (args.grow_width and args.init is None):
        print(f"edgekv train-toy: --grow-width widens an --init checkpoint to a multiple of its width; got "
              f"{args.grow_width}{' without --init' if args.init is None else ''}")
        return 2
    if args.workers < 0:
        print(f"edgekv train-toy: --workers must be at least 0, got {args.workers}")
        return 2
    if args.train_vision and not args.vision_steps:
        # once silently nothing: rounds of issue 27 passed it with --vision-steps 0, where the tower trains anyway
        print("edgekv train-toy: --train-vision keeps training the tower after a warm-up (--vision-steps > 0); with "
              "--vision-steps 0 the tower trains with the answers already (--freeze-vision keeps --init's)")
        return 2
    if args.attend_weight < 0 or (args.attend_weight and (args.recompute or (args.init is None and args.layers < 2))):
        print(f"edgekv train-toy: --attend-weight must be >= 0 and needs a model of 2 or more LM layers, without "
              f"--recompute; got {args.attend_weight}")
        return 2
    chosen = {}
    for flag, text in (("--avoid-layers", args.avoid_layers), ("--distill-layers", args.distill_layers)):
        try:
            chosen[flag] = AVOID_LAYERS if text is None else tuple(int(layer) for layer in text.split(","))
        except ValueError:
            print(f"edgekv train-toy: {flag} takes comma-separated LM layer indices, got {text!r}")
            return 2
    avoid_layers, distill_layers = chosen["--avoid-layers"], chosen["--distill-layers"]
    if args.avoid_weight < 0 or (args.avoid_weight and (args.recompute or min(avoid_layers) < 0)) or \
            ((args.avoid_layers is not None or args.avoid_among is not None) and not args.avoid_weight):
        print(f"edgekv train-toy: --avoid-weight must be >= 0, without --recompute, over LM layers >= 0, and "
              f"--avoid-layers and --avoid-among only with it; got {args.avoid_weight} over "
              f"{args.avoid_layers or 'the default'}")
        return 2
    distill = args.distill_weight > 0 or args.distill_logits > 0
    if min(args.distill_weight, args.distill_logits) < 0 or (distill and (
            args.recompute or args.init is None or min(distill_layers) < 0)) or \
            ((args.distill_layers is not None or args.distill_teacher is not None) and not distill):
        print(f"edgekv train-toy: --distill-weight and --distill-logits must be >= 0, need --init and no "
              f"--recompute, over LM layers >= 0, and --distill-layers and --distill-teacher only with one of them; "
              f"got {args.distill_weight} / {args.distill_logits} over "
              f"{args.distill_layers or 'the default'}")
        return 2
    if not 0.0 <= args.hard_negatives <= 1.0:
        print(f"edgekv train-toy: --hard-negatives is a share of the background tokens in [0, 1], got "
              f"{args.hard_negatives}")
        return 2
    if not 0.0 <= args.vision_lures <= 1.0 or not args.vision_lr > 0:
        print(f"edgekv train-toy: --vision-lures is a share of the warm-up's world pairs in [0, 1] and --vision-lr "
              f"must be > 0; got {args.vision_lures} / {args.vision_lr}")
        return 2
    if args.max_positions is not None and args.max_positions < 1024:
        print(f"edgekv train-toy: --max-positions must be at least 1024 (a long sample's span), got "
              f"{args.max_positions}")
        return 2
    if args.rope_theta is not None and not args.rope_theta > 0:
        print(f"edgekv train-toy: --rope-theta must be positive, got {args.rope_theta}")
        return 2
    if args.save_every < 0:
        print(f"edgekv train-toy: --save-every must be at least 0 (0: only the last step), got {args.save_every}")
        return 2
    reshape = None
    if args.reshape_heads is not None:
        try:
            heads, _, kv = args.reshape_heads.partition(":")
            reshape = (int(heads), int(kv or heads))
        except ValueError:
            reshape = None
        if reshape is None or min(reshape) < 1 or args.init is None or args.distill_weight:
            print(f"edgekv train-toy: --reshape-heads H:KV (two positive integers) cuts an --init checkpoint's "
                  f"attention into new heads, without --distill-weight; got {args.reshape_heads!r}"
                  f"{' without --init' if args.init is None else ''}")
            return 2
    if args.device.split(":")[0] not in ("cpu", "cuda"):
        print(f"edgekv train-toy: --device must be cpu, cuda or cuda:N, got {args.device!r}")
        return 2
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"edgekv train-toy: --device {args.device}: torch finds no CUDA GPU here")
            return 2
    if args.distill_teacher is not None and not Path(args.distill_teacher, "config.json").is_file():
        print(f"edgekv train-toy: --distill-teacher {args.distill_teacher}: no config.json there (give a toy "
              f"checkpoint directory)")
        return 2
    if args.init is not None and not Path(args.init, "config.json").is_file():
        print(f"edgekv train-toy: --init {args.init}: no config.json there (give a toy checkpoint directory)")
        return 2
    from edgekv.video.world import parse_families

    try:
        families = parse_families(args.families) or None
        holdout = None if args.holdout is None else parse_families("" if args.holdout == "none" else args.holdout)
    except ValueError as exc:
        print(f"edgekv train-toy: {exc}")
        return 2
    from edgekv.toy.model import WidthError
    from edgekv.toy.train import term_as_interrupt, tf32_products

    try:
        with term_as_interrupt(), tf32_products(args.device, not args.fp32_products):  # kept on Ctrl-C, `timeout`
            card = train(args.out_dir, steps=args.steps, seed=args.seed, batch_size=args.batch_size, lr=args.lr,
                         threads=args.threads, log=lambda line: print(line, flush=True), log_every=args.log_every,
                         heldout_streams=args.heldout_streams, eval_samples=args.eval_samples,
                         vision_steps=args.vision_steps,
                         width=args.width, layers=args.layers, prefetch=args.prefetch, init=args.init,
                         curriculum=args.curriculum, families=families, holdout=holdout, size=args.size,
                         freeze_vision=not args.train_vision, vision_width=args.vision_width,
                         vision_depth=args.vision_depth, device=args.device, workers=args.workers,
                         freeze_init_vision=args.freeze_vision, grow=args.grow_layers,
                         grow_vision=args.grow_vision, recompute=args.recompute, grow_width=args.grow_width,
                         hard_negatives=args.hard_negatives, vision_lr=args.vision_lr,
                         vision_lures=args.vision_lures, max_positions=args.max_positions, rope_theta=args.rope_theta,
                         reshape=reshape,
                         save_every=args.save_every, attend_weight=args.attend_weight,
                         avoid_weight=args.avoid_weight, avoid_layers=avoid_layers,
                         avoid_among=args.avoid_among or "all", distill_weight=args.distill_weight,
                         distill_logits=args.distill_logits, distill_layers=distill_layers,
                         distill_teacher=args.distill_teacher)
    except WidthError as exc:  # a width the --init checkpoint cannot be widened to (known only once it is loaded)
        print(f"edgekv train-toy: {exc}")
        return 2
    except ValueError as exc:  # layers the --init checkpoint lacks (known only once it is loaded)
        if not str(exc).startswith(("avoid_layers", "attend_weight", "distill_layers", "distill_teacher")):
            raise
        print(f"edgekv train-toy: {exc}")
        return 2
    print(json.dumps({"wrote": args.out_dir, "wall_time_s": card["wall_time_s"],
                      "heldout": card["history"][-1]["heldout"] if card["history"] else {}}))
    return 0
