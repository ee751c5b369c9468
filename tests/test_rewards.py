import json
import math
import re
import threading

import pytest

import rewards
from rewards import get_reward_fn, last_boxed, overlong_penalty


def score(name, response, gt, length=10):
    return get_reward_fn(name)([{"response": response, "response_length": length, "ground_truth": gt}])[0]


def triple(d):
    return (d["overall"], d["format"], d["accuracy"])


# ---------------------------------------------------------------- math


def test_last_boxed_nested_and_last_wins():
    assert last_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{1} then \boxed{{2}}") == "{2}"
    assert last_boxed("no box here") is None
    assert last_boxed(r"\boxed{}") == ""
    assert last_boxed(r"\boxed{\frac{1}{2}") is None  # cut off mid-answer


@pytest.mark.parametrize(
    "response, gt, expected",
    [
        (r"<think>a</think> so \boxed{\frac{1}{2}}", "0.5", (1.0, 1.0, 1.0)),
        (r"<think>a</think> \boxed{0.5}", r"\frac{1}{2}", (1.0, 1.0, 1.0)),
        (r"<think>a</think> \boxed{3.0}", "3", (1.0, 1.0, 1.0)),
        (r"<think>a</think> \boxed{3}", "$3$", (1.0, 1.0, 1.0)),
        (r"<think>a</think> \boxed{2}", r"\boxed{2}", (1.0, 1.0, 1.0)),
        (r"<think>a</think> \boxed{x^2+1}", "1+x^2", (1.0, 1.0, 1.0)),
        (r"<think>a</think> \boxed{1}", "1+x^2", (pytest.approx(0.1), 1.0, 0.0)),  # bare gt is not "1"
        (r"<think>a</think> \boxed{1,000}", "1000", (1.0, 1.0, 1.0)),
        (r"<think>a</think> \boxed{1} no wait \boxed{2}", "2", (1.0, 1.0, 1.0)),
        (r"<think>a</think> \boxed{2} no wait \boxed{1}", "2", (pytest.approx(0.1), 1.0, 0.0)),
        (r"<think>a</think> \boxed{4}", "3", (pytest.approx(0.1), 1.0, 0.0)),
        (r"<think>a</think> \boxed{}", "3", (pytest.approx(0.1), 1.0, 0.0)),
        ("<think>a</think> the answer is 3", "3", (0.0, 0.0, 0.0)),  # no box: no credit
        (r"\boxed{3}", "3", (pytest.approx(0.9), 0.0, 1.0)),  # right but no <think>
        (r"< think >a< /think > \boxed{3}", "3", (1.0, 1.0, 1.0)),  # spaced tags, as EasyR1
        (r"<think>a</think> \boxed{\frac{1}{2}", "0.5", (pytest.approx(0.1), 1.0, 0.0)),  # unclosed box
        ("<think>数学 🙂</think> \\boxed{7} ✓", "7", (1.0, 1.0, 1.0)),
        ("<think>é</think> \\boxed{ünïcode}", "3", (pytest.approx(0.1), 1.0, 0.0)),
    ],
)
def test_math(response, gt, expected):
    assert triple(score("math", response, gt)) == expected


def test_math_garbage_never_raises():
    garbage = [
        "<think>" + "</think>\\boxed{" * 50_000,  # quadratic for EasyR1's regex; must stay fast
        "\\boxed{" + "{" * 10_000 + "}" * 10_000 + "}",
        "\\boxed{" + "1+" * 2000 + "1}",
        "\\boxed{\\frac{}{}\\sqrt[}{}}^^__$$}",
        "\x00\x01\\boxed{\ud800}",
        "",
    ]
    out = get_reward_fn("math")([{"response": g, "response_length": 1, "ground_truth": "1"} for g in garbage])
    assert [triple(d) for d in out] == [(0.0, 0.0, 0.0)] * len(garbage)


def test_math_bad_ground_truth_and_none_fields():
    assert triple(score("math", r"<think></think>\boxed{1}", r"\frac{")) == (pytest.approx(0.1), 1.0, 0.0)
    out = get_reward_fn("math")([{"response": None, "response_length": 0, "ground_truth": None}])
    assert triple(out[0]) == (0.0, 0.0, 0.0)


def test_math_grading_off_main_thread():
    # signal-based timeouts fail off the main thread; the reward must still grade there.
    result = {}
    t = threading.Thread(target=lambda: result.update(score("math", r"<think></think>\boxed{0.5}", r"\frac{1}{2}")))
    t.start()
    t.join()
    assert triple(result) == (1.0, 1.0, 1.0)


def test_outputs_are_floats_for_every_builtin():
    for name in rewards.BUILTIN_REWARDS:
        d = score(name, "<think>x</think><answer>red</answer> Answer: red \\boxed{red}", "red")
        assert all(type(d[k]) is float for k in ("overall", "format", "accuracy")), (name, d)


