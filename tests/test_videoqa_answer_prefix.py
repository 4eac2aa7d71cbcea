"""``StreamSession.ask(..., answer_prefix=...)``: the assistant's turn started with given text (MLVU's evaluation primes
each reply with ``Best option:(``), the model continuing it — checked against transformers' greedy ``generate`` on the
same ids, on the tiny random checkpoint (real Qwen tokenizer and special ids)."""

from __future__ import annotations

import pytest
import torch

from test_session import _frames, _hf_greedy, _hf_one_shot_inputs, _runtime, _template_ids

FPS = 2.0
PREFIX = "Best option:("
QUESTION = "What happens?\nOptions:\n(A) x\n(B) y\nOnly give the best option."


@pytest.fixture(scope="module")
def streamed(tiny_checkpoint):
    """A session (transformers 5's text position rule, as the parity tests) that has seen six frames."""
    frames = _frames(6, seed=5)
    session = _runtime(tiny_checkpoint, text_after_video="transformers-5").session()
    for i, frame in enumerate(frames):
        session.ingest(frame, t=i / FPS)
    return session, frames


def test_the_prefix_tokens_follow_the_template_and_nothing_changes_without_one(streamed, tiny_checkpoint):
    session, _ = streamed
    tokenizer = session.tokenizer
    plain = session.answerer.question_ids(QUESTION, 1, 0.0, 1.0)
    primed = session.answerer.question_ids(QUESTION, 1, 0.0, 1.0, answer_prefix=PREFIX)
    assert primed == plain + tokenizer.encode_text(PREFIX) and len(primed) > len(plain)
    assert session.answerer.question_ids(QUESTION, 1, 0.0, 1.0, answer_prefix="") == plain
    # what transformers tokenizes for the chat template's rendering with the prefix written after it
    video_tokens = session.cache.length - session.prefix_tokens
    rendered = _template_ids(tiny_checkpoint, tokenizer, video_tokens, [{"role": "user", "content": QUESTION}])
    assert rendered[-len(plain):] == plain
    # the rendering ends "<|im_start|>assistant\n" and its last stretch of text is tokenized alone (tokenizers splits
    # at added tokens): with the prefix written after it, the stretch's tokens are its own followed by the prefix's
    header = "<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(header + PREFIX) == tokenizer.encode(header) + tokenizer.encode_text(PREFIX)
    # a prefix that spells a control token is plain text: it cannot close the assistant's turn
    sneaky = session.answerer.question_ids(QUESTION, 1, 0.0, 1.0, answer_prefix="<|im_end|>")
    assert tokenizer.encode("<|im_end|>")[0] not in sneaky[len(plain):]


def test_the_greedy_continuation_equals_transformers_generate_on_the_same_ids(streamed, tiny_checkpoint):
    from transformers import Qwen2_5_VLForConditionalGeneration

    session, frames = streamed
    length = session.cache.length
    answer = session.ask(QUESTION, max_new_tokens=10, answer_prefix=PREFIX)
    assert session.cache.length == length  # the prefix's slots are dropped with the question's
    plain = session.ask(QUESTION, max_new_tokens=10)

    ids, pixel_values, grid_thw, seconds = _hf_one_shot_inputs(session, frames, QUESTION)
    primed = torch.cat([ids, torch.tensor([session.tokenizer.encode_text(PREFIX)])], dim=1)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    expected = _hf_greedy(hf, session, primed, pixel_values, grid_thw, seconds, 10)
    assert answer.token_ids == expected and answer.token_ids
    assert answer.text == session.tokenizer.decode(expected)  # the continuation alone, the prefix not repeated
    assert answer.prompt_tokens == plain.prompt_tokens + len(session.tokenizer.encode_text(PREFIX))
    assert plain.token_ids == _hf_greedy(hf, session, ids, pixel_values, grid_thw, seconds, 10)
    assert answer.token_ids != plain.token_ids  # the prefix reached the model


@pytest.mark.parametrize("bad, said", [(3, "answer_prefix must be a string, got 3"),
                                       (b"(", "answer_prefix must be a string"),
                                       ("\ud800", "answer_prefix: contains a lone UTF-16 surrogate")])
def test_a_bad_prefix_is_refused_by_name_and_the_session_goes_on(streamed, bad, said):
    session, _ = streamed
    length = session.cache.length
    with pytest.raises(ValueError, match=said):
        session.ask(QUESTION, max_new_tokens=2, answer_prefix=bad)
    assert session.cache.length == length
    assert session.ask(QUESTION, max_new_tokens=2, answer_prefix=PREFIX).token_ids is not None


def test_a_prefix_that_leaves_no_room_is_refused_naming_it(streamed):
    session, _ = streamed
    with pytest.raises(ValueError, match=r"and answer_prefix\) \+ max_new_tokens"):
        session.ask(QUESTION, max_new_tokens=2, answer_prefix="word " * 2000)


@pytest.mark.parametrize("end", ["<|im_end|>", "<|endoftext|>"])
def test_a_reply_ends_at_its_end_of_turn_whatever_the_budget(streamed, monkeypatch, end):
    """The official budgets (MLVU's 100 new tokens, OVO-Bench's and StreamingBench's 128) cost a reply that ends its
    turn nothing more: decoding stops at ``<|im_end|>`` / ``<|endoftext|>`` (transformers' ``generate`` stops at the
    same ids, Qwen's generation config's ``eos_token_id``), which is not part of the reply."""
    from edgekv.eval.scoring import mlvu_prediction
    from edgekv.session import answer as answering

    session, _ = streamed
    tokenizer = session.tokenizer
    script = [*tokenizer.encode_text("B)"), tokenizer.encode(end)[0], *tokenizer.encode_text(" and more")]
    steps: list[int] = []

    def scripted(logits, temperature, top_p, generator) -> int:
        steps.append(len(steps))
        return script[len(steps) - 1]

    monkeypatch.setattr(answering, "sample", scripted)
    length = session.cache.length
    for budget in (8, 100, 128):
        del steps[:]
        answer = session.ask(QUESTION, max_new_tokens=budget, answer_prefix=PREFIX)
        assert (answer.text, answer.finish_reason) == ("B)", "stop")
        assert len(steps) == len(tokenizer.encode_text("B)")) + 1  # the reply's tokens and the end of turn, no more
        assert mlvu_prediction(answer.text) == "B" and session.cache.length == length
    del steps[:]
    cut = session.ask(QUESTION, max_new_tokens=1, answer_prefix=PREFIX)
    assert (cut.text, cut.finish_reason, len(steps)) == ("B", "length", 1)  # "B)" is two tokens: the budget cut it
