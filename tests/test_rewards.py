import os
import re
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rewards  # noqa: E402
from rewards import get_reward_fn, last_boxed, overlong_penalty  # noqa: E402


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
    with pytest.raises(ValueError, match=re.escape(f"{path}:function_name")):
        get_reward_fn(str(path))
    with pytest.raises(ValueError, match="has no function 'nope'"):
        get_reward_fn(f"{path}:nope")
    with pytest.raises(ValueError, match="has no function 'x'"):  # exists but not callable
        get_reward_fn(f"{path}:x")
    with pytest.raises(ValueError, match="file not found"):
        get_reward_fn(f"{tmp_path}/missing.py:fn")


def test_unknown_name_lists_builtins():
    with pytest.raises(ValueError, match=re.escape("['color', 'dapo', 'math', 'number', 'r1v']")):
        get_reward_fn("gsm8k")
