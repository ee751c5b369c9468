"""Rule-based rewards with EasyR1's batch signature.

Every reward is `fn(items: list[dict]) -> list[dict]`; an item is
{"response": str, "response_length": int, "ground_truth": str} and each output dict has at least
"overall", "format", "accuracy" (floats). Built-ins: math, r1v, color, number, dapo; or "path/to/file.py:fn".
"""

import importlib.util
import logging
import os
import re
import threading

from math_verify import parse, verify

import data

# math_verify logs every unparsable string; rollouts produce plenty of those.
logging.getLogger("math_verify").setLevel(logging.CRITICAL)

MATH_FORMAT_WEIGHT = 0.1  # EasyR1 examples/reward_function/math.py default
R1V_FORMAT_WEIGHT = 0.5  # EasyR1 examples/reward_function/r1v.py default
MAX_ANSWER_CHARS = 1000  # longer "answers" are garbage; keep sympy from chewing on them
COLORS = tuple(data.COLORS)  # the demo task's answers


# ---------------------------------------------------------------- grading helpers


def _timeout():
    # math_verify times out via signal.alarm, which only works in the main thread; elsewhere we
    # must pass None (no timeout) or every call raises and scores 0.
    return 5 if threading.current_thread() is threading.main_thread() else None


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced (so \\boxed{\\frac{1}{2}} works); None if absent."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{") : i]
    return None  # unclosed box: the model was cut off mid-answer


def _normalize_str(s: str) -> str:
    # Loose string comparison for answers sympy cannot parse (multiple choice letters, words).
    s = s.strip().strip("$").strip().rstrip(".").strip().lower()
    return " ".join(s.split())


def _parse(text: str) -> list:
    # Strings come as "3", "$0.5$", "\\boxed{2}" or bare latex. Undelimited text is boxed first:
    # math_verify reads a bare "1+x^2" as just "1", which would reward a wrong "1".
    delimited = any(m in text for m in ("$", "\\(", "\\[", "\\boxed"))
    return parse(text if delimited else f"\\boxed{{{text}}}", parsing_timeout=_timeout())


def grade(answer: str, ground_truth: str) -> bool:
    """True if `answer` matches `ground_truth` by math_verify or loose string equality. Never raises."""
    answer, ground_truth = str(answer), str(ground_truth)
    if not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        return False
    if _normalize_str(answer) == _normalize_str(ground_truth):
        return True
    try:
        gold, pred = _parse(ground_truth), _parse(answer)
        return bool(gold and pred and verify(gold, pred, timeout_seconds=_timeout()))
    except Exception:  # timeouts, sympy errors, recursion: a bad answer must not kill training
        return False


# ---------------------------------------------------------------- built-in rewards


def _fields(item: dict) -> tuple[str, str]:
    return str(item.get("response") or ""), str(item.get("ground_truth") or "")


def math_reward(items: list[dict]) -> list[dict]:
    """EasyR1 math: <think>..</think> then \\boxed{..}; accuracy = last boxed graded by math_verify."""
    out = []
    for item in items:
        response, gt = _fields(item)
        response = re.sub(r"\s*(<|>|/)\s*", r"\1", response)  # as EasyR1: qwen2.5vl-32b spaces its tags
        fmt = 1.0 if _math_format(response) else 0.0
        answer = last_boxed(response)
        acc = 1.0 if answer is not None and grade(answer, gt) else 0.0
        out.append(_combine(acc, fmt, MATH_FORMAT_WEIGHT))
    return out


def _math_format(response: str) -> bool:
    # Same language as EasyR1's fullmatch of `<think>.*</think>.*\\boxed\{.*\}.*` (DOTALL), done
    # with find() so megabyte-long garbage cannot trigger regex backtracking.
    if not response.startswith("<think>"):
        return False
    end_think = response.find("</think>", len("<think>"))
    if end_think < 0:
        return False
    box = response.find("\\boxed{", end_think + len("</think>"))
    return box >= 0 and response.find("}", box + len("\\boxed{")) >= 0


R1V_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
R1V_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def r1v_reward(items: list[dict]) -> list[dict]:
    """EasyR1 r1v: <think>..</think><answer>..</answer>; overall = 0.5 * acc + 0.5 * format."""
    out = []
    for item in items:
        response, gt = _fields(item)
        fmt = 1.0 if R1V_FORMAT.fullmatch(response) else 0.0
        match = R1V_ANSWER.search(response)
        # As EasyR1: without tags the whole response is graded (it must then be the bare answer).
        answer = match.group(1).strip() if match else response.strip()
        acc = 1.0 if grade(answer, gt.strip()) else 0.0
        out.append(_combine(acc, fmt, R1V_FORMAT_WEIGHT))
    return out