# ---------------------------------------------------------------- r1v


@pytest.mark.parametrize(
    "response, gt, expected",
    [
        ("<think>hm</think><answer>0.5</answer>", r"\frac{1}{2}", (1.0, 1.0, 1.0)),
        ("<think>hm</think>\n  <answer> B </answer>", "B", (1.0, 1.0, 1.0)),  # letters: string fallback
        ("<think>hm</think><answer>A dog.</answer>", "a dog", (1.0, 1.0, 1.0)),
        ("<think>hm</think><answer>4</answer>", "3", (0.5, 1.0, 0.0)),
        ("<think>hm</think><answer>$0.5$</answer>", r"\frac{1}{2}", (1.0, 1.0, 1.0)),
        ("<think>hm</think>text<answer>3</answer>", "3", (0.5, 0.0, 1.0)),  # text between tags
        ("<think>hm</think><answer>3</answer> trailing", "3", (0.5, 0.0, 1.0)),
        ("preamble <think>hm</think><answer>3</answer>", "3", (0.5, 0.0, 1.0)),
        ("<answer>3</answer>", "3", (0.5, 0.0, 1.0)),
        ("3", "3", (0.5, 0.0, 1.0)),  # no tags: whole response graded, as EasyR1
        ("<think>hm</think>", "3", (0.0, 0.0, 0.0)),
        ("<think>a\nb</think><answer>\n2\n</answer>", "2", (1.0, 1.0, 1.0)),  # multi-line
    ],
)
def test_r1v(response, gt, expected):
    assert triple(score("r1v", response, gt)) == expected


# ---------------------------------------------------------------- color


@pytest.mark.parametrize(
    "response, gt, expected",
    [
        ("The colour is red.", "red", (1.0, 1.0, 1.0)),
        ("RED!", "red", (1.0, 1.0, 1.0)),
        ("Blue", " BLUE\n", (1.0, 1.0, 1.0)),
        ("red red red", "red", (1.0, 1.0, 1.0)),
        ("red or blue", "red", (0.0, 0.0, 0.0)),
        ("green", "red", (0.0, 1.0, 0.0)),  # a colour, the wrong one: no reward (format is only logged)
        ("redo the bluest yellowish", "red", (0.0, 0.0, 0.0)),  # word boundaries
        ("I'd redo it: white", "white", (1.0, 1.0, 1.0)),
        ("", "red", (0.0, 0.0, 0.0)),
        ("rouge 🔴", "red", (0.0, 0.0, 0.0)),
    ],
)
def test_color(response, gt, expected):
    assert triple(score("color", response, gt)) == expected


@pytest.mark.parametrize(
    "response, gt, expected",
    [
        ("8", "8", (1.0, 1.0, 1.0)),
        (" 12\n", "12", (1.0, 1.0, 1.0)),
        ("It is 8.", "8", (1.0, 1.0, 1.0)),
        ("8 8", "8", (1.0, 1.0, 1.0)),  # the same number twice is still one answer
        ("9", "8", (0.0, 1.0, 0.0)),  # a number, the wrong one: no reward
        ("8 or 9", "8", (0.0, 0.0, 0.0)),  # hedging is not an answer
        ("18", "8", (0.0, 1.0, 0.0)),  # whole numbers, not digits inside them
        ("eight", "8", (0.0, 0.0, 0.0)),
        ("", "8", (0.0, 0.0, 0.0)),
        ("-3", "-3", (1.0, 1.0, 1.0)),
        ("3", "x", (0.0, 1.0, 0.0)),  # a ground truth that is not an integer matches nothing
    ],
)
def test_number(response, gt, expected):
    assert triple(score("number", response, gt)) == expected


# ---------------------------------------------------------------- dapo


@pytest.mark.parametrize(
    "response, gt, expected",
    [
        ("blah\nAnswer: 42", "42", (1.0, 1.0, 1.0)),
        ("answer :  $42$", "42", (1.0, 1.0, 1.0)),
        ("Answer: 1,000 dollars", "1000", (1.0, 1.0, 1.0)),
        ("Answer: \\frac12", "\\frac{1}{2}", (1.0, 1.0, 1.0)),
        ("Answer: 41\nAnswer: 42", "42", (1.0, 1.0, 1.0)),  # last wins
        ("Answer: 42\nAnswer: 41", "42", (-1.0, 1.0, 0.0)),
        ("Answer: 41", "42", (-1.0, 1.0, 0.0)),
        ("the result is 42", "42", (-1.0, 0.0, 0.0)),
        ("Answer: 42\n" + "x" * 400, "42", (-1.0, 0.0, 0.0)),  # outside the 300-char tail
        ("", "42", (-1.0, 0.0, 0.0)),
    ],
)
def test_dapo(response, gt, expected):
    assert triple(score("dapo", response, gt)) == expected


