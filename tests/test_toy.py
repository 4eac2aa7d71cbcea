"""The toy model's parts: scene generator, questions, word-level tokenizer, training layout and loop."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from edgekv.toy.data import CURRICULA, CURRICULUM, REFINE, TOKENS, Sample, draw_sample, stage_at
from edgekv.toy.model import MAX_POSITIONS, init_model, save_checkpoint, toy_config
from edgekv.toy.questions import (FAMILIES, QA, TEMPLATES, color_question, count_question, exists_question,
                                  order_question, sample_question, shape_question)
from edgekv.toy.train import Encoder, forward_logits, loss_of
from edgekv.toy.vocab import build_tokenizer
from edgekv.video.events import COLOR_BGR, COLORS, SHAPES, Event, EventScene, SceneStyle, random_events, EventPlan


# ---------------------------------------------------------------------------------------------- scenes
def test_scene_is_deterministic_and_draws_events_in_their_colour():
    event = Event("square", "red", first_pair=2, pairs=1, center=(56, 56), radius=12)
    scene = EventScene(seed=3, events=[event], style=SceneStyle(noise=2.0))
    again = EventScene(seed=3, events=[event], style=SceneStyle(noise=2.0))
    assert np.array_equal(scene.frame(5), again.frame(5))
    assert not np.array_equal(scene.frame(0), scene.frame(1))  # sensor noise differs frame to frame
    before, during, after = scene.frame(3), scene.frame(4), scene.frame(6)  # pair 1, pair 2, pair 3
    inside = scene.mask(event)
    assert inside.sum() > 400
    assert np.abs(during[inside].astype(int) - np.array(COLOR_BGR["red"])).max() <= 10  # noise only
    assert np.abs(before[inside].astype(int) - np.array(COLOR_BGR["red"])).mean() > 60
    assert np.abs(after[inside].astype(int) - np.array(COLOR_BGR["red"])).mean() > 60


@pytest.mark.parametrize("shape", SHAPES)
def test_each_shape_covers_the_cells_under_it(shape):
    event = Event(shape, "white", 0, 1, (42, 70), 14)
    cover = EventScene(events=[event]).cell_cover(event)  # 4 x 4 cells of 28 px
    assert cover.shape == (4, 4)
    assert cover[70 // 28, 42 // 28] > 0.3  # the centre's cell
    assert cover[0, 3] == 0.0


def test_random_events_respect_the_plan():
    plan = EventPlan(rate=0.3, duration=(1, 3), max_per_shape=2, gap=1)
    events = random_events(np.random.default_rng(0), 400, plan)
    assert len(events) == 2 * len(SHAPES)  # the rate is high enough to use every allowed appearance
    for shape in SHAPES:
        same = [e for e in events if e.shape == shape]
        assert len(same) == 2 and same[0].center != same[1].center
    for a, b in zip(events, events[1:]):
        assert b.first_pair >= a.last_pair + 2  # one event at a time, a gap between
    assert all(1 <= e.pairs <= 3 for e in events)


def test_events_source_spec(tmp_path):
    from edgekv.video.sources import iter_frames, open_source

    source = open_source("synthetic:events?size=112x112&fps=2&frames=60&seed=4&rate=0.2&duration=1-2")
    frames = list(iter_frames(source))
    assert len(frames) == 60 and frames[3][1] == 1.5
    assert source.scene.events, "rate 0.2 over 30 pairs places events"
    first = source.scene.events[0]
    lit = frames[2 * first.first_pair][0][source.scene.mask(first)].astype(int)
    assert np.abs(lit - np.array(COLOR_BGR[first.color])).mean() < 12
    with pytest.raises(ValueError, match="duration"):
        open_source("synthetic:events?duration=3-1")
    with pytest.raises(ValueError, match="unknown parameter 'colour'"):
        open_source("synthetic:events?colour=red")


# ---------------------------------------------------------------------------------------------- questions
def _ev(shape, color, pair):
    return Event(shape, color, pair, 1, (20 + 10 * pair % 60, 40), 9)


def test_answers_follow_the_ground_truth():
    events = [_ev("circle", "red", 1), _ev("square", "blue", 3), _ev("circle", "red", 6), _ev("cross", "red", 9)]
    assert color_question(events, "circle").answer == "red"
    assert color_question(events, "triangle") is None  # never seen: no colour to ask for
    assert shape_question(events, "blue").answer == "square"
    assert shape_question(events, "red") is None  # red was two shapes
    assert exists_question(events, "red", "cross").answer == "yes"
    assert exists_question(events, "blue", "cross").answer == "no"
    assert order_question(events, "square", "circle").answer == "circle"
    assert order_question(events, "cross", "square").answer == "square"
    assert count_question(events, "circle").answer == "two"
    assert count_question(events, "triangle").answer == "zero"
    mixed = events + [_ev("circle", "green", 12)]
    assert color_question(mixed, "circle") is None  # two colours: not asked


def test_sampled_questions_use_the_fixed_templates_and_half_are_negative():
    rng = np.random.default_rng(0)
    events = [_ev("circle", "red", 1), _ev("square", "blue", 3)]
    answers = []
    for _ in range(400):
        qa = sample_question(events, "exists", rng)
        assert qa.question in {TEMPLATES["exists"].format(color=c, shape=s) for c in COLORS for s in SHAPES}
        answers.append(qa.answer)
    assert 0.4 < answers.count("yes") / len(answers) < 0.6


# ---------------------------------------------------------------------------------------------- tokenizer
def test_word_tokenizer_covers_every_question_and_keeps_qwen_special_tokens():
    tokenizer, special = build_tokenizer()
    unk = tokenizer.token_to_id("<unk>")
    rng = np.random.default_rng(1)
    events = [_ev("circle", "red", 1), _ev("square", "blue", 3), _ev("circle", "red", 6)]
    for family in FAMILIES:
        qa = sample_question(events, family, rng)
        ids = tokenizer.encode(qa.question + " " + qa.answer, add_special_tokens=False).ids
        assert unk not in ids, qa
    for token in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"):
        assert tokenizer.encode(token, add_special_tokens=False).ids == [special[token]]
    assert tokenizer.decode(tokenizer.encode("Which shape was red?", add_special_tokens=False).ids) == \
        "which shape was red?"


def test_transformers_reads_the_toy_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = save_checkpoint(init_model(toy_config(), 0), tmp_path / "toy", {"note": "test"})
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ours, _ = build_tokenizer()
    text = "<|vision_end|>Was there a red cross?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer(text).input_ids == ours.encode(text, add_special_tokens=False).ids
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    assert model.config.video_token_id == toy_config().video_token_id


# ---------------------------------------------------------------------------------------------- training layout
def _dense_sample(scene: EventScene, pairs: int, qas: list[QA], spacing: int = 2, tokens: int = TOKENS) -> Sample:
    slots = pairs
    return Sample(pairs=[scene.pair_frames(k) for k in range(pairs)], slot_pair=list(range(pairs)),
                  tpos=[spacing * k for k in range(pairs)],
                  evict_at=np.full((slots, tokens), slots + 1, dtype=np.int64), sink=None,
                  events=list(scene.events), visible=list(scene.events),
                  carried=np.full((slots, tokens), -1, dtype=np.int64), cover=np.zeros((slots, tokens)), qas=qas)


@pytest.mark.parametrize("size", [112, 224])
def test_training_layout_equals_what_the_session_builds(tmp_path, size):
    """Logits of the training forward at the answer position == the live session's (full cache), at
    112 x 112 (16 tokens per pair) and 224 x 224 (64)."""
    from edgekv.runtime import Runtime

    torch.manual_seed(0)
    model = init_model(toy_config(), 0)
    with torch.no_grad():  # larger weights than the init so that a layout slip changes the logits visibly
        for param in model.parameters():
            if param.dim() >= 2:
                param.mul_(5.0)
    directory = save_checkpoint(model, tmp_path / "toy", {}, dtype=torch.float32)
    event = Event("triangle", "yellow", 2, 1, (60, 50), 15)
    scene = EventScene(size, size, seed=7, events=[event])
    qa = QA("color", "What color was the triangle?", "yellow")
    sample = _dense_sample(scene, 5, [qa, QA("count", "How many times did the triangle appear?", "one")],
                           tokens=(size // 28) ** 2)
    batch = Encoder(size=size).encode([sample])
    with torch.no_grad():
        trained_view = forward_logits(model.eval(), batch)  # [targets, V]: answer word, im_end, per question

    runtime = Runtime.from_pretrained(directory, model={"dtype": "fp32", "device": "cpu"},
                                      cache={"policy": "full", "max_tokens": 512, "text_reserve_tokens": 64},
                                      video={"fps": 2.0, "resolution": [size, size]})
    session = runtime.session()
    for index in range(10):
        session.ingest(scene.frame(index), t=scene.time(index))
    for number, question in enumerate((qa.question, "How many times did the triangle appear?")):
        live = session.question_logits(question)[-1]
        torch.testing.assert_close(trained_view[2 * number], live, atol=2e-4, rtol=1e-4)


def test_mask_hides_evicted_tokens_from_the_question_but_not_from_earlier_pairs():
    scene = EventScene(seed=1)
    sample = _dense_sample(scene, 3, [QA("count", "How many times did the circle appear?", "zero"),
                                      QA("count", "How many times did the cross appear?", "zero")])
    sample.evict_at[0, 5] = 2  # token 5 of pair 0: seen by pair 1, gone before pair 2 and the question
    encoder = Encoder()
    row = encoder._encode_one(sample)
    mask, s0 = row["mask"], row["video_start"]
    key = s0 + 5
    pair1, pair2 = s0 + TOKENS + 3, s0 + 2 * TOKENS + 3
    first_branch = s0 + 3 * TOKENS
    second_branch = first_branch + len(encoder.ids(encoder.layout.question_suffix(sample.qas[0].question))) + 2
    assert mask[pair1, key] and not mask[pair2, key] and not mask[first_branch, key]
    assert mask[first_branch, s0 + 6] and mask[first_branch, 0]  # kept video and the prefix
    assert not mask[second_branch, first_branch] and mask[second_branch, second_branch]  # branches are separate
    assert not mask[s0 + 3, s0 + 4] and mask[s0 + 4, s0 + 3]  # causal inside a pair
    sample.sink = np.zeros((3, TOKENS), dtype=bool)
    sample.sink[0, 7] = True
    mask = encoder._encode_one(sample)["mask"]
    assert mask[pair1, s0 + 7] and not mask[pair1, s0 + 6]  # StateKV prefill: only sinks of earlier pairs
    assert mask[first_branch, s0 + 6]  # ... while the question still sees everything kept


def test_curriculum_samples_are_well_formed():
    rng = np.random.default_rng(3)
    for _, stage in CURRICULUM + REFINE:
        for _ in range(4):
            sample = draw_sample(rng, stage, MAX_POSITIONS)
            assert sample.tpos == sorted(set(sample.tpos)) and sample.tpos[-1] < MAX_POSITIONS
            assert len(sample.slot_pair) == sample.slots and sample.qas
            for qa in sample.qas:  # answers follow what the question can still see
                assert qa.answer == sample_question_answer(sample, qa)


def test_refine_curriculum_skips_one_event_streams_and_asks_shape_of_many_shapes_more():
    """``--curriculum refine`` (further rounds): never the one-event stage, even as rehearsal; its streams
    draw events from 3-4 distinct shapes, and shape questions are drawn twice as often as any other family (some draws have no valid question
    and are drawn again, so the share asked is lower)."""
    from collections import Counter

    rng = np.random.default_rng(5)
    stages = {stage_at(progress, rng, "refine").name for progress in np.linspace(0, 0.999, 400)}
    assert stages == {stage.name for _, stage in REFINE} and "one event" not in stages
    assert {stage_at(p, rng).name for p in np.linspace(0, 0.999, 400)} == {s.name for _, s in CURRICULA["full"]}
    families, distinct = Counter(), []
    for _ in range(40):
        sample = draw_sample(rng, REFINE[-1][1], MAX_POSITIONS)
        families.update(qa.family for qa in sample.qas)
        distinct.append(len({event.shape for event in sample.events}))
    assert families["shape"] > 1.25 * max(families[f] for f in families if f != "shape")
    assert min(distinct) >= 1 and np.mean(distinct) > 2.2
    with pytest.raises(ValueError, match="curriculum 'easy' is not one of full, refine"):
        from edgekv.toy.train import train

        train("unused", curriculum="easy")


def sample_question_answer(sample: Sample, qa: QA) -> str:
    from edgekv.toy import questions

    visible = sample.visible
    words = qa.question.rstrip("?").replace(",", "").lower().split()
    if qa.family == "color":
        return questions.color_question(visible, words[-1]).answer
    if qa.family == "shape":
        return questions.shape_question(visible, words[-1]).answer
    if qa.family == "exists":
        return questions.exists_question(visible, words[-2], words[-1]).answer
    if qa.family == "order":
        return questions.order_question(visible, words[4], words[-1]).answer
    return questions.count_question(visible, words[-2]).answer


def test_batched_attention_equals_one_sequence_at_a_time():
    from edgekv.model.language import dense_causal_attend

    def batched_causal(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    model = init_model(toy_config(), 0).eval()
    language = model.language
    embeds = torch.randn(2, 9, 64)
    positions = torch.arange(9).expand(3, 9)
    cos, sin = language.rotary(positions)
    batched = embeds
    for index, layer in enumerate(language.layers):
        batched = layer(batched, cos, sin, index, batched_causal)
    for b in range(2):
        torch.testing.assert_close(language.norm(batched[b]), language(embeds[b], positions, dense_causal_attend))


def test_a_few_dozen_training_steps_lower_the_loss():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    stage = CURRICULUM[0][1]
    encoder = Encoder(aux=True)
    model = init_model(toy_config(), 0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    held = encoder.encode([draw_sample(np.random.default_rng(9), stage, MAX_POSITIONS) for _ in range(6)])
    with torch.no_grad():
        before = loss_of(forward_logits(model, held), held, 0.5, encoder.no)[0].item()
    for _ in range(30):
        batch = encoder.encode([draw_sample(rng, stage, MAX_POSITIONS) for _ in range(4)])
        loss = loss_of(forward_logits(model, batch), batch, 0.5, encoder.no)[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after = loss_of(forward_logits(model, held), held, 0.5, encoder.no)[0].item()
    assert after < 0.6 * before, (before, after)


def test_recompute_gives_the_same_loss_and_gradients_as_keeping_the_activations():
    torch.manual_seed(0)
    encoder = Encoder(aux=True)
    model = init_model(toy_config(), 0).train()
    batch = encoder.encode([draw_sample(np.random.default_rng(s), CURRICULUM[0][1], MAX_POSITIONS) for s in range(3)])
    grads = []
    for recompute in (False, True):
        model.zero_grad(set_to_none=True)
        loss = loss_of(forward_logits(model, batch, recompute), batch, 0.5, encoder.no)[0]
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (kept_loss, kept), (again_loss, again) = grads
    torch.testing.assert_close(again_loss, kept_loss)
    assert kept.keys() == again.keys() and any("layers.0" in n for n in kept)
    for name in kept:
        torch.testing.assert_close(again[name], kept[name], rtol=1e-4, atol=1e-6, msg=name)


def test_train_toy_recompute_and_held_out_samples_scored_in_chunks(tmp_path):
    from edgekv.apps.cli import main
    from edgekv.toy.train import HELD_CHUNK, evaluate, heldout

    start = save_checkpoint(init_model(toy_config(width=32, layers=2, vision_width=32, vision_depth=2), 3),
                            tmp_path / "start", {"note": "test"})
    out = tmp_path / "next"
    assert main(["train-toy", str(out), "--init", str(start), "--steps", "2", "--batch-size", "2", "--log-every", "2",
                 "--heldout-streams", "0", "--eval-samples", str(HELD_CHUNK + 1), "--vision-steps", "0",
                 "--threads", "1", "--curriculum", "refine", "--recompute"]) == 0
    card = __import__("json").loads((out / "card.json").read_text())
    assert card["recompute"] is True and card["command"].endswith("--recompute") and card["history"][-1]["heldout"]
    # scored in chunks, the counts are those of one batch of all the samples
    model = init_model(toy_config(width=32, layers=2, vision_width=32, vision_depth=2), 5)
    samples = heldout(1, 2 * HELD_CHUNK + 1, curriculum="refine")
    encoder = Encoder()
    chunks = [encoder.encode(samples[i:i + HELD_CHUNK]) for i in range(0, len(samples), HELD_CHUNK)]
    assert len(chunks) == 3 and evaluate(model, chunks) == evaluate(model, encoder.encode(samples))


def test_train_toy_interrupted_keeps_the_steps_it_took(tmp_path, monkeypatch, capsys):
    """Ctrl-C in a training round lost every step (an hour on the CPU); now the steps taken are written as
    OUT-stepN with its card (marked interrupted, the history so far), OUT itself is not, and the command exits
    130 as an interrupt does. Before the first step there is nothing to keep."""
    import json

    import edgekv.toy.train as train_module
    from edgekv.apps.cli import main
    from edgekv.model.loading import load_pretrained

    start = save_checkpoint(init_model(toy_config(width=32, layers=2, vision_width=32, vision_depth=2), 3),
                            tmp_path / "start", {"command": "edgekv train-toy START"})
    real, calls = train_module.loss_of, []

    def key_in_step_three(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "loss_of", key_in_step_three)
    out = tmp_path / "next"
    argv = ["train-toy", str(out), "--init", str(start), "--steps", "4", "--batch-size", "2", "--log-every", "1",
            "--heldout-streams", "0", "--eval-samples", "2", "--vision-steps", "0", "--threads", "1",
            "--curriculum", "refine", "--lr", "0.01", "--no-prefetch"]
    try:
        code = main(argv)
    except KeyboardInterrupt:  # (not let through: it would end the test run itself)
        pytest.fail("the interrupt was not handled by the command")
    assert code == 130 and len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["next-step2", "start"]
    card = json.loads((tmp_path / "next-step2" / "card.json").read_text())
    assert card["interrupted"] is True and card["steps"] == card["snapshot_step"] == 2
    assert [r["step"] for r in card["history"]] == [1, 2] and card["command"].endswith("its step 2 of 4, interrupted")
    moved = load_pretrained(tmp_path / "next-step2", dtype=torch.float32).state_dict()
    first = load_pretrained(start, dtype=torch.float32).state_dict()
    assert any(not torch.equal(first[n], moved[n]) for n in first)
    assert '"interrupted": true' in capsys.readouterr().out
    calls.clear()
    monkeypatch.setattr(train_module, "loss_of", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main([*argv[:1], str(tmp_path / "none"), *argv[2:]]) == 130
    assert not any(p.name.startswith("none") for p in tmp_path.iterdir())


def test_ctrl_c_inside_an_optimizer_step_waits_for_the_step(tmp_path, monkeypatch, capsys):
    """A Ctrl-C that arrives inside ``optimizer.step`` is held until the step (and its schedule) is applied whole,
    then interrupts: the snapshot counts that step, and holds no half-moved parameters."""
    import json
    import signal
    import threading

    from edgekv.apps.cli import main

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT handlers can be set only in the main thread, and this test runs in another")
    start = save_checkpoint(init_model(toy_config(width=32, layers=2, vision_width=32, vision_depth=2), 3),
                            tmp_path / "start", {"command": "edgekv train-toy START"})
    real, calls, finished = torch.optim.AdamW.step, [], []

    def key_inside_step_two(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)  # to this thread: Python runs its handler before the next line
        result = real(self, *args, **kwargs)
        finished.append(len(calls))
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", key_inside_step_two)
    # Python's own Ctrl-C handler, whatever an earlier test in the same worker installed
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    out = tmp_path / "next"
    try:
        code = main(["train-toy", str(out), "--init", str(start), "--steps", "4", "--batch-size", "2", "--log-every",
                     "1", "--heldout-streams", "0", "--eval-samples", "2", "--vision-steps", "0", "--threads", "1",
                     "--curriculum", "refine", "--lr", "0.01", "--no-prefetch"])
    except KeyboardInterrupt:  # (not let through: it would end the test run itself)
        pytest.fail("the interrupt was not handled by the command")
    finally:
        restored = signal.signal(signal.SIGINT, before)
    assert code == 130 and calls == [1, 1] and finished == [1, 2]
    card = json.loads((tmp_path / "next-step2" / "card.json").read_text())
    assert card["interrupted"] is True and card["steps"] == 2
    assert restored is signal.default_int_handler  # the handler the step held the key from was put back
    assert '"interrupted": true' in capsys.readouterr().out


def test_a_sigterm_ends_a_round_as_ctrl_c_does(tmp_path, monkeypatch, capsys):
    """SIGTERM — `timeout`'s default, `kill`'s, systemd's — ended a round with nothing written; now it interrupts as
    Ctrl-C does: inside an optimizer step it waits for the step, then the steps taken are kept as OUT-stepN and the
    command exits 130. The handler before is put back (here a guard that records what reaches it: nothing)."""
    import json
    import signal
    import threading

    from edgekv.apps.cli import main

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can be set only in the main thread, and this test runs in another")
    start = save_checkpoint(init_model(toy_config(width=32, layers=2, vision_width=32, vision_depth=2), 3),
                            tmp_path / "start", {"command": "edgekv train-toy START"})
    real, calls, finished, reached = torch.optim.AdamW.step, [], [], []

    def term_inside_step_two(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGTERM)
        result = real(self, *args, **kwargs)
        finished.append(len(calls))
        return result

    def guard(number, frame):
        reached.append(number)

    monkeypatch.setattr(torch.optim.AdamW, "step", term_inside_step_two)
    before = signal.signal(signal.SIGTERM, guard)  # (the default would end the test run itself)
    try:
        code = main(["train-toy", str(tmp_path / "next"), "--init", str(start), "--steps", "4", "--batch-size", "2",
                     "--log-every", "1", "--heldout-streams", "0", "--eval-samples", "2", "--vision-steps", "0",
                     "--threads", "1", "--curriculum", "refine", "--lr", "0.01", "--no-prefetch"])
    finally:
        restored = signal.signal(signal.SIGTERM, before)
    assert code == 130 and calls == [1, 1] and finished == [1, 2] and reached == []
    card = json.loads((tmp_path / "next-step2" / "card.json").read_text())
    assert card["interrupted"] is True and card["steps"] == 2
    assert not (tmp_path / "next").exists()
    assert restored is guard
    assert '"interrupted": true' in capsys.readouterr().out


def test_train_toy_save_every_writes_the_rounds_path_with_cut_cards(tmp_path, capsys):
    """``--save-every N`` writes the model at steps N, 2N, ... (not the last) as OUT-stepN: a loadable toy between
    the start and the end, whose card is the round's cut at that step; a negative N is refused."""
    import json

    from edgekv.apps.cli import main
    from edgekv.model.loading import load_pretrained

    start = save_checkpoint(init_model(toy_config(width=32, layers=2, vision_width=32, vision_depth=2), 3),
                            tmp_path / "start", {"command": "edgekv train-toy START"})
    out = tmp_path / "next"
    assert main(["train-toy", str(out), "--init", str(start), "--steps", "4", "--batch-size", "2", "--log-every", "1",
                 "--heldout-streams", "0", "--eval-samples", "2", "--vision-steps", "0", "--threads", "1",
                 "--curriculum", "refine", "--lr", "0.01", "--save-every", "2", "--no-prefetch"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["next", "next-step2", "start"]
    weights = [load_pretrained(d, dtype=torch.float32).state_dict() for d in (start, tmp_path / "next-step2", out)]
    for earlier, later in zip(weights, weights[1:]):
        assert any(not torch.equal(earlier[n], later[n]) for n in earlier)  # two steps apart: moved
    card, final = (json.loads((d / "card.json").read_text()) for d in (tmp_path / "next-step2", out))
    assert card["steps"] == card["snapshot_step"] == 2 and final["steps"] == 4 and "snapshot_step" not in final
    assert card["command"] == final["command"] + "  # its step 2 of 4"
    assert [r["step"] for r in card["history"]] == [1, 2] and len(final["history"]) == 4
    assert card["parent"]["command"] == "edgekv train-toy START"
    assert "its step 2 of 4" in (tmp_path / "next-step2" / "README.md").read_text()
    capsys.readouterr()
    assert main(["train-toy", str(tmp_path / "bad"), "--steps", "2", "--save-every", "-1"]) == 2
    assert "--save-every must be at least 0" in capsys.readouterr().out


def test_average_toy_writes_the_mean_of_checkpoints_with_their_lineage(tmp_path, capsys):
    """``edgekv average-toy OUT A B``: the weights are the (weighted) mean of A's and B's, written as a toy
    checkpoint in fp16 with a card naming both and their rounds and the held-out accuracy; weights 1,0 give A back
    bit for bit; toys trained over different temporal ranges average to the widest; toys of another shape, a missing
    directory, bad weights are refused with the reason."""
    import json

    from edgekv.apps.cli import main
    from edgekv.model.loading import load_pretrained

    small = dict(width=32, layers=2, vision_width=32, vision_depth=2)
    a = save_checkpoint(init_model(toy_config(**small), 3), tmp_path / "a", {"command": "edgekv train-toy A"})
    b = save_checkpoint(init_model(toy_config(**small), 4), tmp_path / "b",
                        {"command": "edgekv train-toy B --init A", "parent": {"command": "edgekv train-toy A",
                                                                              "steps": 5, "wall_time_s": 60.0}})
    assert main(["average-toy", str(tmp_path / "ab"), str(a), str(b), "--heldout-streams", "2"]) == 0
    wa, wb, mean = (load_pretrained(d, dtype=torch.float32).state_dict() for d in (a, b, tmp_path / "ab"))
    assert wa.keys() == mean.keys()
    for name in mean:
        torch.testing.assert_close(mean[name], ((wa[name] + wb[name]) / 2).half().float(), rtol=0, atol=0, msg=name)
    assert any(not torch.equal(mean[n], wa[n]) for n in mean)
    card = json.loads((tmp_path / "ab" / "card.json").read_text())
    assert [p["command"] for p in card["averaged"]] == ["edgekv train-toy A", "edgekv train-toy B --init A"]
    assert card["weights"] == [0.5, 0.5] and card["heldout_accuracy"]["streams"] == 2
    assert (card["width"], card["layers"], card["resolution"]) == (32, 2, [112, 112])
    readme = (tmp_path / "ab" / "README.md").read_text()
    assert "mean of 2 toy checkpoints" in readme and "    - from `edgekv train-toy A`: 5 steps, 1.0 min" in readme
    from edgekv.toy.card import write_model_card
    from edgekv.toy.train import _lineage

    # a round that goes on from the mean keeps it in its lineage, the checkpoints averaged beneath it
    (tmp_path / "next").mkdir()
    write_model_card(tmp_path / "next", {"command": "edgekv train-toy NEXT", "wall_time_s": 30.0,
                                         "parent": _lineage(tmp_path / "ab")})
    lines = (tmp_path / "next" / "README.md").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  - from `edgekv average-toy"))
    assert lines[at + 1].startswith("    - weight 0.500: `edgekv train-toy A`")
    assert lines[at + 2].startswith("    - weight 0.500: `edgekv train-toy B --init A`")
    assert lines[at + 3].startswith("      - from `edgekv train-toy A`: 5 steps, 1.0 min")
    assert lines[at + 3].endswith("it and its rounds are listed above")  # A, averaged and B's parent: once
    assert any("total wall time 1.5 min" in line for line in lines)  # 30 s + A's 60 s, the mean's ~0
    assert main(["average-toy", str(tmp_path / "a_only"), str(a), str(b), "--weights", "1,0",
                 "--heldout-streams", "0"]) == 0
    same = load_pretrained(tmp_path / "a_only", dtype=torch.float32).state_dict()
    assert all(torch.equal(same[n], wa[n]) for n in wa)
    assert json.loads((tmp_path / "a_only" / "card.json").read_text())["command"].endswith("--weights 1,0")
    # toys trained over different temporal ranges are of one shape (positions carry no weights): the widest is kept
    far = save_checkpoint(init_model(toy_config(**small, max_positions=16384), 6), tmp_path / "far", {})
    assert main(["average-toy", str(tmp_path / "af"), str(a), str(far), "--heldout-streams", "0"]) == 0
    af = load_pretrained(tmp_path / "af", dtype=torch.float32)
    assert af.config.text.max_position_embeddings == 16384
    assert json.loads((tmp_path / "af" / "card.json").read_text())["averaged_positions"] == [8192, 16384]
    wf = load_pretrained(far, dtype=torch.float32).state_dict()
    for name, value in af.state_dict().items():
        torch.testing.assert_close(value, ((wa[name] + wf[name]) / 2).half().float(), rtol=0, atol=0, msg=name)
    wide = save_checkpoint(init_model(toy_config(width=48, layers=2, vision_width=32, vision_depth=2), 5),
                           tmp_path / "wide", {})
    capsys.readouterr()
    for argv, says in (([str(a), str(wide)], "config differs"), ([str(a)], "at least two"),
                       ([str(a), str(tmp_path / "missing")], "no config.json"),
                       ([str(a), str(b), "--weights", "1"], "one non-negative weight per checkpoint"),
                       ([str(a), str(b), "--weights", "1,x"], "comma-separated numbers")):
        assert main(["average-toy", str(tmp_path / "bad"), *argv, "--heldout-streams", "0"]) == 2, argv
        assert says in capsys.readouterr().out, argv


def test_rope_theta_rebases_a_toy_and_is_kept_through_growing_and_training(tmp_path, capsys):
    """``train-toy --rope-theta T`` (issue 27): the M-RoPE base is a config value without weights. A toy re-based
    with ``set_rope_theta`` answers exactly as a toy built with that base and the same weights (and not as before:
    the rotary frequencies moved), growing keeps the base and the temporal range, a checkpoint of another base is
    still a toy of this version, a round from it keeps its base, and a base <= 0 is refused."""
    import json

    from edgekv.apps.cli import main
    from edgekv.model.loading import load_pretrained
    from edgekv.toy.model import grow_layers, grow_width, set_rope_theta, with_rope_theta
    from edgekv.toy.train import _from_checkpoint

    small = dict(width=32, layers=2, vision_width=32, vision_depth=2)
    start = init_model(toy_config(**small), 3)
    with torch.no_grad():  # trained-looking weights, so that every rotary pair carries something
        for param in start.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    batch = Encoder().encode([draw_sample(np.random.default_rng(0), REFINE[0][1], MAX_POSITIONS) for _ in range(2)])
    with torch.no_grad():
        before = forward_logits(start, batch)
        rebased = set_rope_theta(start, 1e9)
        after = forward_logits(rebased, batch)
        built = init_model(toy_config(**small, rope_theta=1e9), 0)
        built.load_state_dict(rebased.state_dict())
        again = forward_logits(built, batch)
    assert rebased.config == toy_config(**small, rope_theta=1e9) == with_rope_theta(toy_config(**small), 1e9)
    torch.testing.assert_close(after, again, rtol=0, atol=0)
    assert (after - before).abs().max() > 1e-3
    far = toy_config(**small, max_positions=16384, rope_theta=1e9)
    assert grow_layers(init_model(far, 1), 1).config.text == toy_config(**{**small, "layers": 3},
                                                                         max_positions=16384, rope_theta=1e9).text
    assert grow_width(init_model(far, 1), 96).config.text == toy_config(**{**small, "width": 96},
                                                                         max_positions=16384, rope_theta=1e9).text
    with pytest.raises(ValueError, match="positive"):
        with_rope_theta(toy_config(**small), 0.0)

    path = save_checkpoint(init_model(toy_config(**small), 3), tmp_path / "start", {"note": "test"})
    common = ["--steps", "2", "--batch-size", "2", "--log-every", "2", "--heldout-streams", "0", "--eval-samples",
              "2", "--vision-steps", "0", "--threads", "1", "--curriculum", "refine", "--no-prefetch"]
    out = tmp_path / "rebased"
    assert main(["train-toy", str(out), "--init", str(path), "--rope-theta", "1e9", *common]) == 0
    card = json.loads((out / "card.json").read_text())
    assert card["rope_theta"] == 1e9 and card["command"].endswith("--rope-theta 1e+09")
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 1e9
    assert _from_checkpoint(out)[0].config.text.rope_theta == 1e9  # still a toy of this version
    assert load_pretrained(out, dtype=torch.float32).language.inv_freq[-1] == pytest.approx(1e9 ** (-6 / 8))  # head_dim 8
    on = tmp_path / "on"
    assert main(["train-toy", str(on), "--init", str(out), *common]) == 0  # a round from it keeps the base
    assert json.loads((on / "config.json").read_text())["rope_theta"] == 1e9
    capsys.readouterr()
    assert main(["train-toy", str(tmp_path / "x"), "--rope-theta", "-1"]) == 2
    assert "--rope-theta must be positive" in capsys.readouterr().out


def test_place_event_always_places_even_when_the_frame_is_crowded():
    from edgekv.video.events import place_event

    rng = np.random.default_rng(0)
    crowd = [Event("circle", "red", 0, 1, (x, y), 18) for x in (20, 56, 92) for y in (20, 56, 92)]
    for _ in range(200):  # no free place at all: the least-overlapping candidate is taken
        event = place_event(rng, "circle", "blue", 3, 1, 112, 112, avoid=crowd)
        assert event.center is not None and 8 <= event.radius <= 18


def test_train_toy_command_writes_a_loadable_checkpoint_with_a_model_card(tmp_path, capsys):
    import json

    from edgekv.apps.cli import main
    from edgekv.runtime import Runtime

    out = tmp_path / "toy"
    assert main(["train-toy", str(out), "--steps", "3", "--batch-size", "2", "--log-every", "3",
                 "--heldout-streams", "2", "--eval-samples", "4", "--vision-steps", "2", "--threads", "1",
                 "--hard-negatives", "0.05", "--vision-lr", "0.001", "--vision-lures", "0.5"]) == 0
    card = (out / "README.md").read_text()
    assert "edgekv train-toy" in card and "| `color` |" in card and "held-out" in card
    recorded = json.loads((out / "card.json").read_text())
    assert recorded["hard_negatives"] == 0.05 and "--hard-negatives 0.05" in recorded["command"]
    assert recorded["vision_lr"] == 0.001 and recorded["vision_lures"] == 0.5
    assert "--vision-lr 0.001 --vision-lures 0.5" in recorded["command"]
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "card.json"}
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in out.iterdir())  # readable by a service user
    session = Runtime.from_pretrained(out, model={"dtype": "fp32", "device": "cpu"},
                                      cache={"policy": "full", "max_tokens": 256, "text_reserve_tokens": 64},
                                      video={"resolution": [112, 112]}).session()
    frame = EventScene().frame(0)
    session.ingest(frame, t=0.0)
    session.ingest(frame, t=0.5)
    logits = session.question_logits("Which shape was red?")
    assert logits.shape[1] == 64 and torch.isfinite(logits).all()


def test_freeze_vision_keeps_the_init_tower_through_the_question_steps(tmp_path):
    """``--vision-steps 0 --freeze-vision``: the tower stays as ``--init`` has it (a tower trained apart), the
    LM trains; the card says so. Without the flag the tower trains with the answers, as before."""
    from edgekv.apps.cli import main
    from edgekv.model.loading import load_pretrained

    start = save_checkpoint(init_model(toy_config(width=32, layers=1, vision_width=32, vision_depth=1), 5),
                            tmp_path / "start", {"note": "test"})
    before = load_pretrained(start, dtype=torch.float32)
    runs = {}
    for name, flags in (("frozen", ["--freeze-vision"]), ("trained", [])):
        assert main(["train-toy", str(tmp_path / name), "--init", str(start), "--steps", "3", "--batch-size", "2",
                     "--heldout-streams", "0", "--eval-samples", "2", "--vision-steps", "0", "--threads", "1",
                     "--no-prefetch", "--lr", "0.01", *flags]) == 0
        runs[name] = load_pretrained(tmp_path / name, dtype=torch.float32)
        card = __import__("json").loads((tmp_path / name / "card.json").read_text())
        assert card["vision_frozen"] is (name == "frozen") and card["command"].endswith("--freeze-vision") is (name == "frozen")
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert same(runs["frozen"].visual, before.visual) and not same(runs["trained"].visual, before.visual)
    assert not same(runs["frozen"].language, before.language)


def test_train_toy_sizes_a_new_vision_tower(tmp_path, capsys):
    """``--vision-width/--vision-depth`` size a new model's tower (full attention in every second block); the
    card and its command say so; sizes the tower cannot have are refused before anything runs."""
    from edgekv.apps.cli import main
    from edgekv.model.loading import load_pretrained

    out = tmp_path / "wide"
    assert main(["train-toy", str(out), "--steps", "1", "--batch-size", "1", "--heldout-streams", "0", "--eval-samples",
                 "1", "--vision-steps", "1", "--threads", "1", "--no-prefetch", "--width", "32", "--layers", "1",
                 "--vision-width", "48", "--vision-depth", "3"]) == 0
    vision = load_pretrained(out, dtype=torch.float32).config.vision
    assert (vision.hidden_size, vision.depth, vision.intermediate_size) == (48, 3, 96)
    assert vision.fullatt_block_indexes == (1,) and vision.out_hidden_size == 32
    card = __import__("json").loads((out / "card.json").read_text())
    assert (card["vision_width"], card["vision_depth"]) == (48, 3)
    assert "--vision-width 48 --vision-depth 3" in card["command"]
    assert toy_config().vision.fullatt_block_indexes == (1, 3)  # the shipped tower's layout is unchanged
    capsys.readouterr()
    for flags in (["--vision-width", "40"], ["--vision-width", "16"], ["--vision-depth", "0"]):
        assert main(["train-toy", str(tmp_path / "no"), "--steps", "1", *flags]) == 2
        assert "--vision-width must be a multiple of 16" in capsys.readouterr().out
    assert not (tmp_path / "no").exists()


def test_train_toy_init_goes_on_from_a_checkpoint_and_refuses_one_of_another_shape(tmp_path, capsys):
    """``--init DIR``: the run starts from DIR's weights (its width and depth, not the flags'), the card says
    so, and a checkpoint whose config is not a toy's is refused with the reason."""
    from edgekv.apps.cli import main
    from edgekv.model.loading import load_pretrained
    from edgekv.toy.train import _from_checkpoint

    start = save_checkpoint(init_model(toy_config(width=32, layers=2, vision_width=32, vision_depth=2), 3),
                            tmp_path / "start", {"note": "test"})
    model, width, layers = _from_checkpoint(start)
    reference = load_pretrained(start, dtype=torch.float32)
    assert (width, layers) == (32, 2) and all(p.requires_grad for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    out = tmp_path / "next"
    assert main(["train-toy", str(out), "--init", str(start), "--steps", "2", "--batch-size", "2", "--log-every", "2",
                 "--heldout-streams", "0", "--eval-samples", "2", "--vision-steps", "0", "--threads", "1",
                 "--curriculum", "refine"]) == 0
    card = __import__("json").loads((out / "card.json").read_text())
    assert card["init"] == str(start) and (card["width"], card["layers"]) == (32, 2) and "--init" in card["command"]
    assert card["curriculum"] == "refine" and card["command"].endswith("--curriculum refine")
    assert card["history"][-1]["stage"] == "long, sparse, thinned, many shapes"
    assert "--width" not in card["command"]  # the width and depth come from --init, not flags
    assert (card["vision_width"], card["vision_depth"]) == (32, 2) and "--vision-width" not in card["command"]
    assert card["parent"] == {"note": "test"}  # the starting checkpoint's card travels with the new one
    assert "Trained in rounds" in (out / "README.md").read_text()
    trained = load_pretrained(out, dtype=torch.float32)
    assert trained.config == reference.config
    assert not torch.equal(trained.language.embed_tokens.weight, reference.language.embed_tokens.weight.half().float())
    other = tmp_path / "other"
    import dataclasses

    config = toy_config()
    config = dataclasses.replace(config, vision=dataclasses.replace(config.vision, intermediate_size=96))  # not the toy's tower
    save_checkpoint(init_model(config, 0), other, {})
    with pytest.raises(ValueError, match="not a toy checkpoint"):
        _from_checkpoint(other)
    capsys.readouterr()
    assert main(["train-toy", str(tmp_path / "x"), "--init", str(tmp_path / "missing")]) == 2
    assert "--init" in capsys.readouterr().out


def test_train_toy_max_positions_widens_the_trained_temporal_range_and_the_checkpoint_says_so(tmp_path, capsys):
    """``--max-positions N``: the samples' temporal positions are drawn over 0..N (a toy trained over 8,192 reads a
    full cache spanning 20,000 at 59 % of its short streams, issue 27), the checkpoint's max_position_embeddings is
    N (the session re-bases at half of it), the card's command says so, and a round from it keeps N; under 1,024
    is refused."""
    import json
    from dataclasses import replace

    from edgekv.apps.cli import main
    from edgekv.runtime import Runtime
    from edgekv.toy.train import _from_checkpoint

    start = save_checkpoint(init_model(toy_config(width=32, layers=2, vision_width=32, vision_depth=2), 3),
                            tmp_path / "start", {"note": "test"})
    out = tmp_path / "wide"
    common = ["--steps", "2", "--batch-size", "2", "--log-every", "2", "--heldout-streams", "0", "--eval-samples",
              "2", "--vision-steps", "0", "--threads", "1", "--curriculum", "refine", "--no-prefetch"]
    assert main(["train-toy", str(out), "--init", str(start), "--max-positions", "32768", *common]) == 0
    card = json.loads((out / "card.json").read_text())
    assert card["max_position_embeddings"] == 32768 and card["command"].endswith("--max-positions 32768")
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 32768
    model, _, _ = _from_checkpoint(out)  # still a toy checkpoint of this version
    assert model.config.text.max_position_embeddings == 32768
    session = Runtime.from_pretrained(str(out), cache={"policy": "full", "max_tokens": 1200},
                                      video={"resolution": [112, 112]}).session()
    assert session.rebase_at == 16384
    again = tmp_path / "again"
    assert main(["train-toy", str(again), "--init", str(out), *common]) == 0  # a round from it keeps the range
    assert json.loads((again / "config.json").read_text())["max_position_embeddings"] == 32768
    assert "--max-positions" not in json.loads((again / "card.json").read_text())["command"]
    stage = CURRICULA["refine"][1][1]
    reach = [max(draw_sample(np.random.default_rng(s), replace(stage, sparse=1.0), n, pairs=(6, 8)).tpos)
             for n in (8192, 32768) for s in range(12)]
    assert max(reach[:12]) < 8192 < max(reach[12:]) < 32768
    capsys.readouterr()
    assert main(["train-toy", str(tmp_path / "x"), "--max-positions", "500"]) == 2
    assert "--max-positions must be at least 1024" in capsys.readouterr().out


def test_compact_samples_leave_early_evicted_tokens_out_of_the_sequence():
    scene = EventScene(seed=2)
    sample = _dense_sample(scene, 3, [QA("count", "How many times did the circle appear?", "zero")])
    sample.present = np.ones((3, TOKENS), dtype=bool)
    sample.present[0, [1, 2, 9]] = False
    encoder = Encoder()
    row = encoder._encode_one(sample)
    s0 = row["video_start"]
    assert row["slot_tokens"][0] == [t for t in range(TOKENS) if t not in (1, 2, 9)]
    assert len(row["ids"]) == s0 + 3 * TOKENS - 3 + len(encoder.ids(encoder.layout.question_suffix(
        sample.qas[0].question))) + 2
    first_pair = row["positions"][:, s0:s0 + TOKENS - 3]
    kept = torch.tensor(row["slot_tokens"][0])
    assert torch.equal(first_pair[1], s0 + kept // 4) and torch.equal(first_pair[2], s0 + kept % 4)  # row, col
    batch = encoder.encode([sample])
    assert batch.video_index.shape[0] == 3 * TOKENS - 3 and int(batch.video_source[1]) == 3  # token 3 of pair 0


# ---------------------------------------------------------------------------------------------- --quiz
def test_quiz_counts_only_events_of_ingested_pairs_and_grades_answers():
    from types import SimpleNamespace

    from edgekv.apps.questions import Question
    from edgekv.apps.daemon.quiz import Quiz
    from edgekv.apps.daemon.startup import StartupError

    events = [Event("circle", "red", 1, 1, (30, 30), 10), Event("square", "blue", 5, 2, (80, 80), 12)]
    scene = EventScene(112, 112, 2.0, 3, events)
    quiz = Quiz(scene, 3)
    for frame in (0, 1, 2, 3):  # pairs 0 and 1: the circle (pair 1) is seen, the square (pairs 5-6) is not
        quiz.saw(frame / scene.fps)
    assert quiz.seen == {0}
    quiz.saw(13 / scene.fps)  # frame 13 = pair 6
    assert quiz.seen == {0, 1}
    asked = quiz.questions(max_new_tokens=24)
    assert len(asked) == 3 and all(q.source == "quiz" and q.max_new_tokens == 4 for q in asked)
    first = asked[0]  # the families in turn: colour first
    assert first.text == "What color was the circle?" or first.text == "What color was the square?"
    right = "red" if "circle" in first.text else "blue"
    first.answer = SimpleNamespace(text=f"{right.capitalize()}.")
    assert "[correct]" in quiz.grade(first)
    asked[1].answer = SimpleNamespace(text="banana")
    assert "[WRONG]" in quiz.grade(asked[1])
    asked[2].error = ValueError("no room")
    assert "not answered" in quiz.grade(asked[2])
    assert quiz.score() == "quiz: 1/3 correct about 2 events seen (of 2 in the stream)"
    single = Quiz(EventScene(112, 112, 2.0, 3, events[:1]), 1)
    single.saw(3 / scene.fps)
    assert single.score() == "quiz: 0/0 correct about 1 event seen (of 1 in the stream)"
    with pytest.raises(StartupError, match="synthetic:events"):
        Quiz.for_source(SimpleNamespace(spec="synthetic:shapes"), 3)
    assert isinstance(first, Question)


def test_daemon_quiz_one_shot_prints_graded_answers(tiny_checkpoint):
    """``--quiz N`` end to end: the stream ends, N questions about what was ingested are answered and graded,
    and the summary carries the score (random weights here: the grading, not the accuracy, is tested)."""
    import io

    from edgekv.apps.daemon.loop import Daemon, DaemonOptions
    from edgekv.config import EdgeKVConfig

    config = EdgeKVConfig().with_overrides(
        model={"path": str(tiny_checkpoint), "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:events?size=112x112&fps=4&frames=40&seed=2&rate=0.3", "fps": 4.0,
               "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 600, "text_reserve_tokens": 64},
        server={"enabled": False}, monitor={"interval_s": 0.5, "backend": "cpu"})
    out = io.StringIO()
    daemon = Daemon(config, DaemonOptions(exit_at_end=True, no_stdin=True, quiet=True, quiz=4), out=out)
    assert daemon.run() == 0
    text = out.getvalue()
    assert text.count("   truth: ") == 4 and text.count("ground truth: ") == 4 and text.count("[WRONG]") + text.count("[correct]") == 4
    assert re.search(r"quiz: [0-4]/4 correct about [1-9]\d* events? seen \(of \d+ in the stream\)", text), text


def test_daemon_quiz_refuses_a_source_without_ground_truth(tiny_checkpoint, capsys):
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions
    from edgekv.config import EdgeKVConfig

    config = EdgeKVConfig().with_overrides(
        model={"path": str(tiny_checkpoint), "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:shapes?size=112x112&fps=4&frames=8", "resolution": [112, 112]},
        server={"enabled": False})
    assert Daemon(config, DaemonOptions(exit_at_end=True, no_stdin=True, quiz=2)).run() == 2
    assert "--quiz needs" in capsys.readouterr().err


@pytest.mark.slow
def test_the_shipped_checkpoint_scores_what_its_card_states():
    """The model card's held-out accuracy is reproduced by loading the shipped fp16 checkpoint through the
    runtime (full cache, fp32) on the same fixed held-out streams, and every family beats chance. (Half of the
    streams are answered in a second process: the model runs on one thread, the machine has two cores.)"""
    import json
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from edgekv.eval.toy_accuracy import evaluate, merge_parts
    from edgekv.toy import builtin_path
    from edgekv.toy.questions import CHANCE

    card = json.loads((builtin_path() / "card.json").read_text())
    stated = card["heldout_accuracy"]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as other:
        odd = other.submit(evaluate, "builtin:toy", stated["streams"], stated["seed"], None, (1, 2))
        even = evaluate("builtin:toy", count=stated["streams"], seed=stated["seed"], part=(0, 2))
        result = merge_parts([even, odd.result()])
    assert result["streams"] == stated["streams"] and result["questions"] == stated["questions"]
    for family in FAMILIES:
        assert result["accuracy"][family] == pytest.approx(stated["accuracy"][family], abs=0.02), family
        assert result["accuracy"][family] > CHANCE[family] + 0.1, family


@pytest.mark.slow
def test_the_224_variant_knows_where_at_224_and_the_112_toy_does_not():
    """``builtin:toy-224`` (issue 27's 224 x 224 variant, 64 tokens a pair): on the first 40 held-out streams at 224
    x 224 it answers ``where`` far above chance, where the 112 x 112 toy it went on from is at chance; both names
    resolve to shipped checkpoints with their cards, and an unknown ``builtin:`` name is refused naming the known."""
    import json

    from edgekv.eval.toy_accuracy import evaluate_families
    from edgekv.model.builtin import BUILTINS, builtin_path, resolve_model_path
    from edgekv.toy.questions import CHANCE

    card = json.loads((builtin_path("builtin:toy-224") / "card.json").read_text())
    assert card["resolution"] == [224, 224] and card["heldout_accuracy"]["size"] == 224
    assert set(BUILTINS) == {"builtin:toy", "builtin:toy-224"}
    with pytest.raises(FileNotFoundError, match="builtin:toy-112: not a shipped checkpoint .shipped: builtin:toy, "):
        resolve_model_path("builtin:toy-112")
    from types import SimpleNamespace

    from edgekv.apps.daemon.startup import StartupError, check_model_dir

    check_model_dir(SimpleNamespace(model=SimpleNamespace(path="builtin:toy-224")))  # the daemon takes it
    with pytest.raises(StartupError, match="model.path: builtin:toy-112: builtin:toy-112: not a shipped"):
        check_model_dir(SimpleNamespace(model=SimpleNamespace(path="builtin:toy-112")))

    def where(model: str) -> dict:
        result = evaluate_families(model, ("events",), count=40, questions="all", size=224)
        return result["families"]["events"]["by_question"]

    variant, toy = where("builtin:toy-224"), where("builtin:toy")
    # measured on these 40 streams (Y224s): where 1.000 (37 of 37) vs 0.270 (10 of 37); on 200 streams 0.952 vs 0.296
    assert variant["where"]["n"] == toy["where"]["n"] >= 25
    assert variant["where"]["accuracy"] >= 0.6 and toy["where"]["accuracy"] <= 0.45
    for family in FAMILIES:
        assert variant[family]["accuracy"] > CHANCE[family] + 0.3, family


DEMO_QUIZ_MIN_CORRECT = 7  # measured: 9 of 10 on the 2-core x86 dev machine (fp32; a margin for other CPUs)


@pytest.mark.slow
def test_readme_demo_answers_about_its_stream():
    """The README's first command (after the install): the shipped toy model on configs/cpu-demo.yaml, a
    stream long enough for the cap to compress it many times, then a graded quiz about what it saw."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "edgekv.apps.daemon.camera", "--config", "configs/cpu-demo.yaml",
                           "--no-stdin", "--no-server", "--exit-at-end", "--quiz", "10"], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "holds random weights" not in out and "stream ended: the source ended after 160 frames" in out
    compressions = int(re.search(r"per pair; compressions (\d+) \(", out).group(1))
    assert compressions >= 3  # the 80-pair stream does not fit the 640-token cap: it was compressed
    score = re.search(r"quiz: (\d+)/10 correct about (\d+) events? seen", out)
    assert score, out
    assert out.count("ground truth: ") == 10
    assert int(score.group(1)) >= DEMO_QUIZ_MIN_CORRECT, out


def test_prefetched_batches_are_the_batches_drawn_in_process():
    """A worker process drawing ahead yields exactly the batches the trainer would draw itself, and leaves
    the generator where the in-process draws leave it (so a run with prefetching is the same run)."""
    from edgekv.toy.prefetch import batches
    from edgekv.toy.train import qa_batches, vision_batches

    for make, args in ((qa_batches, (3, 2, True, 5)), (vision_batches, (2, 4))):
        here, there = np.random.default_rng(11), np.random.default_rng(11)
        local = list(batches(make, here, *args, prefetch=False))
        remote = list(batches(make, there, *args, prefetch=True))
        assert len(local) == len(remote) == args[0]
        for a, b in zip(local, remote):
            fields = list(vars(a).values()) if hasattr(a, "__dict__") else list(a)
            other = list(vars(b).values()) if hasattr(b, "__dict__") else list(b)
            for x, y in zip(fields, other):
                assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        assert here.bit_generator.state == there.bit_generator.state


def _children_of(pid: int) -> set[int]:
    from pathlib import Path

    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child its new parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="reads /proc to find the worker processes")
@pytest.mark.parametrize("kind", ["prefetch", "sharded"])
def test_batch_workers_end_when_their_trainer_is_killed(kind):
    """A trainer killed by SIGKILL (or SIGTERM: no exit handler runs either way) cannot end its daemon batch
    workers; each of them, blocked on a full queue, notices its trainer is gone and exits instead of holding its
    memory for ever (seen: a killed ``train-toy`` left its prefetch worker, 750 MB, for 50 minutes)."""
    import os
    import select
    import signal
    import subprocess
    import sys
    import time

    if not hasattr(os, "pidfd_open"):
        pytest.skip("waits on the workers' exit with os.pidfd_open (Linux 5.3+, Python 3.9+)")
    draw = ("batches(vision_batches, np.random.default_rng(0), 1000, 2)" if kind == "prefetch" else
            "sharded(vision_batches_sharded, 1000, 7, 1000, 2, workers=2)")
    script = ("import sys, numpy as np\n"
              "from edgekv.toy.prefetch import batches, sharded\n"
              "from edgekv.toy.train import vision_batches, vision_batches_sharded\n"
              "if __name__ == '__main__':\n"
              f"    it = {draw}\n"
              "    next(it)\n"
              "    print('ready', flush=True)\n"
              "    sys.stdin.read()\n")
    trainer = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "ready"
        workers = _children_of(trainer.pid)
        assert workers  # the batch worker(s), and torch's resource tracker
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    # Wait on each worker's exit itself (a pidfd turns readable when its process ends), bounded generously: the
    # workers look for their trainer every 5 s, and a busy machine only delays that.
    deadline = time.monotonic() + 300
    alive = set()
    for pid in workers:
        try:
            handle = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # already gone
        try:
            select.select([handle], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(handle)
        if _running(pid):
            alive.add(pid)
    assert not alive, f"workers {sorted(alive)} outlived their killed trainer"


@pytest.mark.parametrize("kind", ["prefetch", "sharded"])
def test_a_ctrl_c_ends_the_batch_workers_without_killing_them(kind):
    """Ctrl-C (or ``timeout -s INT``) reaches the trainer and its workers, one process group: the workers ignore it,
    the trainer stops taking batches, and every worker — blocked on its full queue — ends by itself, so the trainer
    exits at once instead of joining each worker until the join gives up and kills it (seen on the H200: a
    ``train-toy --workers 12`` stopped by its timeout took ~50 s more, and the call ran out before its checkpoints
    were packed). The script counts the kills the trainer had to make."""
    import os
    import select
    import signal
    import subprocess
    import sys

    draw = ("batches(vision_batches, np.random.default_rng(0), 1000, 2)" if kind == "prefetch" else
            "sharded(vision_batches_sharded, 1000, 7, 1000, 2, workers=2)")
    # A shell's background job (`cmd &`, as CI or nohup may start the suite) begins with SIGINT ignored, and Python
    # then leaves it ignored: the script puts back the handler a terminal's process has, whatever started the tests.
    script = ("import signal, sys, time, multiprocessing.process as mp, numpy as np\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "from edgekv.toy.prefetch import batches, sharded\n"
              "from edgekv.toy.train import vision_batches, vision_batches_sharded\n"
              "kills = []\n"
              "kill = mp.BaseProcess.kill\n"
              "mp.BaseProcess.kill = lambda self: (kills.append(self.name), kill(self))\n"
              "if __name__ == '__main__':\n"
              f"    it = {draw}\n"
              "    next(it); next(it)\n"  # both shards have drawn: both workers run
              "    local = it.gi_frame.f_locals\n"  # wait until every worker is blocked on its full queue
              "    deadline = time.monotonic() + 600\n"  # generous: the check below holds either way
              "    while not all(q.full() for q in local.get('channels', [local.get('channel')])):\n"
              "        if time.monotonic() > deadline:\n"
              "            break\n"
              "        time.sleep(0.05)\n"  # a queue's fullness has no event to wait on: polled
              "    try:\n"  # before 'ready': the INT may come at once (seen: inside the print, outside the try)
              "        print('ready', flush=True)\n"
              "        while True:\n"
              "            signal.pause()\n"  # until the INT: no clock involved
              "    except KeyboardInterrupt:\n"
              "        it.close()\n"
              "        print('closed, killed:', len(kills), flush=True)\n")
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        ready, _, _ = select.select([trainer.stdout], [], [], 600)
        assert ready and trainer.stdout.readline().strip() == "ready"
        os.killpg(trainer.pid, signal.SIGINT)  # the whole group, as a terminal's Ctrl-C
        out, _ = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, out
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
    assert "closed, killed: 0" in out, out


def _equal_items(first, second) -> None:
    for a, b in zip(first, second, strict=True):
        fields = list(vars(a).values()) if hasattr(a, "__dict__") else list(a)
        other = list(vars(b).values()) if hasattr(b, "__dict__") else list(b)
        for x, y in zip(fields, other, strict=True):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_sharded_batches_are_the_same_for_any_number_of_workers():
    """``--workers N`` draws step i in worker i mod N from that step's own generators: the batches come back in
    step order and equal the in-process draw for N = 2 and 3 (QA batches with auxiliary labels, and the vision
    warm-up's); the draw is another run than the single stream's (not its first batch)."""
    from edgekv.toy.prefetch import sharded
    from edgekv.toy.train import qa_batches, qa_batches_sharded, vision_batches_sharded

    for make, steps, args in ((qa_batches_sharded, 5, (7, 5, 2, True)), (vision_batches_sharded, 3, (7, 3, 2))):
        local = list(sharded(make, steps, *args, workers=0))
        assert len(local) == steps
        for workers in (2, 3):
            _equal_items(local, list(sharded(make, steps, *args, workers=workers)))
    stream = next(qa_batches(np.random.default_rng(7), 5, 2, True, 7))
    first = list(sharded(qa_batches_sharded, 5, 7, 5, 2, True, workers=0))[0]
    assert stream.ids.shape != first.ids.shape or not torch.equal(stream.ids, first.ids)


def test_a_failing_sharded_worker_is_reported():
    from edgekv.toy.prefetch import sharded
    from edgekv.toy.train import qa_batches_sharded

    with pytest.raises(RuntimeError, match="batch worker 0 failed"):
        list(sharded(qa_batches_sharded, 2, 0, 2, -1, True, workers=2))


def test_train_toy_workers_and_device_flags(tmp_path, capsys):
    """A CPU run with ``--workers 2`` trains and its card keeps the draw (``--workers 2`` in the command, device
    cpu); ``--device cuda`` where torch finds no GPU, a device of another kind and negative workers are
    refused before anything is written."""
    from edgekv.apps.cli import main

    out = tmp_path / "sharded"
    assert main(["train-toy", str(out), "--steps", "2", "--batch-size", "2", "--heldout-streams", "0",
                 "--eval-samples", "2", "--vision-steps", "2", "--threads", "1", "--width", "32", "--layers", "1",
                 "--workers", "2", "--log-every", "1"]) == 0
    card = __import__("json").loads((out / "card.json").read_text())
    assert card["workers"] == 2 and card["device"] == "cpu" and card["gpu"] is None
    assert card["command"].endswith("--workers 2") and len(card["history"]) == 2 and len(card["vision_history"]) == 2
    capsys.readouterr()
    refusals = [(["--device", "tpu"], "--device must be cpu, cuda or cuda:N"), (["--workers", "-1"], "--workers must")]
    if not torch.cuda.is_available():
        refusals.append((["--device", "cuda"], "torch finds no CUDA GPU here"))
    for flags, message in refusals:
        assert main(["train-toy", str(tmp_path / "no"), "--steps", "1", *flags]) == 2
        assert message in capsys.readouterr().out
    assert not (tmp_path / "no").exists()


@pytest.mark.gpu
def test_train_toy_on_cuda_moves_every_batch_and_writes_a_host_checkpoint(tmp_path):
    """On a GPU: the warm-up and the question steps run on CUDA with sharded drawing; the loss is finite, the
    checkpoint loads on the host, and a batch's forward on CUDA matches the host's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from edgekv.model.loading import load_pretrained
    from edgekv.toy.train import Encoder, forward_logits, heldout, train

    card = train(tmp_path / "gpu", steps=4, batch_size=2, vision_steps=2, heldout_streams=0, eval_samples=4,
                 width=32, layers=1, device="cuda", workers=2, log=lambda line: None, log_every=2)
    assert card["gpu"] and card["device"].startswith("cuda")
    assert all(np.isfinite(record["loss"]) for record in card["history"])
    model = load_pretrained(tmp_path / "gpu", dtype=torch.float32).eval()
    batch = Encoder().encode(heldout(0, 2))
    with torch.no_grad():
        host = forward_logits(model, batch)
        device = forward_logits(model.cuda(), batch.to("cuda")).cpu()
    torch.testing.assert_close(device, host, rtol=1e-3, atol=1e-3)


def test_a_failing_batch_worker_is_reported():
    from edgekv.toy.prefetch import batches
    from edgekv.toy.train import qa_batches

    with pytest.raises(RuntimeError, match="batch worker failed"):
        list(batches(qa_batches, np.random.default_rng(0), 2, -1, True, 0, prefetch=True))


def test_a_small_shape_on_a_cell_corner_still_has_a_token_that_carries_it():
    """A radius-8 circle centred on the corner of four 28 px cells covers under 10 % of each: its main token
    (the cell it covers most) carries its colour and shape anyway, in the QA data and in the vision
    warm-up's labels — before, such shapes were labelled background everywhere."""
    from edgekv.toy.data import EVENT_COVER, event_tokens
    from edgekv.toy.train import vision_batch

    event = Event("circle", "red", 0, 1, (56, 56), 8)
    scene = EventScene(seed=0, events=[event])
    cover = scene.cell_cover(event).reshape(-1)
    assert cover.max() < EVENT_COVER
    carried, shows = event_tokens(cover)
    assert carried.sum() == shows.sum() == 1 and carried[int(np.argmax(cover))]
    big = EventScene(seed=0, events=[Event("square", "blue", 0, 1, (50, 50), 18)])
    carried, shows = event_tokens(big.cell_cover(big.events[0]).reshape(-1))
    assert carried.sum() > shows.sum() >= 1  # slivers carry the colour only

    from edgekv.preprocess import FramePreprocessor

    rng = np.random.default_rng(5)
    _, _, shape, color = vision_batch(rng, FramePreprocessor(resolution=(112, 112)), 16)
    shape, color = shape.view(16, TOKENS), color.view(16, TOKENS)
    # every pair has 1-4 events; each keeps at least one token with its colour and its shape
    assert ((color > 0).sum(1) >= 1).all() and ((shape > 0).sum(1) >= 1).all()



def test_warm_up_lures_are_look_alikes_clear_of_the_events_and_labelled_none():
    """``vision_batch(lures=...)``: a share of the world pairs also shows look-alikes (an out-of-vocabulary shape in a
    vocabulary colour, ``lure_clutter``) placed clear of the events; they change the pixels, not the labels (every
    token a look-alike covers stays "none" unless an event covers it), and without lures the draw is what it was."""
    from edgekv.preprocess import FramePreprocessor
    from edgekv.toy.train import lure_clutter, vision_batch
    from edgekv.video.world import DISTRACTOR_SHAPES, world_event

    rng = np.random.default_rng(3)
    events = [world_event(rng, "cross", "red", 0, 1, 112, 112), world_event(rng, "circle", "blue", 0, 1, 112, 112)]
    drawn = 0
    for _ in range(20):
        lures = lure_clutter(rng, 3, events, 112)
        assert len(lures) <= 3  # one that finds no room in a few tries is left out ...
        drawn += len(lures)
        placed = [(e.center, e.radius) for e in events] + [(c.center, c.radius) for c in lures]
        for i, (center, radius) in enumerate(placed):
            assert all(np.hypot(center[0] - other[0], center[1] - other[1]) > radius + other_radius
                       for other, other_radius in placed[i + 1:])
        assert all(c.shape in DISTRACTOR_SHAPES and c.color in COLORS and c.pairs == -1 for c in lures)
    assert drawn >= 20  # ... a third of those asked for beside two events of the world's sizes

    pre = FramePreprocessor(resolution=(112, 112))
    plain = vision_batch(np.random.default_rng(8), pre, 1, ("noise",), 112, 1.0)
    again = vision_batch(np.random.default_rng(8), pre, 1, ("noise",), 112, 1.0, 0.0)
    lured = vision_batch(np.random.default_rng(8), pre, 1, ("noise",), 112, 1.0, 1.0)
    assert all(torch.equal(x, y) for x, y in zip(plain, again))
    assert not torch.equal(plain[0], lured[0])  # the look-alikes are drawn ...
    assert torch.equal(plain[2], lured[2]) and torch.equal(plain[3], lured[3])  # ... and labelled none


def test_warm_up_position_labels_are_the_cells_the_renderer_draws_in():
    """``token_positions`` (row, column of a tower token in its pair: raster order, as the tower returns them) names
    the cell a shape is drawn in, at 112 and 224 px; the warm-up's position probes train the tower with them."""
    from edgekv.toy.train import token_positions

    for size in (112, 224):
        side = size // 28
        for x, y in ((14, 14), (size - 15, 20), (40, size - 10), (size // 2 + 3, size // 2 - 30)):
            scene = EventScene(size, size, seed=0, events=[Event("square", "red", 0, 1, (x, y), 6)])
            token = int(np.argmax(scene.cell_cover(scene.events[0]).reshape(-1)))
            row, col = token_positions(3 * side * side, side)
            # the same token of the third pair of a batch
            assert (row[2 * side * side + token].item(), col[2 * side * side + token].item()) == (y // 28, x // 28)


def test_warm_up_trains_the_tower_to_tell_where_its_tokens_are():
    """With ``position`` the warm-up's loss has the row and column probes too (the log says their accuracy), and
    their gradient reaches the tower: the same batches leave it different than without."""
    from edgekv.toy.train import warm_up_vision

    towers, logs = {}, {}
    for position in (True, False):
        model = init_model(toy_config(width=32, layers=1, vision_width=32, vision_depth=1), 3)
        torch.manual_seed(0)
        logs[position] = warm_up_vision(model, 2, np.random.default_rng(4), batch_size=4, log=lambda _: None,
                                        log_every=1, position=position)
        towers[position] = [p.detach().clone() for p in model.visual.parameters()]
    assert {"token_row_accuracy", "token_col_accuracy"} <= set(logs[True][-1])
    assert "token_row_accuracy" not in logs[False][-1]
    assert 0.0 <= logs[True][-1]["token_col_accuracy"] <= 1.0
    assert any(not torch.equal(a, b) for a, b in zip(towers[True], towers[False]))


# ---------------------------------------------------------------------------------------------- issue 27: new questions
def test_region_of_names_clear_regions_and_skips_the_borders_between_them():
    from edgekv.toy.questions import region_of

    assert region_of((56, 56), 112, 112) == "center"
    assert region_of((10, 56), 112, 112) == "left" and region_of((100, 50), 112, 112) == "right"
    assert region_of((56, 8), 112, 112) == "top" and region_of((60, 104), 112, 112) == "bottom"
    assert region_of((75, 56), 112, 112) is None  # between the centre and the right
    assert region_of((12, 12), 112, 112) is None  # a corner: on the diagonal
    assert region_of((20, 112), 224, 224) == "left"  # at 224 x 224 the same share of the frame


def test_where_second_and_binding_questions_follow_the_ground_truth():
    from edgekv.toy.questions import binding_options, second_question, where_question

    events = [Event("circle", "red", 1, 1, (15, 56), 10), Event("square", "blue", 4, 1, (56, 100), 12),
              Event("circle", "green", 8, 2, (100, 56), 10), Event("circle", "red", 12, 1, (96, 50), 10)]
    assert where_question(events, "blue", "square").answer == "bottom"
    assert where_question(events, "green", "circle").answer == "right"
    assert where_question(events, "red", "circle") is None  # seen left and right: no single answer
    assert where_question(events, "red", "square") is None  # never seen
    second = second_question(events, "circle")
    assert second.question == "What color was the second circle?" and second.answer == "green"
    assert second_question(events, "square") is None
    positives, negatives = binding_options(events)
    assert ("red", "circle") in positives and ("green", "circle") in positives
    assert ("blue", "square") not in positives  # neither its colour nor its shape came with another partner
    assert set(negatives) == {("red", "square"), ("green", "square"), ("blue", "circle")}
    rng = np.random.default_rng(0)
    answers = [sample_question(events, "binding", rng).answer for _ in range(200)]
    assert 0.35 < answers.count("yes") / 200 < 0.65


def test_extra_words_take_ids_after_the_special_tokens_so_old_checkpoints_keep_their_ids():
    import json

    from edgekv.toy import builtin_path
    from edgekv.toy.questions import ALL_FAMILIES, EXTRA_FAMILIES, WHERE_WORDS
    from edgekv.toy.vocab import extra_words

    tokenizer, special = build_tokenizer()
    shipped = json.loads((builtin_path() / "tokenizer.json").read_text())["model"]["vocab"]
    ours = tokenizer.get_vocab()
    assert all(ours[word] == index for word, index in shipped.items())  # every old id means what it meant
    assert min(ours[w] for w in extra_words()) > max(special.values())
    assert toy_config().text.vocab_size == 64  # the shipped config: checkpoints go on with --init
    unk = tokenizer.token_to_id("<unk>")
    events = [_ev("circle", "red", 1), _ev("circle", "blue", 5), _ev("square", "blue", 9)]
    rng = np.random.default_rng(3)
    for family in ALL_FAMILIES:
        qa = sample_question(events, family, rng)
        if qa is None:
            assert family == "where"  # _ev's shapes sit at one place; checked above with placed events
            continue
        assert unk not in tokenizer.encode(qa.question + " " + qa.answer, add_special_tokens=False).ids, qa
    for word in WHERE_WORDS:
        assert tokenizer.encode(word, add_special_tokens=False).ids == [ours[word]]
    assert set(EXTRA_FAMILIES) <= set(TEMPLATES)


def test_world_curriculum_samples_draw_every_family_and_never_a_held_out_background():
    from collections import Counter

    from edgekv.toy.data import WORLD
    from edgekv.toy.questions import ALL_FAMILIES, WHERE_WORDS

    rng = np.random.default_rng(2)
    families = ("noise", "gradient", "stripes")
    asked: Counter = Counter()
    worlds = 0
    for index in range(12):
        stage = WORLD[index % 2][1]
        sample = draw_sample(rng, stage, MAX_POSITIONS, pairs=(6, 14), families=families)
        assert sample.evict_at.shape == (sample.slots, TOKENS)
        for qa in sample.qas:
            asked[qa.family] += 1
            if qa.family == "where":
                assert qa.answer in WHERE_WORDS
            assert set(qa.about) <= set(sample.visible)
        radii = [e.radius for e in sample.events]
        worlds += bool(radii) and min(radii) >= 14
    assert set(asked) >= set(ALL_FAMILIES) - {"order"} and worlds >= 6
    big = draw_sample(np.random.default_rng(5), WORLD[1][1], MAX_POSITIONS, size=224, pairs=(4, 6), families=families)
    assert big.evict_at.shape[1] == 64 and big.pairs[0][0].shape == (224, 224, 3)


def test_world_mild_224_keeps_the_112_curriculum_but_a_quarter_of_its_pairs():
    """``--curriculum world-mild-224``: world-mild-where's stages and questions, a quarter of the kept pairs (at
    least 4), so a 224 x 224 sample (64 tokens a pair) holds no more video tokens than a 112 x 112 one did."""
    rng = np.random.default_rng(6)
    small, big = CURRICULA["world-mild-where"], CURRICULA["world-mild-224"]
    assert [share for share, _ in big] == [share for share, _ in small]
    for (_, a), (_, b) in zip(small, big):
        assert b.families == a.families and b.mild == a.mild and b.apart and b.batch_divisor == a.batch_divisor
        assert b.pairs == (max(4, a.pairs[0] // 4), max(8, a.pairs[1] // 4))
        assert b.pairs[1] * 64 <= a.pairs[1] * 16
    sample = draw_sample(rng, big[1][1], MAX_POSITIONS, size=224, pairs=(16, 18), families=("noise", "photo"))
    assert sample.evict_at.shape[1] == 64 and sample.pairs[0][0].shape == (224, 224, 3)
    assert sample.slots >= 16


def test_world_scratch_goes_from_one_event_to_long_contexts_all_in_the_world():
    """``--curriculum world-scratch`` (a new model in the randomized world): its stages in order over the run,
    every one 85 % world (so the vision warm-up draws 85 % world frames too), and a one-event sample asks only
    colour, shape and exists."""
    rng = np.random.default_rng(4)
    stages = CURRICULA["world-scratch"]
    assert [s.name for _, s in stages] == ["world: one event", "world: several events", "world: long, sparse, thinned",
                                          "world: long contexts, many distractor pairs"]
    assert abs(sum(share for share, _ in stages) - 1) < 1e-9 and all(s.world == 0.85 for _, s in stages)
    first = [stage_at(p, rng, "world-scratch").name for p in np.linspace(0, 0.14, 50)]
    last = [stage_at(p, rng, "world-scratch").name for p in np.linspace(0.71, 0.999, 50)]
    assert first.count("world: one event") >= 35 and last.count("world: long contexts, many distractor pairs") >= 35
    sample = draw_sample(rng, stages[0][1], MAX_POSITIONS, pairs=(2, 4), families=("noise", "checks"))
    assert len(sample.events) == 1 and {qa.family for qa in sample.qas} <= {"color", "shape", "exists"}


def test_world_training_names_the_event_region_among_the_auxiliary_targets():
    from edgekv.toy.questions import WHERE_WORDS

    scene = EventScene(seed=3, events=[Event("square", "red", 1, 1, (16, 56), 14)])
    carried = np.full((3, TOKENS), -1, dtype=np.int64)
    carried[1, [4, 8]] = 0  # two tokens of the left column show the square
    sample = _dense_sample(scene, 3, [QA("where", "Where was the red square?", "left")])
    sample.carried, sample.cover = carried, np.where(carried >= 0, 0.5, 0.0)
    encoder = Encoder(aux=True, aux_where=True)
    words = []
    for _ in range(30):
        batch = encoder.encode([sample])
        words += [encoder.tokenizer.id_to_token(int(t)) for t, f in zip(batch.targets, batch.families) if f == "aux"]
    shown = [w for w in words if w != "no"]
    assert set(shown) <= {"left", "red", "square"} and "left" in shown and "red" in shown
    assert not {w for w in words if w in WHERE_WORDS} - {"left"}
    plain = Encoder(aux=True)
    batch = plain.encode([sample])
    assert "left" not in {plain.tokenizer.id_to_token(int(t)) for t, f in zip(batch.targets, batch.families)
                          if f == "aux"}


def test_tower_probe_tool_scores_every_family_on_the_same_events(tmp_path, capsys):
    """``tools/toy_tower_probe.py`` (docs/measurements.md, "The vision tower on held-out backgrounds"): a few probe
    steps on a small new tower, then per-family scores over the same event tokens; an unknown family is refused."""
    import importlib.util
    import json
    from pathlib import Path

    tool = Path(__file__).parents[1] / "tools" / "toy_tower_probe.py"
    spec = importlib.util.spec_from_file_location("toy_tower_probe", tool)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    out = tmp_path / "probe.json"
    assert probe.main(["--steps", "2", "--batch", "2", "--vision-width", "32", "--vision-depth", "1",
                       "--train-families", "classic,noise", "--families", "classic,checks", "--eval-pairs", "32",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["by_family"]) == {"classic", "checks"} and result["trained"] == ["classic", "noise"]
    counts = {family: scores["tokens"] for family, scores in result["by_family"].items()}
    assert counts["classic"] == counts["checks"] > 0  # the same events on both backgrounds
    assert all(0 <= scores[k] <= 1 for scores in result["by_family"].values() for k in ("shape", "color", "bg"))
    assert "row" not in result["by_family"]["classic"]
    assert probe.main(["--steps", "2", "--batch", "2", "--vision-width", "32", "--vision-depth", "1", "--position",
                       "--train-families", "classic", "--families", "classic", "--eval-pairs", "32",
                       "--out", str(out)]) == 0
    scores = json.loads(out.read_text())["by_family"]["classic"]
    assert 0 <= scores["row"] <= 1 and 0 <= scores["col"] <= 1 and scores["tokens"] == counts["classic"]
    assert probe.main(["--steps", "1", "--batch", "2", "--vision-width", "32", "--vision-depth", "1", "--families",
                       "classic", "--train-families", "classic", "--eval-pairs", "32", "--out", str(out), "--save",
                       str(tmp_path / "kept")]) == 0
    from edgekv.model.loading import load_pretrained

    assert load_pretrained(tmp_path / "kept", dtype=torch.float32).config.vision.hidden_size == 32
    assert "toy_tower_probe.py" in json.loads((tmp_path / "kept" / "card.json").read_text())["note"]
    out.unlink()
    assert probe.main(["--steps", "1", "--families", "classic,marble", "--out", str(out)]) == 2
    assert "marble" in capsys.readouterr().err and not out.exists()


def test_world_where_asks_where_three_times_as_often_as_world():
    """``--curriculum world-where`` (``world-where-long``): WORLD's (WORLD_LONG's) stages with ``where`` listed three
    times among the families drawn per question, nothing else changed."""
    from dataclasses import replace

    for base, variant in (("world", "world-where"), ("world-long", "world-where-long")):
        world, where = CURRICULA[base], CURRICULA[variant]
        assert [share for share, _ in where] == [share for share, _ in world]
        for (_, a), (_, b) in zip(world, where):
            assert b.families.count("where") == 3 * a.families.count("where") == 3
            assert sorted(f for f in b.families if f != "where") == sorted(f for f in a.families if f != "where")
            assert replace(b, name=a.name, families=a.families) == a
    asked = {}
    for name in ("world", "world-where"):
        rng = np.random.default_rng(8)
        stage = CURRICULA[name][0][1]
        families = [qa.family for _ in range(24) for qa in draw_sample(rng, stage, MAX_POSITIONS, pairs=(4, 6),
                                                                        families=("noise", "checks")).qas]
        asked[name] = families.count("where") / len(families)
    assert asked["world-where"] > 2 * asked["world"]


def test_world_mild_hard_asks_order_and_count_twice_as_often():
    """``--curriculum world-mild-hard``: world-mild's stages, with order and count listed twice (``where`` three
    times, as there), nothing else changed."""
    from dataclasses import replace

    mild, hard = CURRICULA["world-mild"], CURRICULA["world-mild-hard"]
    assert [share for share, _ in hard] == [share for share, _ in mild]
    for (_, a), (_, b) in zip(mild, hard):
        assert b.families.count("order") == b.families.count("count") == 2
        assert b.families.count("where") == a.families.count("where") == 3
        assert replace(b, name=a.name, families=a.families) == a and b.mild == 0.5
    asked = {}
    for name in ("world-mild", "world-mild-hard"):
        rng = np.random.default_rng(8)
        families = [qa.family for _, stage in CURRICULA[name] for _ in range(80)
                    for qa in draw_sample(rng, stage, MAX_POSITIONS, pairs=(4, 6), families=("noise", "checks")).qas]
        asked[name] = sum(f in ("order", "count") for f in families) / len(families)
    # 2/11 vs 4/13 of the draws; a family a sample cannot ask (order needs two events) is drawn again
    assert asked["world-mild-hard"] > 1.3 * asked["world-mild"]


def test_count_durations_tool_asks_about_one_event_of_each_length(tmp_path):
    """``tools/toy_count_durations.py``: per duration, streams whose first event is the only one of its shape and
    lasts exactly that many pairs; the result counts the toy's ``one`` answers over them."""
    import importlib.util
    import json
    from pathlib import Path

    tool = Path(__file__).parents[1] / "tools" / "toy_count_durations.py"
    spec = importlib.util.spec_from_file_location("toy_count_durations", tool)
    counts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counts)
    for duration in (1, 2, 3):
        for index in range(5):
            scene = counts.stream(duration, index)
            first = scene.events[0]
            assert first.pairs == duration and [e.shape for e in scene.events].count(first.shape) == 1
            assert first.last_pair < counts.PAIRS
    out = tmp_path / "counts.json"
    result = counts.main(["--streams", "2", "--durations", "1,3", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert sorted(result["by_duration"]) == [1, 3]
    assert all(row["n"] == 2 and 0 <= row["right"] <= 2 for row in result["by_duration"].values())


def _back_to_back(sample: Sample) -> int:
    """Events of one shape starting in the pair right after another of its events ended (in time, not slots)."""
    step = min(b - a for a, b in zip(sample.tpos, sample.tpos[1:]) if b > a)
    return sum(1 for a in sample.events for b in sample.events
               if a.shape == b.shape and b.first_pair == a.first_pair + a.pairs
               and sample.tpos[b.first_pair] - sample.tpos[b.first_pair - 1] <= step)


def test_world_mild_apart_never_brings_a_shape_back_in_the_next_pair():
    """``--curriculum world-mild-apart``: world-mild-count with ``Stage.apart``, so that one shape on screen over
    consecutive pairs is always one appearance, as in the card's streams (``EventPlan.gap``); world-mild-count's
    samples do put a shape's events back to back."""
    from dataclasses import replace

    count, apart = CURRICULA["world-mild-count"], CURRICULA["world-mild-apart"]
    for (_, a), (_, b) in zip(count, apart):
        assert b.apart and not a.apart and replace(b, name=a.name, apart=False) == a
    found = {}
    for name in ("world-mild-count", "world-mild-apart"):
        rng = np.random.default_rng(3)
        samples = [draw_sample(rng, stage, MAX_POSITIONS, pairs=(4, 24), families=("noise", "checks"))
                   for _, stage in CURRICULA[name] for _ in range(40)]
        found[name] = sum(_back_to_back(sample) for sample in samples)
        assert sum(len(sample.events) for sample in samples) > 200
    assert found["world-mild-apart"] == 0 and found["world-mild-count"] > 10


def test_world_mild_where_asks_where_six_times_in_seventeen():
    """``--curriculum world-mild-where``: world-mild-apart's stages with `where` drawn 6 times in 17 (3 in 14 there),
    everything else the same; the questions drawn follow the families' weights."""
    from dataclasses import replace

    apart, where = CURRICULA["world-mild-apart"], CURRICULA["world-mild-where"]
    for (share_a, a), (share_w, w) in zip(apart, where, strict=True):
        assert share_a == share_w and replace(w, name=a.name, families=a.families) == a
        assert (a.families.count("where"), len(a.families)) == (3, 14)
        assert (w.families.count("where"), len(w.families)) == (6, 17)
    rng = np.random.default_rng(5)
    asked = [q.family for _ in range(60)
             for q in draw_sample(rng, where[1][1], MAX_POSITIONS, pairs=(4, 24), families=("noise", "checks")).qas]
    # 0.29 here (a draw that finds no `where` to ask asks another family), world-mild-apart's same stage 0.17
    assert 0.24 < asked.count("where") / len(asked) < 0.40


def test_the_cli_offers_every_curriculum_and_no_other():
    """``edgekv train-toy --curriculum`` lists its choices without importing the data module; they must stay the
    keys of ``CURRICULA``."""
    import argparse

    from edgekv.toy.cli import add_train_arguments

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    action = next(a for a in parser._actions if a.dest == "curriculum")
    assert sorted(action.choices) == sorted(CURRICULA)


def test_value_norms_tool_compares_event_pairs_with_background_pairs(tmp_path):
    """``tools/toy_value_norms.py``: the AUC of the per-pair largest value norm, event pairs against background
    pairs, over every frame pair of the stream (ties count half; None without both kinds)."""
    import importlib.util
    import json
    from pathlib import Path

    tool = Path(__file__).parents[1] / "tools" / "toy_value_norms.py"
    spec = importlib.util.spec_from_file_location("toy_value_norms", tool)
    norms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(norms)
    assert norms.auc([3.0, 2.0], [1.0, 0.5]) == 1.0 and norms.auc([1.0], [2.0]) == 0.0
    assert norms.auc([1.0, 3.0], [2.0, 1.0]) == 0.625 and norms.auc([], [1.0]) is None
    out = tmp_path / "vn.json"
    result = norms.main(["--source", "synthetic:events?size=112x112&fps=2&frames=60&rate=0.15&noise=3",
                         "--streams", "1", "--out", str(out)])
    row = result["streams"][0]
    assert row["event_pairs"] > 0 and row["event_pairs"] + row["background_pairs"] == 30
    assert 0.0 <= row["auc"] <= 1.0 and result["mean_auc"] == row["auc"]
    assert json.loads(out.read_text())["streams"][0]["auc"] == row["auc"]


def test_world_mild_count_asks_count_thrice_over_more_two_pair_events():
    """``--curriculum world-mild-count``: world-mild-hard's stages with count listed three times and half of the
    events two frame pairs long; the samples hold more two-pair events and ask more counts."""
    from dataclasses import replace

    hard, count = CURRICULA["world-mild-hard"], CURRICULA["world-mild-count"]
    assert [share for share, _ in count] == [share for share, _ in hard]
    for (_, a), (_, b) in zip(hard, count):
        assert b.families.count("count") == 3 and b.families.count("order") == 2 and b.two_pair_events == 0.5
        assert replace(b, name=a.name, families=a.families, two_pair_events=a.two_pair_events) == a
    asked, two_pair = {}, {}
    for name in ("world-mild-hard", "world-mild-count"):
        rng = np.random.default_rng(9)
        samples = [draw_sample(rng, stage, MAX_POSITIONS, pairs=(4, 6), families=("noise", "checks"))
                   for _, stage in CURRICULA[name] for _ in range(60)]
        families = [qa.family for sample in samples for qa in sample.qas]
        asked[name] = families.count("count") / len(families)
        events = [e for sample in samples for e in sample.events]
        two_pair[name] = sum(e.pairs == 2 for e in events) / len(events)
    assert asked["world-mild-count"] > 1.2 * asked["world-mild-hard"]
    assert two_pair["world-mild-count"] > 1.3 * two_pair["world-mild-hard"]


def test_grow_layers_answers_as_before_and_the_new_layers_train(tmp_path, capsys):
    """``--grow-layers N`` / ``--grow-vision N`` deepen an ``--init`` toy: the grown model's logits equal the
    original's (new layers are copies with zeroed residual branches, the LM's spread through the stack, the
    tower's appended with every old block keeping its attention kind), its config is a toy's of the new depths,
    and training moves the new layers' zeroed matrices; without ``--init`` it is refused."""
    from edgekv.apps.cli import main
    from edgekv.model.loading import load_pretrained
    from edgekv.toy.model import grow_layers

    start = init_model(toy_config(width=32, layers=2, vision_width=32, vision_depth=2), 5)
    with torch.no_grad():  # trained-looking layers: non-zero everywhere, so a wrong copy shows
        for name, param in start.language.named_parameters():
            if name.startswith("layers."):
                param.add_(torch.randn_like(param) * 0.05)
    grown = grow_layers(start, 3, vision=3)
    assert grown.config == toy_config(width=32, layers=5, vision_width=32, vision_depth=5)
    assert start.config.vision.fullatt_block_indexes == (1,) and grown.config.vision.fullatt_block_indexes == (1, 3)
    rng = np.random.default_rng(0)
    batch = Encoder().encode([draw_sample(rng, REFINE[0][1], MAX_POSITIONS) for _ in range(3)])
    with torch.no_grad():
        before, after = forward_logits(start, batch), forward_logits(grown, batch)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)
    fresh = [i for i, layer in enumerate(grown.language.layers) if not layer.mlp.down_proj.weight.any()]
    assert len(fresh) == 3 and fresh != [2, 3, 4]  # spread through the stack, not stacked on top
    for i in fresh:  # a copy of the layer below, residual branches zeroed
        below, layer = grown.language.layers[i - 1], grown.language.layers[i]
        assert torch.equal(layer.self_attn.q_proj.weight, below.self_attn.q_proj.weight)
        assert not layer.self_attn.o_proj.weight.any()
    blocks = grown.visual.blocks
    for i, source in ((2, 0), (3, 1), (4, 0)):  # appended, each a copy of the last old block of its kind
        assert torch.equal(blocks[i].attn.qkv.weight, start.visual.blocks[source].attn.qkv.weight)
        assert not blocks[i].attn.proj.weight.any() and not blocks[i].mlp.down_proj.bias.any()
    with pytest.raises(ValueError, match="at least 0"):
        grow_layers(start, -1)

    path = save_checkpoint(start, tmp_path / "start", {"note": "test"})
    out = tmp_path / "grown"
    assert main(["train-toy", str(out), "--init", str(path), "--grow-layers", "2", "--grow-vision", "1", "--steps", "2",
                 "--batch-size", "2",
                 "--log-every", "2", "--heldout-streams", "0", "--eval-samples", "2", "--vision-steps", "0",
                 "--threads", "1", "--curriculum", "refine", "--lr", "0.01"]) == 0
    card = __import__("json").loads((out / "card.json").read_text())
    assert card["layers"] == 4 and card["grown_layers"] == 2 and "--grow-layers 2" in card["command"]
    assert card["vision_depth"] == 3 and card["grown_vision_blocks"] == 1 and "--grow-vision 1" in card["command"]
    trained = load_pretrained(out, dtype=torch.float32)
    assert (trained.config.text.num_hidden_layers, trained.config.vision.depth) == (4, 3)
    assert all(layer.mlp.down_proj.weight.any() for layer in trained.language.layers)  # the zeroed ones trained
    assert trained.visual.blocks[2].attn.proj.weight.any()
    capsys.readouterr()
    assert main(["train-toy", str(tmp_path / "x"), "--grow-layers", "2"]) == 2
    assert "--init" in capsys.readouterr().out


def test_grow_width_answers_as_before_and_the_new_dimensions_train(tmp_path, capsys):
    """``--grow-width W`` widens an ``--init`` toy's LM (hidden size, head_dim, MLP and M-RoPE sections as
    ``toy_config`` makes them): the wider model's logits equal the original's (rotary pair j -> pair m j at the same
    frequency, the query's old dimensions scaled by sqrt(m), everything new written through zeros), its config is a
    toy's of the new width, training moves what started at zero, and a width that is no multiple, or whose M-RoPE
    sections do not map, is refused with why."""
    from edgekv.apps.cli import main
    from edgekv.model.loading import load_pretrained
    from edgekv.toy.model import grow_width

    start = init_model(toy_config(width=32, layers=2, vision_width=32, vision_depth=2), 5)
    with torch.no_grad():  # trained-looking weights: non-zero everywhere, so a misplaced row or column shows
        for param in start.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    wide = grow_width(start, 96, seed=1)
    assert wide.config == toy_config(width=96, layers=2, vision_width=32, vision_depth=2)
    rng = np.random.default_rng(0)
    batch = Encoder().encode([draw_sample(rng, REFINE[0][1], MAX_POSITIONS) for _ in range(3)])
    for module in [*start.modules(), *wide.modules()]:  # RMSNorm's eps averages over 3x the dims: out of the way
        if hasattr(module, "eps"):
            module.eps = 0.0
    with torch.no_grad():
        before, after = forward_logits(start, batch), forward_logits(wide, batch)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    layer = wide.language.layers[0]
    assert not layer.mlp.down_proj.weight[32:].any() and not layer.self_attn.o_proj.weight[32:].any()
    assert not wide.language.embed_tokens.weight[:, 32:].any() and layer.mlp.gate_proj.weight[:, 32:].any()
    head = layer.self_attn.q_proj.weight[:24]  # head 0: old dims 0-3 / 4-7 at 0, 3, 6, 9 / 12, 15, 18, 21
    torch.testing.assert_close(head[[0, 3, 6, 9, 12, 15, 18, 21], :32],
                               start.language.layers[0].self_attn.q_proj.weight[:8] * 3 ** 0.5)
    assert not head[[1, 2, 4, 5, 7, 8, 10, 11]].any()
    with pytest.raises(ValueError, match="multiple"):
        grow_width(start, 80)
    with pytest.raises(ValueError, match="do not map"):  # (2, 1, 1) of width 32 -> (2, 3, 3) of width 64
        grow_width(start, 64)

    path = save_checkpoint(start, tmp_path / "start", {"note": "test"})
    out = tmp_path / "wide"
    assert main(["train-toy", str(out), "--init", str(path), "--grow-width", "96", "--steps", "2", "--batch-size", "2",
                 "--log-every", "2", "--heldout-streams", "0", "--eval-samples", "2", "--vision-steps", "0",
                 "--threads", "1", "--curriculum", "refine", "--lr", "0.01"]) == 0
    card = __import__("json").loads((out / "card.json").read_text())
    assert card["width"] == 96 and card["grown_width"] == 96 and "--grow-width 96" in card["command"]
    trained = load_pretrained(out, dtype=torch.float32)
    assert trained.config.text.hidden_size == 96
    assert all(layer.mlp.down_proj.weight[32:].any() for layer in trained.language.layers)  # the zeroed rows trained
    capsys.readouterr()
    assert main(["train-toy", str(tmp_path / "x"), "--grow-width", "96"]) == 2
    assert "--init" in capsys.readouterr().out
    assert main(["train-toy", str(tmp_path / "y"), "--init", str(path), "--grow-width", "64", "--steps", "1",
                 "--vision-steps", "0", "--heldout-streams", "0"]) == 2
    assert "do not map" in capsys.readouterr().out


def test_world_lures_makes_half_its_world_streams_busy_with_lures(monkeypatch):
    """``--curriculum world-lures``: world-mild-where's stages with half of the world samples (mild or not) busy with
    lures — out-of-vocabulary shapes passing at 0.1-1 per pair, half to all of them in vocabulary colours; the
    questions and everything else as world-mild-where, whose samples draw no lures."""
    from dataclasses import replace

    import edgekv.video.world as world

    from edgekv.toy.data import WORLD_LURES, WORLD_MILD_WHERE

    for (share_w, w), (share_l, lured) in zip(WORLD_MILD_WHERE, WORLD_LURES, strict=True):
        assert share_w == share_l and replace(lured, name=w.name, lures=0.0) == w and lured.lures == 0.5
    from edgekv.toy.data import WORLD_LURES_DENSE

    for (share_l, lured), (share_d, dense) in zip(WORLD_LURES, WORLD_LURES_DENSE, strict=True):
        assert share_l == share_d and (dense.lures, dense.backgrounds) == (0.75, 24)
        assert replace(dense, name=lured.name, lures=0.5, backgrounds=lured.backgrounds) == lured
    seen: list = []
    real = world.WorldScene
    monkeypatch.setattr(world, "WorldScene", lambda *a, **k: seen.append(a[6]) or real(*a, **k))
    families = ("noise", "gradient")
    for stage in (WORLD_LURES[1][1], WORLD_MILD_WHERE[1][1]):
        seen.clear()
        rng = np.random.default_rng(8)
        for _ in range(30):
            draw_sample(rng, replace(stage, pairs=(6, 10), world=1.0), MAX_POSITIONS, families=families)
        busy = [s for s in seen if s.lures]
        if stage.lures:
            assert 8 <= len(busy) <= 22 and len(seen) == 30  # half, give or take
            assert all(0.1 <= s.transients <= 1.0 and 0.5 <= s.lures <= 1.0 for s in busy)
        else:
            assert not busy


def _world_styles_drawn(monkeypatch, stage, samples: int = 30) -> list:
    """The ``WorldStyle`` of each of ``samples`` samples ``draw_sample`` draws from ``stage`` (all of them world)."""
    from dataclasses import replace

    import edgekv.video.world as world

    seen: list = []
    real = world.WorldScene
    monkeypatch.setattr(world, "WorldScene", lambda *a, **k: seen.append(a[6]) or real(*a, **k))
    rng = np.random.default_rng(9)
    for _ in range(samples):
        draw_sample(rng, replace(stage, pairs=(6, 10), world=1.0), MAX_POSITIONS, families=("noise", "checks"))
    monkeypatch.setattr(world, "WorldScene", real)
    assert len(seen) == samples
    return seen


def test_world_mild_tone_regrades_half_its_world_backgrounds(monkeypatch):
    """``--curriculum world-mild-tone``: world-mild-apart's stages with half of the world samples (mild or not) on a
    background re-graded at a tone of 0.3-1; world-mild-apart's samples draw none."""
    from dataclasses import replace

    from edgekv.toy.data import WORLD_MILD_APART, WORLD_MILD_TONE

    for (share_a, apart), (share_t, toned) in zip(WORLD_MILD_APART, WORLD_MILD_TONE, strict=True):
        assert share_a == share_t and replace(toned, name=apart.name, tone=0.0) == apart and toned.tone == 0.5
    graded = [s for s in _world_styles_drawn(monkeypatch, WORLD_MILD_TONE[1][1]) if s.tone]
    assert 8 <= len(graded) <= 22 and all(0.3 <= s.tone <= 1.0 for s in graded)
    assert not any(s.tone for s in _world_styles_drawn(monkeypatch, WORLD_MILD_APART[1][1]))


def test_exposed_curricula_over_expose_half_their_world_backgrounds(monkeypatch):
    """``--curriculum world-mild-exposed`` / ``world-mild-224-exposed``: world-mild-apart's and
    world-mild-224-dilute-distinct's stages with half of the world samples (mild or not) on a background
    over-exposed at 0.5-2; the stages they come from draw none."""
    from dataclasses import replace

    from edgekv.toy.data import (EXPOSURE_RANGE, WORLD_MILD_224_DILUTE_DISTINCT, WORLD_MILD_224_EXPOSED,
                                 WORLD_MILD_APART, WORLD_MILD_EXPOSED)

    for base, exposed in ((WORLD_MILD_APART, WORLD_MILD_EXPOSED),
                          (WORLD_MILD_224_DILUTE_DISTINCT, WORLD_MILD_224_EXPOSED)):
        for (share_b, stage_b), (share_e, stage_e) in zip(base, exposed, strict=True):
            assert share_b == share_e and stage_e.exposure == 0.5
            assert replace(stage_e, name=stage_b.name, exposure=0.0) == stage_b
    exposed = [s for s in _world_styles_drawn(monkeypatch, WORLD_MILD_EXPOSED[1][1]) if s.exposure]
    assert 8 <= len(exposed) <= 22
    assert all(EXPOSURE_RANGE[0] <= s.exposure <= EXPOSURE_RANGE[1] for s in exposed)
    assert not any(s.exposure for s in _world_styles_drawn(monkeypatch, WORLD_MILD_APART[1][1]))


def test_world_mild_224_long_lengthens_the_long_stage_contexts_at_one_stream_a_batch():
    from dataclasses import replace

    from edgekv.toy.data import WORLD_MILD_224, WORLD_MILD_224_LONG

    (share_s, short), (share_l, long) = WORLD_MILD_224[1], WORLD_MILD_224_LONG[1]
    assert share_s == share_l and long.pairs == (24, 96) and 8 // long.batch_divisor == 1
    assert replace(long, name=short.name, pairs=short.pairs, batch_divisor=short.batch_divisor) == short
    assert WORLD_MILD_224_LONG[0] == WORLD_MILD_224[0]
    rng = np.random.default_rng(3)
    sample = draw_sample(rng, replace(long, pairs=(90, 96)), MAX_POSITIONS, size=224, families=("noise",))
    assert 90 <= len(sample.slot_pair) <= 96 and sample.evict_at.shape[1] == 64  # 64 tokens a pair at 224


def test_world_mild_draws_half_its_world_streams_as_the_cards_streams_on_world_backgrounds(monkeypatch):
    """``--curriculum world-mild``: about half of its world samples take the classic renderer's camera (noise,
    drift, lighting only: no JPEG, clutter, occlusion or colour jitter) and its events (one or two pairs) on a
    trained world family's background — what ``eval toy --families F`` asks about; the other half the full
    randomization. A curriculum without a mild share never draws one."""
    from dataclasses import replace

    import edgekv.video.world as world

    from edgekv.toy.data import WORLD_MILD, WORLD_WHERE_LONG

    seen: list = []
    real = world.WorldScene

    def recording(*args, **kwargs):
        seen.append((args[5], args[6]))  # family, style
        return real(*args, **kwargs)

    monkeypatch.setattr(world, "WorldScene", recording)
    families = ("noise", "photo") if "photo" in world.drawable_families(None, ()) else ("noise", "gradient")

    def draw(stage, seed):
        seen.clear()
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(24):
            sample = draw_sample(rng, replace(stage, pairs=(6, 10), world=1.0), MAX_POSITIONS, families=families)
            out.append((sample, *seen[-1]))
        return out

    drawn = draw(WORLD_MILD[1][1], 3)
    mild = [(s, style) for s, family, style in drawn if style.color_jitter == 0]
    assert all(family in families for _, family, _ in drawn)
    assert 6 <= len(mild) <= 18  # half, give or take
    for sample, style in mild:
        assert (style.jpeg, style.distractors, style.transients, style.occlusion, style.shake) == (0, 0, 0, 0, 0)
        assert all(e.pairs <= 2 for e in sample.events)
    assert not [style for _, _, style in draw(WORLD_WHERE_LONG[1][1], 3) if style.color_jitter == 0]
    assert CURRICULA["world-mild"] == WORLD_MILD and all(stage.mild == 0.5 for _, stage in WORLD_MILD)


def _tripled_background(sample: Sample, times: int) -> Sample:
    """``sample`` (nothing thinned or evicted) with each background pair laid out ``times`` times at its position."""
    from dataclasses import replace as dc_replace

    rows = [slot for slot in range(sample.slots) for _ in range(times if sample.background_slots()[slot] else 1)]
    slots = len(rows)
    return dc_replace(sample, slot_pair=[sample.slot_pair[r] for r in rows], tpos=[sample.tpos[r] for r in rows],
                      evict_at=np.full((slots, sample.evict_at.shape[1]), slots + 1), sink=None,
                      carried=sample.carried[rows], cover=sample.cover[rows], present=None,
                      shows_shape=None if sample.shows_shape is None else sample.shows_shape[rows], multiplicity=1.0)


def test_a_diluted_sample_attends_as_if_its_background_pairs_were_there_that_many_times():
    from dataclasses import replace as dc_replace

    stage = dc_replace(CURRICULUM[1][1], thin=0.0, sinks=0.0, events=(2, 3), dilute=1.0)
    samples = [draw_sample(np.random.default_rng(s), stage, MAX_POSITIONS, pairs=(6, 8)) for s in range(3)]
    for sample in samples:
        sample.present = None
        sample.multiplicity = 3.0
        assert 0 < sample.background_slots().sum() < sample.slots  # events and background pairs both
    encoder = Encoder()
    diluted = encoder.encode(samples)
    assert diluted.key_bias is not None and torch.isclose(diluted.key_bias.max(), torch.tensor(np.log(3.0)).float())
    copies = encoder.encode([_tripled_background(s, 3) for s in samples])
    assert copies.key_bias is None and copies.ids.shape[1] > diluted.ids.shape[1]
    # one layer: the questions read keys and values made from the embeddings alone, so the copies' own rows
    # (which see each other) cannot differ from the diluted keys' — the logits must agree exactly
    model = init_model(toy_config(width=32, layers=1, vision_width=32, vision_depth=2), 0).eval()
    with torch.no_grad():
        torch.testing.assert_close(forward_logits(model, diluted), forward_logits(model, copies), rtol=1e-4, atol=1e-5)
        plain = dc_replace(diluted, key_bias=None, slot=None)
        assert not torch.allclose(forward_logits(model, plain), forward_logits(model, copies), atol=1e-3)
    # draws of a curriculum without dilution are what they were
    assert all(s.multiplicity == 1.0 for s in (draw_sample(np.random.default_rng(s), CURRICULUM[1][1], MAX_POSITIONS)
                                                for s in range(20)))
    drawn = [draw_sample(np.random.default_rng(s), CURRICULA["world-mild-224-dilute"][1][1], MAX_POSITIONS, size=224,
                         pairs=(4, 6)).multiplicity for s in range(12)]
    assert any(m == 1.0 for m in drawn) and any(m > 1.0 for m in drawn) and max(drawn) <= 64.0


def test_the_224_dilute_and_distinct_curricula_change_only_what_they_say():
    """``world-mild-224-dilute`` / ``-distinct`` / ``-dilute-distinct``: world-mild-224's stages with three quarters
    of the samples diluted, with every background pair rendered anew, or both (``-dilute-far``: both, diluted up to
    256 times instead of 64); ``world-lures-dilute`` the lured curriculum with both, ``world-mild-exposed-dilute``
    the exposed one (``world-lures-exposed-dilute``: with half the world samples lured too; ``world-lures-where-dilute``:
    that with `where` asked six times; ``-x256`` / ``-x1024``: diluted up to 256 / 1,024 times); and ``train-toy``
    offers every curriculum there is."""
    import argparse
    from dataclasses import replace

    from edgekv.toy.cli import add_train_arguments

    for base_name, name, changes in (("world-mild-224", "world-mild-224-dilute", {"dilute": 0.75}),
                                     ("world-mild-224", "world-mild-224-distinct", {"backgrounds": 64}),
                                     ("world-mild-224", "world-mild-224-dilute-distinct",
                                      {"dilute": 0.75, "backgrounds": 64}),
                                     ("world-mild-224", "world-mild-224-dilute-far",
                                      {"dilute": 0.75, "backgrounds": 64, "dilute_max": 256.0}),
                                     ("world-lures-dense", "world-lures-dilute", {"dilute": 0.75, "backgrounds": 64}),
                                     ("world-mild-exposed", "world-mild-exposed-dilute",
                                      {"dilute": 0.75, "backgrounds": 64}),
                                     ("world-mild-exposed", "world-lures-exposed-dilute",
                                      {"dilute": 0.75, "backgrounds": 64, "lures": 0.5}),
                                     ("world-lures-exposed-dilute", "world-lures-exposed-dilute-x256",
                                      {"dilute_max": 256.0}),
                                     ("world-lures-exposed-dilute", "world-lures-exposed-dilute-x1024",
                                      {"dilute_max": 1024.0}),
                                     ("world-mild-224-exposed", "world-lures-224", {"lures": 0.5}),
                                     ("world-lures-where-dilute", "world-lures-free-dilute",
                                      {"lures": 0.75, "lure_free": 0.5})):
        base, variant = CURRICULA[base_name], CURRICULA[name]
        assert [share for share, _ in variant] == [share for share, _ in base]
        for (_, a), (_, b) in zip(base, variant):
            assert all(getattr(b, k) == v != getattr(a, k) for k, v in changes.items())
            assert replace(b, name=a.name, **{k: getattr(a, k) for k in changes}) == a
    stage = CURRICULA["world-mild-224-distinct"][1][1]
    sample = draw_sample(np.random.default_rng(4), replace(stage, world=1.0), MAX_POSITIONS, size=224, pairs=(20, 24),
                         families=("noise", "checks"))
    assert len(sample.pairs) == sample.slots >= 20  # one rendering per slot, background ones too
    for (_, lured), (_, where) in zip(CURRICULA["world-lures-exposed-dilute"], CURRICULA["world-lures-where-dilute"]):
        assert where.families == (*lured.families, "where", "where", "where")
        assert replace(where, name=lured.name, families=lured.families) == lured
    far = CURRICULA["world-lures-exposed-dilute-x1024"][1][1]
    drawn = [draw_sample(np.random.default_rng(s), replace(far, dilute=1.0), MAX_POSITIONS, pairs=(4, 6)).multiplicity
             for s in range(40)]
    assert max(drawn) > 64.0 and max(drawn) <= 1024.0 and min(drawn) >= 1.0  # beyond what the 64x rounds drew
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    for name in CURRICULA:
        assert parser.parse_args(["out", "--curriculum", name]).curriculum == name


def test_free_lures_wear_only_the_colours_no_event_of_the_sample_wears(monkeypatch):
    """``Stage.lure_free``: a lured world sample drawn with it renders its lures only in the colours none of its
    events wears (as ``eval needle --lure-colors free``); without it the lures take every colour, events' too, and the
    stage's draws are those of before (the same events and frames)."""
    from dataclasses import replace

    from edgekv.video import world

    worn_lures: list[str] = []
    original = world.WorldScene._lure

    def recording(self, block, items):
        out = original(self, block, items)
        worn_lures.extend(item.color for item in out if item.color in COLORS)
        return out

    monkeypatch.setattr(world.WorldScene, "_lure", recording)
    stage = replace(CURRICULA["world-lures-free-dilute"][1][1], world=1.0, mild=0.0, lures=1.0, dilute=0.0)
    shared = 0
    for seed in range(6):
        for free in (1.0, 0.0):
            worn_lures.clear()
            sample = draw_sample(np.random.default_rng(seed), replace(stage, lure_free=free), MAX_POSITIONS,
                                 pairs=(24, 32), families=("noise", "checks"))
            colours = {event.color for event in sample.events}
            assert worn_lures, "a lured sample shows lures"
            if free:
                assert not colours & set(worn_lures), (colours, worn_lures)
            else:
                shared += bool(colours & set(worn_lures))
    assert shared  # without lure_free the lures also wear the events' colours
    plain = replace(stage, lure_free=0.0)
    a = draw_sample(np.random.default_rng(9), plain, MAX_POSITIONS, pairs=(8, 12), families=("noise",))
    b = draw_sample(np.random.default_rng(9), replace(CURRICULA["world-lures-where-dilute"][1][1], world=1.0,
                                                      mild=0.0, lures=1.0, dilute=0.0),
                    MAX_POSITIONS, pairs=(8, 12), families=("noise",))
    assert [e.describe() for e in a.events] == [e.describe() for e in b.events]
    assert all(np.array_equal(x[0], y[0]) for x, y in zip(a.pairs, b.pairs))


def test_lure_attention_tool_splits_the_question_attention_by_what_each_token_shows(tmp_path):
    """``tools/toy_lure_attention.py`` (docs/measurements.md, "Every lure costs alike"): on a lured needle stream it
    asks the last checkpoint's questions of the full cache and reports, per LM layer, the last query token's attention
    mass on the needles' tokens, the lures', the other video tokens, the prompt and the question's own tokens (the whole
    of it), split by right and wrong answers; the hook it puts on the cache's attention is gone afterwards, and the
    shipped toy looks at a needle's token more than at a background token."""
    import importlib.util
    import json
    from pathlib import Path

    import pytest

    import edgekv.attention as attention
    from edgekv.eval.needle import DEFAULT_AGES, needle_stream

    tool = Path(__file__).parents[1] / "tools" / "toy_lure_attention.py"
    spec = importlib.util.spec_from_file_location("toy_lure_attention", tool)
    lure_attention = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lure_attention)
    original = attention.CacheAttention.__call__
    out = tmp_path / "attention.json"
    assert lure_attention.main(["--length", "40", "--seeds", "49", "--streams", "1", "--families", "noise",
                                "--busy", "0.5", "--out", str(out)]) == 0
    assert attention.CacheAttention.__call__ is original
    result = json.loads(out.read_text())
    stream = needle_stream(40, DEFAULT_AGES, 49000, 3, 2.0, family="noise", style="world", busy=0.5, lures=1.0,
                           lure_colors="free")
    asked = [p for p in stream.probes if p.checkpoint == 40]
    assert result["answered"]["right"] + result["answered"]["wrong"] == len(asked) > 0
    assert sorted(result["layers"]) == ["0", "1", "2", "3"]  # the toy's four LM layers
    needle_pairs = sum(e.last_pair - e.first_pair + 1 for e in stream.scene.events)
    for entry in result["layers"].values():
        for group in entry.values():
            assert sum(v["mass"] for v in group.values()) == pytest.approx(1.0, abs=1e-3)  # every key, question too
            assert group["needle"]["tokens"] == needle_pairs and group["lure"]["tokens"] > 0
    right = result["layers"]["1"]["right"]
    assert right["needle"]["per_token"] > 10 * right["video"]["per_token"]
    # --keep-off-lures: in those layers the questions give the lures' tokens nothing; the same questions asked
    kept = tmp_path / "kept.json"
    assert lure_attention.main(["--length", "40", "--seeds", "49", "--streams", "1", "--families", "noise",
                                "--busy", "0.5", "--keep-off-lures", "1,2", "--out", str(kept)]) == 0
    assert attention.CacheAttention.__call__ is original
    off = json.loads(kept.read_text())
    assert result["readout_deviation"] < 1e-2 and off["readout_deviation"] < 1e-2  # recorded = what the layers read
    assert off["keep_off_lures"] == [1, 2] and off["answered"] == {"right": off["answered"]["right"],
                                                                   "wrong": len(asked) - off["answered"]["right"]}
    for layer, entry in off["layers"].items():
        for verdict, group in entry.items():
            if layer in ("1", "2"):
                assert group["lure"]["mass"] == 0.0 and group["lure"]["tokens"] > 0
            else:
                assert group["lure"]["mass"] > 0.0
    # --by-pair: each rotary pair's part of the needle - lure score margin; the parts sum to the whole margin, and in
    # the shipped toy (head_dim 16, M-RoPE sections 2/3/3, base 1e6) only the slow w pairs carry it in layers 1-3
    pairs = tmp_path / "pairs.json"
    assert lure_attention.main(["--length", "40", "--seeds", "49", "--streams", "1", "--families", "noise",
                                "--busy", "0.5", "--by-pair", "--out", str(pairs)]) == 0
    assert attention.CacheAttention.__call__ is original
    by_pair = json.loads(pairs.read_text())["pair_margins"]
    assert by_pair["span_positions"] == 80 and by_pair["trained_positions"] == 8192 and by_pair["rope_theta"] == 1e6
    for layer, rows in by_pair["layers"].items():
        assert [r["row"] for r in rows] == list("tthhhwww")
        for r in rows:
            assert r["inv_freq"] == pytest.approx(1e6 ** (-r["pair"] / 8))
            assert r["turn"] == pytest.approx(80 * r["inv_freq"], abs=1e-3)
            assert r["turn_trained"] == pytest.approx(8192 * r["inv_freq"], abs=1e-3)
        assert sum(r["margin"] for r in rows) == pytest.approx(by_pair["score_margin"][layer], abs=2e-3)
        if layer != "0":
            slow = sum(r["margin"] for r in rows if r["row"] == "w")
            assert slow > 1.0 and slow > 5 * abs(sum(r["margin"] for r in rows if r["row"] != "w")), (layer, rows)
    with pytest.raises(SystemExit):
        lure_attention.main(["--busy", "0"])
    with pytest.raises(SystemExit):
        lure_attention.main(["--keep-off-lures", "1,a"])
    with pytest.raises(SystemExit):
        lure_attention.main(["--keep-off-lures", "1", "--by-pair"])


def test_attention_loss_asks_each_answer_to_look_at_the_events_it_is_about(tmp_path, capsys):
    """``Encoder(aux=True)`` marks, for every question about events, its answer word and the keys its query sees that
    hold those events' tokens; ``forward_logits(..., attention_loss=[])`` appends -log(the share of layer 1's
    attention, head-averaged, on them): 0 when every key the query sees is marked, more when only the events' are,
    with gradients into the LM; not with ``recompute``; ``train(attend_weight=...)`` logs it and records it."""
    from dataclasses import replace as replace_batch

    from edgekv.toy.train import ATTEND_LAYER, qa_batches, train

    batch = next(qa_batches(np.random.default_rng(3), 1, 3, True, 5, curriculum="refine"))
    assert batch.attend_rows is not None and len(batch.attend_rows) == batch.attend_keys.shape[0] > 0
    assert batch.is_answer[batch.attend_rows].all()
    assert all(batch.families[int(r)] != "aux" for r in batch.attend_rows)
    b_of = batch.target_index[batch.attend_rows, 0]
    video = torch.zeros_like(batch.ids, dtype=torch.bool)
    video[batch.video_index[:, 0], batch.video_index[:, 1]] = True
    for a in range(len(batch.attend_rows)):
        keys = batch.attend_keys[a].nonzero().flatten()
        assert len(keys) > 0 and video[b_of[a], keys].all()  # only video tokens, at least one
        query = batch.target_index[batch.attend_rows[a], 1]
        assert batch.mask[b_of[a], query, keys].all()  # all of them visible to the answer's query
    plain = next(qa_batches(np.random.default_rng(3), 1, 3, False, 5, curriculum="refine"))
    assert plain.attend_rows is None  # only auxiliary (training) batches carry them

    model = init_model(toy_config(), 0)
    losses: list = []
    logits = forward_logits(model, batch, attention_loss=losses)
    assert torch.equal(logits, forward_logits(model, batch)) and len(losses) == 1
    assert torch.isfinite(losses[0]) and losses[0].item() > 0.01
    losses[0].backward()
    layer = model.language.layers[ATTEND_LAYER]
    grads = [p.grad for name, p in layer.named_parameters() if "q_proj" in name or "k_proj" in name]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    seen = batch.mask[batch.target_index[batch.attend_rows, 0], batch.target_index[batch.attend_rows, 1]]
    everything: list = []
    forward_logits(model, replace_batch(batch, attend_keys=seen), attention_loss=everything)
    assert abs(everything[0].item()) < 1e-4  # all the mass is on what the query sees
    with pytest.raises(ValueError, match="recompute"):
        forward_logits(model, batch, recompute=True, attention_loss=[])
    with pytest.raises(ValueError, match="attend_weight"):
        train(tmp_path / "unused", steps=1, attend_weight=-1.0)
    assert not (tmp_path / "unused").exists()

    from edgekv.apps.cli import main

    out = tmp_path / "steered"
    base = ["train-toy", "--steps", "2", "--batch-size", "2", "--heldout-streams", "0", "--eval-samples", "2",
            "--vision-steps", "1", "--threads", "1", "--width", "32", "--no-prefetch", "--log-every", "1",
            "--curriculum", "refine", "--attend-weight", "0.5"]
    assert main([*base[:1], str(out), *base[1:], "--layers", "2"]) == 0
    card = __import__("json").loads((out / "card.json").read_text())
    assert card["attend_weight"] == 0.5 and card["command"].endswith("--attend-weight 0.5")
    assert all(record["attend_loss"] > 0 for record in card["history"]) and len(card["history"]) == 2
    capsys.readouterr()
    for flags in (["--layers", "1"], ["--layers", "2", "--recompute"]):
        assert main([*base[:1], str(tmp_path / "no"), *base[1:], *flags]) == 2
        assert "--attend-weight must be >= 0" in capsys.readouterr().out
    assert not (tmp_path / "no").exists()


def test_avoid_loss_asks_every_question_to_look_away_from_the_lures(tmp_path, capsys):
    """A lured world sample marks the tokens that show a lure and no event (``Sample.lured``); ``Encoder(aux=True)``
    marks, for every question of such a sample, its answer word and the lure tokens its query sees;
    ``forward_logits(..., avoid_loss=[])`` appends per steered layer -log(1 - each head's share on them): 0 when
    nothing is marked, more when the lures are, with gradients into those layers' q/k; ``train(avoid_weight=...)``
    logs and records it; the CLI refuses a negative weight, layers without a weight and layers the model lacks."""
    from dataclasses import replace

    from edgekv.toy.train import AVOID_LAYERS, qa_batches, train

    stage = replace(CURRICULA["world-lures-free-dilute"][1][1], world=1.0, mild=0.0, lures=1.0, dilute=0.0)
    for seed in range(3):
        sample = draw_sample(np.random.default_rng(seed), stage, MAX_POSITIONS, pairs=(24, 32),
                             families=("noise", "checks"), mark_lures=True)
        assert sample.lured is not None and sample.lured.shape == sample.carried.shape
        unmarked = draw_sample(np.random.default_rng(seed), stage, MAX_POSITIONS, pairs=(24, 32),
                               families=("noise", "checks"))  # the same sample, its lures left unmarked
        assert unmarked.lured is None and np.array_equal(unmarked.carried, sample.carried)
        assert unmarked.qas == sample.qas
        assert not (sample.lured & (sample.carried >= 0)).any()  # an event's token is the event's, not a lure's
    plain = draw_sample(np.random.default_rng(0), replace(stage, lures=0.0), MAX_POSITIONS, pairs=(24, 32),
                        families=("noise", "checks"), mark_lures=True)
    assert plain.lured is None

    batch = next(qa_batches(np.random.default_rng(4), 1, 4, True, 5, curriculum="world-lures-free-dilute",
                            families=("noise", "checks"), mark_lures=True))
    assert batch.avoid_rows is not None and len(batch.avoid_rows) == batch.avoid_keys.shape[0] > 0
    assert batch.is_answer[batch.avoid_rows].all()
    video = torch.zeros_like(batch.ids, dtype=torch.bool)
    video[batch.video_index[:, 0], batch.video_index[:, 1]] = True
    b_of = batch.target_index[batch.avoid_rows, 0]
    for a in range(len(batch.avoid_rows)):
        keys = batch.avoid_keys[a].nonzero().flatten()
        assert len(keys) > 0 and video[b_of[a], keys].all()
        assert batch.mask[b_of[a], batch.target_index[batch.avoid_rows[a], 1], keys].all()
        if batch.attend_rows is not None and (batch.attend_rows == batch.avoid_rows[a]).any():
            asked = batch.attend_keys[(batch.attend_rows == batch.avoid_rows[a]).nonzero()[0, 0]]
            assert not (asked & batch.avoid_keys[a]).any()  # never a token of the events asked about
    assert next(qa_batches(np.random.default_rng(4), 1, 4, False, 5, curriculum="world-lures-free-dilute",
                           families=("noise", "checks"), mark_lures=True)).avoid_rows is None  # training batches only
    unmarked = next(qa_batches(np.random.default_rng(4), 1, 4, True, 5, curriculum="world-lures-free-dilute",
                               families=("noise", "checks")))  # lures left unmarked: the same batch, nothing to avoid
    assert unmarked.avoid_rows is None and torch.equal(unmarked.ids, batch.ids)
    assert torch.equal(unmarked.pixel_values, batch.pixel_values)

    model = init_model(toy_config(), 0)
    losses: list = []
    logits = forward_logits(model, batch, avoid_loss=losses)
    assert torch.equal(logits, forward_logits(model, batch)) and len(losses) == len(AVOID_LAYERS)
    assert all(torch.isfinite(x) and x.item() > 0.01 for x in losses)
    torch.stack(losses).mean().backward()
    for index in AVOID_LAYERS:
        grads = [p.grad for name, p in model.language.layers[index].named_parameters()
                 if "q_proj" in name or "k_proj" in name]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    nothing: list = []
    forward_logits(model, replace(batch, avoid_keys=torch.zeros_like(batch.avoid_keys)), avoid_loss=nothing,
                   avoid_layers=(2,))
    assert len(nothing) == 1 and nothing[0].item() == 0.0
    # among the video tokens only: the lures' share of a head's attention on the frames, never less than of all of it
    among: list = []
    forward_logits(model, batch, avoid_loss=among, avoid_among="video")
    assert len(among) == len(AVOID_LAYERS)
    assert all(torch.isfinite(v) and v.item() > a.item() for v, a in zip(among, losses))
    # against the needles: per question about events, log(1 + the lures' mass / its events' tokens' mass), read
    # here from the answers' own attentions (``looks``) in layer 1
    assert batch.attend_rows is not None and torch.isin(batch.avoid_rows, batch.attend_rows).any()
    ratio: list = []
    looked: dict = {}
    forward_logits(model, batch, avoid_loss=ratio, avoid_layers=(1,), avoid_among="needles", looks=looked,
                   look_layers=(1,))
    answers = batch.is_answer.nonzero().flatten().tolist()
    expected = []
    for a, row in enumerate(batch.avoid_rows.tolist()):
        if row not in batch.attend_rows.tolist():
            continue
        logp = looked[1][answers.index(row)]  # [Hq, S]
        needles = batch.attend_keys[batch.attend_rows.tolist().index(row)]
        lures, asked = logp[:, batch.avoid_keys[a]].logsumexp(-1), logp[:, needles].logsumexp(-1)
        expected.append(torch.log1p(torch.exp(lures - asked)))
    assert len(ratio) == 1 and torch.allclose(ratio[0], torch.stack(expected).mean(), rtol=1e-4, atol=1e-6)
    assert ratio[0].item() > 0.01
    ratio[0].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for name, p in model.language.layers[1].named_parameters() if "k_proj" in name)
    none_asked: list = []  # no question about an event: nothing to weigh the lures against, no term
    forward_logits(model, replace(batch, attend_rows=None, attend_keys=None), avoid_loss=none_asked,
                   avoid_among="needles")
    assert none_asked == []
    with pytest.raises(ValueError, match="avoid_among is one of all, video, needles"):
        forward_logits(model, batch, avoid_loss=[], avoid_among="text")
    with pytest.raises(ValueError, match="recompute"):
        forward_logits(model, batch, recompute=True, avoid_loss=[])
    with pytest.raises(ValueError, match="avoid_weight"):
        train(tmp_path / "unused", steps=1, avoid_weight=-1.0)

    from edgekv.apps.cli import main

    out = tmp_path / "avoiding"
    base = ["train-toy", "--steps", "2", "--batch-size", "2", "--heldout-streams", "0", "--eval-samples", "2",
            "--vision-steps", "1", "--threads", "1", "--width", "32", "--no-prefetch", "--log-every", "1",
            "--curriculum", "world-lures-free-dilute", "--families", "noise,checks", "--holdout", "none",
            "--layers", "2", "--avoid-weight", "0.5"]
    assert main([*base[:1], str(out), *base[1:], "--avoid-layers", "0,1"]) == 0
    card = __import__("json").loads((out / "card.json").read_text())
    assert card["avoid_weight"] == 0.5 and card["avoid_layers"] == [0, 1]
    assert card["command"].endswith("--avoid-weight 0.5 --avoid-layers 0,1")
    # > 0: the round's draws marked the lures (``mark_lures``), and its batches asked to look away from them
    assert all(record["avoid_loss"] > 0 for record in card["history"]) and len(card["history"]) == 2
    assert card["avoid_among"] == "all"
    among = tmp_path / "among"
    assert main([*base[:1], str(among), *base[1:], "--avoid-layers", "1", "--avoid-among", "video"]) == 0
    card = __import__("json").loads((among / "card.json").read_text())
    assert card["avoid_among"] == "video"
    assert card["command"].endswith("--avoid-weight 0.5 --avoid-layers 1 --avoid-among video")
    ratio = tmp_path / "ratio"
    assert main([*base[:1], str(ratio), *base[1:], "--avoid-layers", "1", "--avoid-among", "needles"]) == 0
    card = __import__("json").loads((ratio / "card.json").read_text())
    assert card["avoid_among"] == "needles" and card["command"].endswith("--avoid-layers 1 --avoid-among needles")
    from edgekv.toy.train import AVOID_AMONG
    assert AVOID_AMONG == ("all", "video", "needles")  # the CLI's choices, written out there to keep torch off its import
    capsys.readouterr()
    for flags, said in ((["--avoid-layers", "1,x"], "comma-separated"), (["--avoid-layers", "2"], "layers 0-1"),
                        (["--avoid-weight", "-1"], "--avoid-weight must be >= 0")):
        assert main([*base[:1], str(tmp_path / "no"), *base[1:], *flags]) == 2
        assert said in capsys.readouterr().out
    assert main([*base[:1], str(tmp_path / "no"), *base[1:-2], "--avoid-layers", "1"]) == 2
    assert "--avoid-layers and --avoid-among only with it" in capsys.readouterr().out
    assert main([*base[:1], str(tmp_path / "no"), *base[1:-2], "--avoid-among", "video"]) == 2
    assert "--avoid-among only with it" in capsys.readouterr().out
    # --train-vision only says something after a warm-up: with --vision-steps 0 the tower trains anyway
    assert main([*base[:1], str(tmp_path / "no"), *base[1:], "--vision-steps", "0", "--train-vision"]) == 2
    assert "--vision-steps 0 the tower trains with the answers already" in capsys.readouterr().out
    assert not (tmp_path / "no").exists()



def test_distillation_from_a_teacher_that_does_not_see_the_lures(tmp_path, capsys):
    """Issue 27: ``forward_logits(hide_lures=LAYERS)`` keeps every question branch's queries (``Batch.branch_rows``)
    off its sample's lures' tokens (``Batch.lure_keys``) in those layers only, the stream's own tokens reading as
    always; ``looks`` records the answer queries' attention; ``distill_terms`` is 0 against itself and > 0 against
    the teacher, with gradients; ``train(distill_weight=..., distill_logits=...)`` logs both terms and writes them
    to the card and its command; the CLI refuses negative weights, no --init, and layers without a weight."""
    from dataclasses import replace

    from edgekv.toy.train import AVOID_LAYERS, distill_terms, qa_batches, train

    batch = next(qa_batches(np.random.default_rng(4), 1, 4, True, 5, curriculum="world-lures-free-dilute",
                            families=("noise", "checks"), mark_lures=True))
    assert batch.lure_keys is not None and batch.branch_rows.shape == batch.lure_keys.shape == batch.ids.shape
    video = torch.zeros_like(batch.ids, dtype=torch.bool)
    video[batch.video_index[:, 0], batch.video_index[:, 1]] = True
    assert not (batch.lure_keys & ~video).any() and not (batch.branch_rows & video).any()
    lured = batch.lure_keys.any(1)
    assert lured.any() and (batch.branch_rows.any(1) == lured).all()  # only lured samples' branches are kept off
    for b in lured.nonzero().flatten():  # the avoid term's keys are among the same lures
        keys = batch.avoid_keys[batch.target_index[batch.avoid_rows, 0] == b]
        assert len(keys) and torch.equal(keys & batch.lure_keys[b], keys)
    assert next(qa_batches(np.random.default_rng(4), 1, 4, True, 5, curriculum="world-lures-free-dilute",
                           families=("noise", "checks"))).lure_keys is None  # unmarked: nothing to hide

    model = init_model(toy_config(), 0)
    plain, student, same, taught = {}, {}, {}, {}
    logits = forward_logits(model, batch, looks=student)
    with torch.no_grad():
        again = forward_logits(model, batch, looks=same)
        hidden = forward_logits(model, batch, hide_lures=AVOID_LAYERS, looks=taught)
        nothing_hidden = forward_logits(model, replace(batch, lure_keys=torch.zeros_like(batch.lure_keys)),
                                        hide_lures=AVOID_LAYERS, looks=plain)
    torch.testing.assert_close(nothing_hidden, again)
    assert sorted(student) == sorted(taught) == list(AVOID_LAYERS)
    answers = batch.is_answer.nonzero().flatten()
    where = batch.target_index[answers]
    on_lures = batch.lure_keys[where[:, 0]][:, None]  # [A, 1, S]
    for layer in AVOID_LAYERS:
        assert taught[layer].shape == (len(answers), model.config.text.num_attention_heads, batch.ids.shape[1])
        torch.testing.assert_close(taught[layer].exp().sum(-1), torch.ones(taught[layer].shape[:2]))
        assert (taught[layer].exp() * on_lures).sum(-1).max() == 0  # the teacher's answers never see a lure
        assert (student[layer].exp() * on_lures).sum(-1).max() > 0.01
    aux = torch.tensor([family == "aux" for family in batch.families])
    torch.testing.assert_close(hidden[aux], again[aux])  # the stream's tokens read as always
    assert not torch.allclose(hidden[batch.is_answer], again[batch.is_answer])
    zero = distill_terms(student, same, logits, again, batch)
    assert all(abs(term.item()) < 1e-5 for term in zero)
    attention, answers_term = distill_terms(student, taught, logits, hidden, batch)
    assert attention.item() > 0.01 and answers_term.item() > 0
    (attention + answers_term).backward()
    grads = [p.grad for name, p in model.language.layers[1].named_parameters() if "q_proj" in name]
    assert grads and grads[0].abs().sum() > 0
    with pytest.raises(ValueError, match="distill_weight and distill_logits"):
        train(tmp_path / "unused", steps=1, distill_weight=1.0)  # no init: no teacher

    from edgekv.apps.cli import main

    start = save_checkpoint(init_model(toy_config(width=32, layers=2, vision_width=32, vision_depth=2), 3),
                            tmp_path / "start", {"note": "test"})
    base = ["train-toy", "--init", str(start), "--steps", "2", "--batch-size", "2", "--heldout-streams", "0",
            "--eval-samples", "2", "--vision-steps", "0", "--threads", "1", "--no-prefetch", "--log-every", "1",
            "--curriculum", "world-lures-free-dilute", "--families", "noise,checks", "--holdout", "none"]
    out = tmp_path / "distilled"
    assert main([*base[:1], str(out), *base[1:], "--distill-weight", "2", "--distill-logits", "0.5",
                 "--distill-layers", "0,1"]) == 0
    card = __import__("json").loads((out / "card.json").read_text())
    assert (card["distill_weight"], card["distill_logits"], card["distill_layers"]) == (2.0, 0.5, [0, 1])
    assert card["command"].endswith("--distill-weight 2 --distill-logits 0.5 --distill-layers 0,1")
    assert len(card["history"]) == 2
    # the student starts as the teacher: it differs only on lured samples (where the teacher hides the lures)
    assert all(record["distill_attention"] >= 0 and record["distill_answers"] >= 0 for record in card["history"])
    assert any(record["distill_attention"] > 0 for record in card["history"])
    capsys.readouterr()
    for flags, said in ((["--distill-weight", "-1"], "must be >= 0"), (["--distill-layers", "1"], "only with one"),
                        (["--distill-weight", "1", "--distill-layers", "1,x"], "comma-separated"),
                        (["--distill-weight", "1", "--distill-layers", "2"], "layers 0-1"),
                        (["--distill-logits", "1", "--recompute"], "no --recompute")):
        assert main([*base[:1], str(tmp_path / "no"), *base[1:], *flags]) == 2
        assert said in capsys.readouterr().out
    no_init = [*base[:1], str(tmp_path / "no"), *base[3:], "--distill-weight", "1"]
    assert main(no_init) == 2 and "need --init" in capsys.readouterr().out
    # another checkpoint as the teacher: the same depth and heads
    deeper = save_checkpoint(init_model(toy_config(width=32, layers=3, vision_width=32, vision_depth=2), 4),
                             tmp_path / "deeper", {"note": "test"})
    assert main([*base[:1], str(tmp_path / "no"), *base[1:], "--distill-weight", "1", "--distill-layers", "0,1",
                 "--distill-teacher", str(deeper)]) == 2
    assert "its LM has 3 layers" in capsys.readouterr().out
    assert main([*base[:1], str(tmp_path / "no"), *base[1:], "--distill-teacher", str(start)]) == 2
    assert "--distill-teacher only with one" in capsys.readouterr().out
    assert main([*base[:1], str(tmp_path / "no"), *base[1:], "--distill-weight", "1", "--distill-teacher",
                 str(tmp_path / "nowhere")]) == 2
    assert "no config.json there" in capsys.readouterr().out
    assert not (tmp_path / "no").exists()
    other = save_checkpoint(init_model(toy_config(width=32, layers=2, vision_width=32, vision_depth=2), 5),
                            tmp_path / "other", {"note": "test"})
    taught = tmp_path / "taught"
    assert main([*base[:1], str(taught), *base[1:], "--steps", "1", "--distill-logits", "1", "--distill-layers",
                 "1", "--distill-teacher", str(other)]) == 0
    card = __import__("json").loads((taught / "card.json").read_text())
    assert card["distill_teacher"] == str(other) and card["command"].endswith(f"--distill-layers 1 --distill-teacher {other}")
    # a teacher other than the student's start: their answers differ from the first step, lured or not
    assert card["history"][0]["distill_answers"] > 0

def test_hard_negatives_average_the_background_term_over_its_hardest_tokens():
    """``loss_of(..., hard_negatives=F)``: the auxiliary background ("no") term is the mean over the share F of the
    background tokens with the largest loss (at least one), the event tokens' term and the answers' unchanged; F = 1
    is the plain mean. ``train-toy --hard-negatives`` refuses a share outside [0, 1]."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from edgekv.apps.cli import main
    from edgekv.toy.train import loss_of

    torch.manual_seed(0)
    no, vocab = 3, 7
    families = ["color"] * 2 + ["aux"] * 2 + ["aux"] * 10
    targets = torch.tensor([1, 2, 5, 6] + [no] * 10)
    logits = torch.randn(len(families), vocab)
    logits[4:, no] += torch.linspace(-3, 6, 10)  # background tokens from hard (low "no" logit) to easy
    batch = SimpleNamespace(families=families, targets=targets)
    answer = F.cross_entropy(logits[:2], targets[:2])
    shown = F.cross_entropy(logits[2:4], targets[2:4])
    each = F.cross_entropy(logits[4:], targets[4:], reduction="none")
    for share, k in ((0.2, 2), (0.01, 1), (1.0, 10)):
        total, _, aux = loss_of(logits, batch, 0.5, no, hard_negatives=share)
        hardest = each.sort(descending=True).values[:k].mean()
        assert float(aux) == pytest.approx(float(shown + 0.25 * hardest), rel=1e-5)
        assert float(total) == pytest.approx(float(answer + 0.5 * (shown + 0.25 * hardest)), rel=1e-5)
    assert float(loss_of(logits, batch, 0.5, no)[2]) == pytest.approx(float(loss_of(logits, batch, 0.5, no, 1.0)[2]),
                                                                       rel=1e-6)
    assert loss_of(logits, batch, 0.5, no, 0.2)[2] > loss_of(logits, batch, 0.5, no)[2]
    assert main(["train-toy", "/tmp/never-written", "--hard-negatives", "1.5"]) == 2
    assert main(["train-toy", "/tmp/never-written", "--vision-lures", "-0.1"]) == 2
    assert main(["train-toy", "/tmp/never-written", "--vision-lr", "0"]) == 2


def test_lure_probe_tool_reads_the_token_a_look_alike_is_drawn_on(tmp_path):
    """``tools/toy_lure_probe.py`` (docs/measurements.md, "Look-alikes in the tower"): a look-alike is drawn where
    ``distractor_mask`` says (the token the tool reads is the one it covers most); the probe separates separable
    features and scores every held-back pair; the command writes its JSON."""
    import importlib.util
    import json
    from pathlib import Path

    from edgekv.video.world import Clutter, WorldScene, WorldStyle, distractor_mask

    tool = Path(__file__).parents[1] / "tools" / "toy_lure_probe.py"
    spec = importlib.util.spec_from_file_location("toy_lure_probe", tool)
    lure_probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lure_probe)
    for shape in ("star", "ring", "hexagon", "ellipse"):
        bare = WorldScene(112, 112, 2.0, 4, [], "noise", WorldStyle(noise=0.0))
        lured = WorldScene(112, 112, 2.0, 4, [], "noise", WorldStyle(noise=0.0))
        lured.clutter = [Clutter(shape, "red", (40.0, 70.0), 18.0, 0.3)]
        changed = np.abs(lured.frame(0).astype(int) - bare.frame(0).astype(int)).max(-1) > 0
        mask = distractor_mask(shape, (40.0, 70.0), 18.0, 112, 112, 0.3)
        assert changed.sum() > 0.9 * mask.sum() and (changed & ~mask).sum() <= 0.02 * mask.sum()

    rng = np.random.default_rng(0)
    labels = torch.arange(8).repeat(50)
    features = torch.nn.functional.one_hot(labels, 8).float() * 4 + torch.from_numpy(rng.normal(0, 0.1, (400, 8))).float()
    result = lure_probe.probe(features, labels, np.full(400, 15.0), steps=200)
    assert result["eight_way"] == 1.0 and result["lookalike_read_as_vocab"] == 0.0 and result["test_pairs"] == 100
    assert sum(sum(row.values()) for row in result["confusion"].values()) == 100

    out = tmp_path / "lure.json"
    assert lure_probe.main(["--model", "builtin:toy", "--pairs", "48", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["test_pairs"] == 12 and 0 <= written["vocab_vs_lookalike"] <= 1
    assert sum(group["pairs"] for group in written["by_radius"].values()) == 12


def test_lure_keys_tool_probes_what_the_keys_tell_apart(tmp_path):
    """``tools/toy_lure_keys.py`` (issue 27): its probe scores held-out tokens (AUC 1 for classes a direction
    separates, about 0.5 for one distribution labelled twice); on a lured needle stream it labels one token per needle
    and pair (the event's centre cell) and per lure and pair, fits the probe per feature set (the tower's output, each
    LM layer's cached keys, each KV head's) and writes what it found; the shipped toy's keys tell needles from the
    background (the reference) well."""
    import importlib.util
    import json
    from pathlib import Path

    from edgekv.eval.needle import DEFAULT_AGES, needle_stream

    tool = Path(__file__).parents[1] / "tools" / "toy_lure_keys.py"
    spec = importlib.util.spec_from_file_location("toy_lure_keys", tool)
    lure_keys = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lure_keys)
    rng = np.random.default_rng(0)
    y = (rng.random(400) < 0.2).astype(int)
    x = rng.standard_normal((400, 6))
    apart = lure_keys.probe(x + 12.0 * y[:, None] * np.eye(6)[0], y)
    assert apart["auc"] == 1.0 and apart["balanced_accuracy"] == 1.0 and apart["lures_above_needle_p5"] == 0.0
    same = lure_keys.probe(x, y)
    assert 0.3 < same["auc"] < 0.7 and same["lures_above_needle_p5"] > 0.8

    stream = needle_stream(60, DEFAULT_AGES, 49000, 3, 2.0, family="noise", style="world", busy=0.5, lures=1.0,
                           lure_colors="free")
    marks = lure_keys.token_labels(stream.scene, 60, 4, 4)
    needle_cells = {(p, int(e.center[1] // 28), int(e.center[0] // 28)) for e in stream.scene.events
                    for p in range(e.first_pair, e.last_pair + 1)}
    assert {k for k, v in marks.items() if v == 1} == needle_cells
    lured_pairs = {p for p in range(60) if any(t.color in ("red", "green", "blue", "yellow", "white", "purple")
                                               for t in stream.scene.transients(p))}
    assert {k[0] for k, v in marks.items() if v == 0} <= lured_pairs and any(v == 0 for v in marks.values())
    small = lure_keys.token_labels(stream.scene, 60, 4, 4, small=14.0)
    assert set(small) <= set(marks) and all(marks[k] == v for k, v in small.items())

    out = tmp_path / "keys.json"
    assert lure_keys.main(["--length", "60", "--seeds", "49", "--streams", "2", "--families", "noise",
                           "--busy", "0.5", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["needle_tokens"] > 0 and result["lure_tokens"] > 0 and result["background_tokens"] > 0
    assert set(result["probes"]) == {"tower"} | {f"layer {i}" for i in range(4)} | {
        f"layer {i} head {h}" for i in range(4) for h in range(2)}
    assert result["probes"]["tower"]["dims"] == 64 and result["probes"]["layer 1"]["dims"] == 32
    assert result["background_probes"]["tower"]["auc"] > 0.9
