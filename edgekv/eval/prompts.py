"""What ``eval videoqa`` asks the model: each benchmark's own prompt (``official``, the default) or InfiniPot-V's
format for every benchmark (``infinipot_v``, ``--prompt-style infinipot_v``: the setting of that paper's Table 1).

The official prompts were read from each benchmark's own evaluation code (the words the model reads are the
protocol, so they are kept as written there; the descriptions here are ours). Repositories and commits:

* **MLVU** (JUNJIE99/MLVU @ fd060c10a43e): ``evaluation/multiple_choice_evaluation/choice_bench.py``
  (``MLVU.qa_template`` and the template in ``main``; the same in ``evaluation/models/videochat2/choice_bench.py``,
  where it is run). Options one per line as ``(A) candidate`` under ``Question: ...`` and ``Options:``, then
  ``Only give the best option.`` on its own line; a system message asks the model to watch carefully and pick
  the best option, and the assistant's reply is started with ``Best option:(`` (``answer_prefix``: the session
  starts the assistant's turn with it and the model continues it, ``StreamSession.ask(answer_prefix=...)``). One
  thing cannot be done the same way here: the system message of a stream is ``model.system_prompt``, in the cache
  since the stream began (the cache is query-agnostic, DESIGN invariant 3), so MLVU's sentence goes first in the
  question instead.
* **Video-MME** (BradyFU/Video-MME @ 8889f31): ``README.md``, "Prompt", the subtitle-free form. The instruction
  first (select the best answer; respond with only the letter, listed as ``(A, B, C, or D)``), then the question,
  the options as released (``A. ...`` one per line), then ``The best answer is:``.
* **OVO-Bench** (JoeLeelyf/OVO-Bench @ c34093f9a072): ``constant.py`` (``BR_PROMPT_TEMPLATE``, the Backward
  Tracing and Real-Time tasks) filled by ``utils/OVOBench.py`` (``build_prompt``): ``Question:`` and ``Options:``
  lines with every option on ONE line, ``A. x; B. y; C. z;``, then a blank line and a request for the letter
  alone (``e.g., A, B, C``) with no explanation. The template's newlines and spaces are kept as they are.
  Its Forward Active Responding tasks have a template each in the same file, filled by the same function and
  asked at each ``test_info`` time (``ovobench_forward_prompt``): REC (``REC_PROMPT_TEMPLATE``, the current one,
  not the commented-out yes/no form above it) counts an action so far and is filled with ``How many times did
  they <activity>?``; SSR (``SSR_PROMPT_TEMPLATE``) asks whether the test time's ``step`` is being performed now;
  CRR (``CRR_PROMPT_TEMPLATE``) asks whether the frames so far, the latest ones above all, are enough to answer
  the row's question. REC asks for a single number, SSR and CRR for ``“Yes”`` or ``“No”`` (curly quotes, as
  written), each without explanation. Under ``infinipot_v`` they are not asked: that format asks for an option
  letter, and InfiniPot-V (no OVO-Bench in its code) has no form for a count or a yes/no reply; ``eval videoqa``
  leaves them out there and says so.
* **StreamingBench** (THUNLP-MT/StreamingBench @ 89299232c4cc): ``src/benchmark/StreamingBench.py``
  (``PROMPT_TEMPLATE``, and the ``The best option is:`` added after it). A role and task description that ends by
  asking for only the letter ``(A, B, C, or D)``, then ``Question:``, ``Options:`` with one option per line, and
  ``The best option is:``, blank lines between. Its real-time set always has four options; for another count
  the template's "four" and the letters follow the item's options (StreamingBench's own code would fail there).
* **RVS-Ego / RVS-Movie** (open-ended): the question as written, as ReKV streams them
  (Becomebright/ReKV @ 63793f752be2 ``video_qa/rekv_stream_vqa.py``, ``video_open_qa``) and as Flash-VStream asks
  its open-ended sets (IVGSZ/Flash-VStream @ 8f6bde2 ``Flash-VStream-LLaVA/flash_vstream/eval_video/
  model_msvd_qa.py``). ReKV's ``analyze_a_video`` in that file gives each reply up to 256 new tokens
  (``OFFICIAL_OPEN_MAX_NEW_TOKENS``; ``--max-new-tokens`` overrides it).

``infinipot_v`` (aiha-lab/InfiniPot-V @ 81a4dbe ``dataset_utils.py``): ``Question: {q}``, ``Options:``, one option
per line (MLVU's as ``(A) ...``, the others' as released, ``A. ...``), then ``Respond with only the letter (A, B,
C or D) of the correct option.`` — ``(A, B, C, or D)`` for Video-MME and StreamingBench. InfiniPot-V has no
open-ended set; under this style an open-ended question gets ``Answer in a few words.`` after it (what edgekv
asked before the official style existed, so the runs made then resume the same).

How long a reply may be (new tokens, when ``--max-new-tokens`` is not given) follows the style too. Under
``official`` each benchmark's own run (``OFFICIAL_MAX_NEW_TOKENS``; generation stops at the end of the turn, so a
reply that ends sooner costs nothing more): MLVU 100 (``evaluation/models/videochat2/choice_bench.py``,
``infer_mvbench``'s ``answer(..., max_new_tokens=100)``); OVO-Bench 128 (``models/QWen2VL.py``, ``inference``) and
StreamingBench 128 (``src/model/Qwen2VL.py``, ``Qwen2VL_Run``), each the ``generate(..., max_new_tokens=128)`` of
their Qwen2-VL runner, the nearest to Qwen2.5-VL; RVS 256 (above). Video-MME sets none (its README, its
``evaluation/output_test_template.json`` and the parse_answer script hold no model run), so it keeps edgekv's
``CHOICE_MAX_NEW_TOKENS``, which holds ``The best answer is: B``. Under ``infinipot_v``: ``CHOICE_MAX_NEW_TOKENS``
for multiple choice and ``OPEN_MAX_NEW_TOKENS`` for open-ended questions, what edgekv gave before the official
style existed (InfiniPot-V's own ``qwen_inference_ovu.py`` allows 300).

How a reply is scored follows the style (``edgekv/eval/scoring.py``): under ``official`` each benchmark's own
scorer's rule (MLVU's reads the character before a ``)``, Video-MME's the first capital A-D, OVO-Bench's looks for
the key's letter anywhere in the reply, StreamingBench's compares the reply's first character); under
``infinipot_v`` the first option letter standing alone in the reply, for every dataset.
"""