COLOR_WORDS = re.compile(r"\b(" + "|".join(COLORS) + r")\b")


def color_reward(items: list[dict]) -> list[dict]:
    """Synthetic demo task: name exactly one colour, the right one."""
    out = []
    for item in items:
        response, gt = _fields(item)
        found = set(COLOR_WORDS.findall(response.lower()))  # \b: "redo" is not "red"
        fmt = 1.0 if len(found) == 1 else 0.0
        acc = 1.0 if found == {gt.strip().lower()} else 0.0
        # accuracy alone: a bonus for naming *a* colour pays a text-only policy that always says the same one,
        # and the demo then collapses onto it before it learns to look at the image
        out.append(_combine(acc, fmt, 0.0))
    return out


INTEGER = re.compile(r"-?\d+")


def number_reward(items: list[dict]) -> list[dict]:
    """The text demo's sum task: name exactly one integer, the right one ("8", "It is 8."; not "8 or 9")."""
    out = []
    for item in items:
        response, gt = _fields(item)
        found = {int(x) for x in INTEGER.findall(response)}
        fmt = 1.0 if len(found) == 1 else 0.0
        try:
            acc = 1.0 if found == {int(gt.strip())} else 0.0
        except ValueError:  # a ground truth that is not an integer: nothing can match it
            acc = 0.0
        out.append(_combine(acc, fmt, 0.0))  # accuracy alone, as for the colour task
    return out


def _combine(acc: float, fmt: float, format_weight: float) -> dict:
    return {"overall": (1 - format_weight) * acc + format_weight * fmt, "format": fmt, "accuracy": acc}


# ---------------------------------------------------------------- DAPO (verl math_dapo.py, Minerva style)

DAPO_SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]  # fmt: skip
DAPO_REMOVED = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
    r",\!", "{,}", '"', "\\dots",
]  # fmt: skip
DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def normalize_final_answer(final_answer: str) -> str:
    """DAPO's (Minerva's) answer normalisation, kept verbatim so scores match the paper's."""
    final_answer = final_answer.split("=")[-1]
    for before, after in DAPO_SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in DAPO_REMOVED:
        final_answer = final_answer.replace(expr, "")
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)  # \fracab -> \frac{a}{b}
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)  # \sqrta -> \sqrt{a}
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")  # 1,000 -> 1000
    return final_answer.strip()


def dapo_reward(items: list[dict]) -> list[dict]:
    """DAPO: last "Answer: X" in the final 300 chars; overall +1 correct / -1 otherwise."""
    out = []
    for item in items:
        response, gt = _fields(item)
        # As DAPO: only the tail is searched (the longest MATH-500 answer has 159 chars).
        matches = DAPO_ANSWER.findall(response[-300:])
        correct = bool(matches) and normalize_final_answer(matches[-1]) == normalize_final_answer(gt)
        out.append({
            "overall": 1.0 if correct else -1.0,
            "format": 1.0 if matches else 0.0,
            "accuracy": 1.0 if correct else 0.0,
        })  # fmt: skip
    return out


def overlong_penalty(
    response_length: int, max_response_length: int, buffer_length: int, penalty_factor: float
) -> float:
    """DAPO soft overlong punishment: 0 up to max - buffer, then linear down to -penalty_factor at max."""
    expected = max_response_length - buffer_length
    if response_length <= expected:
        return 0.0
    if buffer_length <= 0:  # no buffer: a hard step instead of dividing by zero
        return -float(penalty_factor)
    return -min((response_length - expected) / buffer_length, 1.0) * penalty_factor


# ---------------------------------------------------------------- lookup

BUILTIN_REWARDS = {"math": math_reward, "r1v": r1v_reward, "color": color_reward, "number": number_reward,
                   "dapo": dapo_reward}


def get_reward_fn(name: str):
    """Built-in reward by name, or "path/to/file.py:fn_name" loaded from a file (returned unchanged)."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" in name:
        return _load_custom(*name.rsplit(":", 1))
    if name.endswith(".py") or os.sep in name or "/" in name:
        raise ValueError(f"custom reward {name!r} names no function: use '{name}:function_name'")
    builtins = sorted(BUILTIN_REWARDS)
    raise ValueError(f"unknown reward {name!r}; built-ins: {builtins} or 'path/to/file.py:function_name'")


def _load_custom(path: str, fn_name: str):
    if not os.path.isfile(path):
        raise ValueError(f"custom reward file not found: {path!r}")
    # A path-derived module name keeps two reward files with the same basename apart.
    module_name = "custom_reward_" + re.sub(r"\W", "_", os.path.abspath(path))
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import custom reward file {path!r} (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"custom reward file {path!r} has no function {fn_name!r}")
    return fn