@pytest.mark.parametrize(
    "length, expected",
    [
        (0, 0.0),
        (768, 0.0),  # exactly max - buffer: no penalty
        (769, -1 / 256 * 0.5),
        (896, -0.25),  # halfway into the buffer
        (1024, -0.5),  # at max: full penalty
        (5000, -0.5),  # capped
    ],
)
def test_overlong_penalty(length, expected):
    assert overlong_penalty(length, 1024, 256, 0.5) == pytest.approx(expected, abs=1e-12)


def test_overlong_penalty_zero_buffer():
    assert overlong_penalty(10, 10, 0, 1.0) == 0.0
    assert overlong_penalty(11, 10, 0, 1.0) == -1.0


# ---------------------------------------------------------------- lookup / custom


def test_custom_loader(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(items):\n"
        "    return [{'overall': float(len(x['response'])), 'format': 0.0, 'accuracy': 0.0} for x in items]\n"
    )
    fn = get_reward_fn(f"{path}:compute_score")
    assert fn.__name__ == "compute_score"
    assert fn([{"response": "abc", "response_length": 1, "ground_truth": ""}]) == [
        {"overall": 3.0, "format": 0.0, "accuracy": 0.0}
    ]


def test_custom_errors(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("x = 1\n")
    with pytest.raises(rewards.UserError, match="has no function 'main'"):  # EasyR1's default name
        get_reward_fn(str(path))
    with pytest.raises(rewards.UserError, match="has no function 'nope'"):
        get_reward_fn(f"{path}:nope")
    with pytest.raises(rewards.UserError, match="has no function 'x'"):  # exists but not callable
        get_reward_fn(f"{path}:x")
    with pytest.raises(rewards.UserError, match="no such file"):
        get_reward_fn(f"{tmp_path}/missing.py:fn")
    bad = tmp_path / "broken.py"
    bad.write_text("import os\n\nimport mathruler_not_installed\n")
    with pytest.raises(rewards.UserError, match="importing it failed at line 3: ModuleNotFoundError.*pip install"):
        get_reward_fn(f"{bad}:fn")
    bad.write_text("def fn(items):\n    return [\n")
    with pytest.raises(rewards.UserError, match="importing it failed at line 2: SyntaxError"):
        get_reward_fn(f"{bad}:fn")
    bad.write_text("REWARD_TYPE = 'parallel'\ndef fn(items):\n    return []\n")
    with pytest.raises(rewards.UserError, match="REWARD_TYPE = 'parallel'"):
        get_reward_fn(f"{bad}:fn")


def test_unknown_name_lists_builtins():
    # (tools.py adds its zoom demo's reward when imported: the listing is the registry's, whatever ran before)
    assert {"color", "dapo", "math", "number", "r1v"} <= set(rewards.BUILTIN_REWARDS)
    with pytest.raises(rewards.UserError, match=re.escape(str(sorted(rewards.BUILTIN_REWARDS)))):
        get_reward_fn("gsm8k")


# ---------------------------------------------------------------- EasyR1 reward files, unchanged
# Shaped like EasyR1's examples/reward_function/r1v.py (sequential) and dapo.py (batch, with required keyword
# arguments passed through reward_function_kwargs); only the grader differs (mathruler is not a dependency here).
EASYR1_SEQUENTIAL = """
import re
from typing import Any

REWARD_NAME = "r1v"
REWARD_TYPE = "sequential"


def format_reward(response: str) -> float:
    pattern = re.compile(r"<think>.*?</think>\\s*<answer>.*?</answer>", re.DOTALL)
    format_match = re.fullmatch(pattern, response)
    return 1.0 if format_match else 0.0


def accuracy_reward(response: str, ground_truth: str) -> float:
    content_match = re.search(r"<answer>(.*?)</answer>", response)
    given_answer = content_match.group(1).strip() if content_match else response.strip()
    return 1.0 if given_answer == ground_truth.strip() else 0.0


def compute_score(reward_input: dict[str, Any], format_weight: float = 0.5) -> dict[str, float]:
    format_score = format_reward(reward_input["response"])
    accuracy_score = accuracy_reward(reward_input["response"], reward_input["ground_truth"])
    return {
        "overall": (1 - format_weight) * accuracy_score + format_weight * format_score,
        "format": format_score,
        "accuracy": accuracy_score,
    }
"""

EASYR1_BATCH = """
from typing import Any

REWARD_NAME = "dapo"
REWARD_TYPE = "batch"


def soft_overlong_punishment(response_length: int, max_response_length: int, overlong_buffer_length: int):
    expected_len = max_response_length - overlong_buffer_length
    if response_length <= expected_len:
        return 0.0
    elif response_length <= max_response_length:
        return (expected_len - response_length) / overlong_buffer_length
    else:
        return -1.0


def compute_score(
    reward_inputs: list[dict[str, Any]],
    max_response_length: int,
    overlong_buffer_length: int,
    overlong_penalty_factor: float,
) -> list[dict[str, float]]:
    scores = []
    for reward_input in reward_inputs:
        accuracy_score = 1.0 if reward_input["response"].strip() == reward_input["ground_truth"] else -1.0
        overlong_score = soft_overlong_punishment(
            reward_input["response_length"], max_response_length, overlong_buffer_length
        )
        scores.append(
            {
                "overall": accuracy_score + overlong_score * overlong_penalty_factor,
                "accuracy": accuracy_score,
                "overlong": overlong_score,
            }
        )
    return scores
"""

ITEMS = [{"response": "<think>hm</think> <answer>4</answer>", "response_length": 5, "ground_truth": "4"},
         {"response": "4", "response_length": 9, "ground_truth": "4"},
         {"response": "<think>x</think><answer>5</answer>", "response_length": 12, "ground_truth": "4"}]


def test_easyr1_sequential_file_runs_unchanged(tmp_path):
    (tmp_path / "r1v.py").write_text(EASYR1_SEQUENTIAL)
    fn = get_reward_fn(f"{tmp_path / 'r1v.py'}:compute_score")  # one dict in, one dict out, once per sample
    assert [triple(s) for s in fn(ITEMS)] == [(1.0, 1.0, 1.0), (0.5, 0.0, 1.0), (0.5, 1.0, 0.0)]
    fn = get_reward_fn(f"{tmp_path / 'r1v.py'}:compute_score", '{"format_weight": 0.1}')  # EasyR1's kwargs
    assert [s["overall"] for s in fn(ITEMS)] == pytest.approx([1.0, 0.9, 0.1])


def test_easyr1_batch_file_with_reward_function_kwargs(tmp_path):
    (tmp_path / "dapo.py").write_text(EASYR1_BATCH)
    name = f"{tmp_path / 'dapo.py'}:compute_score"
    kw = {"max_response_length": 10, "overlong_buffer_length": 4, "overlong_penalty_factor": 1.0}
    scores = get_reward_fn(name, json.dumps(kw))(ITEMS)  # as EasyR1's DAPO script passes them
    assert [(s["overall"], s["accuracy"], s["overlong"]) for s in scores] == [
        (-1.0, -1.0, 0.0), (0.25, 1.0, -0.75), (-2.0, -1.0, -1.0)]  # (6 - 9) / 4 = -0.75
    with pytest.raises(rewards.UserError, match="--reward-function-kwargs '{}' that fails: missing a required "
                                                "argument: 'max_response_length'"):
        get_reward_fn(name)  # at load time, before any model is built
    with pytest.raises(rewards.UserError, match="unexpected keyword argument 'format_weight'"):
        get_reward_fn(name, {**kw, "format_weight": 0.1})
    with pytest.raises(rewards.UserError, match="--reward-function-kwargs \\{oops: not JSON"):
        get_reward_fn(name, "{oops")


@pytest.mark.parametrize("bad, shown", [(math.nan, "overall=nan"), (math.inf, "overall=inf"), (1e39, "overall=1e+39"),
                                        ("1.0", "overall='1.0'"), (None, "overall=None")])
def test_non_finite_or_non_number_scores_name_the_sample(bad, shown):
    items = [{"response": "red", "response_length": 1, "ground_truth": "red"},
             {"response": "the sky is blue", "response_length": 4, "ground_truth": "green"}]
    rewards.check_scores([{"overall": 1.0}, {"overall": 0.0, "accuracy": 0.0}], items, ["p0", "p1"], "r")
    with pytest.raises(rewards.UserError) as e:
        rewards.check_scores([{"overall": 1.0}, {"overall": bad}], items, ["What colour? p1", "x"], "my.py:fn")
    msg = str(e.value)
    assert shown in msg and "my.py:fn" in msg and "'x'" in msg and "'the sky is blue'" in msg and "'green'" in msg
    assert e.value.rank_local  # only the rank that scored it knows: that rank prints it
    with pytest.raises(rewards.UserError, match="returned 1 scores for 2 responses"):
        rewards.check_scores([{"overall": 1.0}], items, ["a", "b"], "r")
    with pytest.raises(rewards.UserError, match="not a dict with an 'overall' score"):
        rewards.check_scores([{"overall": 1.0}, {"score": 1.0}], items, ["a", "b"], "r")
    with pytest.raises(rewards.UserError, match="accuracy=nan"):
        rewards.check_scores([{"overall": 1.0}, {"overall": 1.0, "accuracy": math.nan}], items, ["a", "b"], "r")