from __future__ import annotations

from edgekv.eval.qa_item import LETTERS, Item
from edgekv.eval.streaming_sets import is_ovo_forward

PROMPT_STYLES = ("official", "infinipot_v")
DEFAULT_PROMPT_STYLE = "official"
# the style of the runs made before --prompt-style existed: an --out without it in run.json was asked this way
EARLIER_PROMPT_STYLE = "infinipot_v"

OPEN_ENDED_PROMPT = "Answer in a few words."
CHOICE_MAX_NEW_TOKENS = 8  # edgekv's multiple-choice budget: infinipot_v's, and official Video-MME's (it sets none)
OPEN_MAX_NEW_TOKENS = 64  # infinipot_v's open-ended budget: what edgekv gave before the official style existed
OFFICIAL_OPEN_MAX_NEW_TOKENS = 256  # ReKV's RVS replies (video_qa/rekv_stream_vqa.py, analyze_a_video)
# each benchmark's own multiple-choice budget (module docstring: the file and function of each)
OFFICIAL_MAX_NEW_TOKENS = {"mlvu": 100, "ovobench": 128, "streamingbench": 128}
MLVU_ANSWER_PREFIX = "Best option:("
INFINIPOT_V_OXFORD_COMMA = ("videomme", "streamingbench")  # InfiniPot-V lists their letters as (A, B, C, or D)
_COUNTS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}

MLVU_SYSTEM = ("Carefully watch this video and pay attention to every detail. Based on your observations, select "
               "the best option that accurately addresses the question.")
MLVU_ASK = "Only give the best option."
VIDEOMME_ASK = "Select the best answer to the following multiple-choice question based on the video. "
VIDEOMME_END = "The best answer is:"
OVOBENCH_ASK = ("Respond only with the letter corresponding to your chosen option (e.g., A, B, C). \n"
                "Do not include any additional text or explanation in your response.")
# OVO-Bench's Forward Active Responding templates (constant.py), each between newlines as there
OVOBENCH_REC_QUESTION = "How many times did they {}?"  # utils/OVOBench.py, build_prompt
OVOBENCH_REC = ("\nYou're watching a video in which people may perform a certain type of action repetively. \n"
                "The person performing this kind of action are referred to as 'they' in the following statement.\n"
                "You're task is to count how many times have different people in the video perform this kind of "
                "action in total.\nOne complete motion counts as one. \nNow, answer the following question: {}\n"
                "Provide your answer as a single number (e.g., 0, 1, 2, 3\u2026) indicating the total count.\n"
                "Do not include any additional text or explanation in your response.\n")
OVOBENCH_SSR = ("\nYou're watching a tutorial video which contain a sequential of steps. \n"
                "The following is one step from the whole procedures: \n{}\n"
                "Your task is to determine if the man or woman in the video is currently performing this step.\n"
                "Answer only with \u201cYes\u201d or \u201cNo\u201d.\n"
                "Do not include any additional text or explanation in your response.\n")
OVOBENCH_CRR = ("\nYou're responsible of answering questions based on the video content. \n"
                "The following question are relevant to the latest frames, i.e. the end of the video.\n{}\n"
                "Decide whether existing visual content, especially latest frames, i.e. frames that near the end of "
                "the video, provide enough information for answering the question.\n"
                "Answer only with \u201cYes\u201d or \u201cNo\u201d.\n"
                "Do not include any additional text or explanation in your response.\n")
STREAMINGBENCH_ROLE = ("You are an advanced video question-answering AI assistant. You have been provided with some "
                       "frames from the video and a multiple-choice question related to the video. Your task is to "
                       "carefully analyze the video and provide the best answer to question, choosing from the {count} "
                       "options provided. ")
STREAMINGBENCH_END = "The best option is:"


def prompt(item: Item, dataset: str, style: str = DEFAULT_PROMPT_STYLE) -> str:
    """The text asked for ``item`` of ``dataset`` in ``style`` (one of ``PROMPT_STYLES``)."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"prompt style: expected one of {', '.join(PROMPT_STYLES)}, got {style!r}")
    if is_ovo_forward(item, dataset):
        if style != "official":
            raise ValueError(f"OVO-Bench's forward task {item.task} has no {style} prompt (prompts.py docstring); "
                             "it is asked in the official style only")
        return ovobench_forward_prompt(item)
    if style == "infinipot_v":
        return infinipot_v_prompt(item, dataset)
    if item.open_ended:
        return item.question
    official = _OFFICIAL.get(dataset)
    if official is None:
        raise ValueError(f"dataset {dataset!r} has no official multiple-choice prompt here")
    return official(item)


def answer_prefix(dataset: str, style: str, open_ended: bool) -> str:
    """The text the assistant's turn starts with for a question of ``dataset`` in ``style`` (the model continues
    it); ``""`` for none."""
    if style == "official" and dataset == "mlvu" and not open_ended:
        return MLVU_ANSWER_PREFIX
    return ""


def open_max_new_tokens(style: str) -> int:
    """New tokens an open-ended reply gets in ``style`` when ``--max-new-tokens`` is not given."""
    return OFFICIAL_OPEN_MAX_NEW_TOKENS if style == "official" else OPEN_MAX_NEW_TOKENS


def max_new_tokens_for(dataset: str, style: str, open_ended: bool) -> int:
    """New tokens a reply to a question of ``dataset`` gets in ``style`` when ``--max-new-tokens`` is not given:
    the benchmark's own under ``official`` (module docstring), edgekv's under ``infinipot_v``."""
    if open_ended:
        return open_max_new_tokens(style)
    if style == "official":
        return OFFICIAL_MAX_NEW_TOKENS.get(dataset, CHOICE_MAX_NEW_TOKENS)
    return CHOICE_MAX_NEW_TOKENS


def letter_list(count: int, oxford_comma: bool) -> str:
    """``A, B, C or D`` (``A, B, C, or D`` with the serial comma) for ``count`` options."""
    head = ", ".join(LETTERS[: count - 1])
    return f"{head}{',' if oxford_comma and count > 2 else ''} or {LETTERS[count - 1]}"


def respond_with_letter(count: int, oxford_comma: bool) -> str:
    return f"Respond with only the letter ({letter_list(count, oxford_comma)}) of the correct option."


def infinipot_v_prompt(item: Item, dataset: str) -> str:
    if item.open_ended:
        return f"{item.question}\n{OPEN_ENDED_PROMPT}"
    ask = respond_with_letter(len(item.options), dataset in INFINIPOT_V_OXFORD_COMMA)
    return "\n".join([f"Question: {item.question}", "Options:", *item.options, ask])


def mlvu_prompt(item: Item) -> str:
    return "\n".join([MLVU_SYSTEM, f"Question: {item.question}", "Options:", *item.options, MLVU_ASK])


def videomme_prompt(item: Item) -> str:
    ask = VIDEOMME_ASK + respond_with_letter(len(item.options), oxford_comma=True)
    return "\n".join([ask, item.question, *item.options, VIDEOMME_END])


def ovobench_prompt(item: Item) -> str:
    options = "; ".join(item.options) + ";"  # one line: "A. x; B. y;"
    return f"\nQuestion: {item.question}\nOptions:\n{options}\n\n{OVOBENCH_ASK}\n"


def ovobench_forward_prompt(item: Item) -> str:
    """OVO-Bench's prompt for one test time of a REC, SSR or CRR question (the same text at each of its times but
    SSR's, whose step is the test time's own)."""
    if item.task == "REC":
        return OVOBENCH_REC.format(OVOBENCH_REC_QUESTION.format(item.question))
    return {"SSR": OVOBENCH_SSR, "CRR": OVOBENCH_CRR}[item.task].format(item.question)


def streamingbench_prompt(item: Item) -> str:
    count = len(item.options)
    role = STREAMINGBENCH_ROLE.format(count=_COUNTS.get(count, str(count)))
    options = "\n".join(item.options)
    return (f"{role}{respond_with_letter(count, oxford_comma=True)}\n\nQuestion: {item.question}\n\n"
            f"Options:\n{options}\n\n{STREAMINGBENCH_END}")


_OFFICIAL = {"mlvu": mlvu_prompt, "videomme": videomme_prompt, "ovobench": ovobench_prompt,
             "streamingbench": streamingbench_prompt}
