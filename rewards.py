"""Rule-based rewards with EasyR1's batch signature.

Every reward is `fn(items: list[dict]) -> list[dict]`; an item is
{"response": str, "response_length": int, "ground_truth": str} and each output dict has at least
"overall", "format", "accuracy" (floats). Built-ins: math, r1v, color, number, dapo; or "path/to/file.py:fn",
an EasyR1 reward file of either REWARD_TYPE ("batch" as above, or "sequential": one item in, one dict out)."""

import functools
import importlib.util
import inspect
import json
import logging
import math
import os
import re
import sys
import threading
import traceback

from math_verify import parse, verify

import tiny_model
from common import UserError

# math_verify logs every unparsable string; rollouts produce plenty of those.
logging.getLogger("math_verify").setLevel(logging.CRITICAL)

MATH_FORMAT_WEIGHT = 0.1  # EasyR1 examples/reward_function/math.py default
R1V_FORMAT_WEIGHT = 0.5  # EasyR1 examples/reward_function/r1v.py default
MAX_ANSWER_CHARS = 1000  # longer "answers" are garbage; keep sympy from chewing on them
COLORS = tuple(tiny_model.COLORS)  # the demo task's answers
FLOAT32_MAX = 3.4028234663852886e38  # rewards become a float32 tensor: anything past this is inf there


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
    """The text demo's task: name exactly one integer, the right one ("8", "It is 8."; not "8 or 9")."""
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
        out.append({"overall": 1.0 if correct else -1.0, "format": 1.0 if matches else 0.0,
                    "accuracy": 1.0 if correct else 0.0})
    return out


def overlong_penalty(response_length: int, max_response_length: int, buffer_length: int,
                     penalty_factor: float) -> float:
    """DAPO soft overlong punishment: 0 up to max - buffer, then linear down to -penalty_factor at max."""
    expected = max_response_length - buffer_length
    if response_length <= expected:
        return 0.0
    if buffer_length <= 0:  # no buffer: a hard step instead of dividing by zero
        return -float(penalty_factor)
    return -min((response_length - expected) / buffer_length, 1.0) * penalty_factor


def zoom_reward(items):
    """The colour reward (accuracy x 0.8) and 0.2 for a zoom that answered, followed by a reply: the shaping that lets
    a random policy find the call before it reads the colour. A call overrunning the budget leaves no reply: without
    that the policy learned to repeat the call until cut (a 72-step CPU run, 2026-12-03)."""
    out = []
    for it, sc in zip(items, color_reward(items)):
        replied = bool(it.get("messages")) and it["messages"][-1]["role"] == "assistant"
        called = float(replied and any(c["status"] == "ok" for c in it.get("tool_calls", [])))
        out.append({**sc, "overall": 0.8 * sc["accuracy"] + 0.2 * called, "tool_call": called})
    return out


# ---------------------------------------------------------------- lookup
BUILTIN_REWARDS = {"math": math_reward, "r1v": r1v_reward, "color": color_reward, "number": number_reward,
                   "dapo": dapo_reward, "zoom": zoom_reward}


def get_reward_fn(name: str, kwargs: str | dict | None = None):
    """A batch reward function for a built-in name or an EasyR1 reward file "path/to/file.py:fn" (alone: `main`); its
    REWARD_TYPE: "batch" (fn(items, **kwargs) -> scores, the default) or "sequential" (fn(item, **kwargs) -> score).
    kwargs: EasyR1's reward_function_kwargs, a dict or its JSON."""
    kwargs = _parse_kwargs(kwargs)
    if name in BUILTIN_REWARDS:
        fn, reward_type, where = BUILTIN_REWARDS[name], "batch", f"built-in reward {name!r}"
    elif ":" in name or name.endswith(".py") or "/" in name or os.sep in name:
        path, fn_name = name.rsplit(":", 1) if ":" in name else (name, "main")
        fn, reward_type = _load_custom(path, fn_name)
        where = f"--reward-function {path}:{fn_name}"
    else:
        raise UserError(f"--reward-function {name}: unknown; built-ins: {sorted(BUILTIN_REWARDS)} or "
                        "'path/to/file.py:function_name'")
    if reward_type not in ("batch", "sequential"):
        raise UserError(f"{where}: REWARD_TYPE = {reward_type!r}; EasyR1 knows 'batch' and 'sequential'")
    try:  # EasyR1 calls fn(inputs, **reward_function_kwargs): a missing or unknown argument fails here, not later
        inspect.signature(fn).bind([] if reward_type == "batch" else {}, **kwargs)
    except TypeError as e:
        raise UserError(f"{where}: EasyR1 calls it as fn({reward_type} input, **reward_function_kwargs), and with "
                        f"--reward-function-kwargs '{json.dumps(kwargs)}' that fails: {e}") from e
    except ValueError:  # no signature to read (a builtin or C function): calling it will tell
        pass
    @functools.wraps(fn)
    def batch_fn(items):
        return [fn(item, **kwargs) for item in items] if reward_type == "sequential" else fn(items, **kwargs)
    return batch_fn


def _parse_kwargs(kwargs):
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs) if kwargs.strip() else {}
        except json.JSONDecodeError as e:
            raise UserError(f"--reward-function-kwargs {kwargs}: not JSON ({e}); write e.g. "
                            "'{\"format_weight\": 0.1}'") from e
    if not isinstance(kwargs or {}, dict):
        raise UserError(f"--reward-function-kwargs {kwargs!r}: must be a JSON object of argument names to values")
    return dict(kwargs or {})


def _load_custom(path: str, fn_name: str):
    """(function, REWARD_TYPE) from a reward file; every failure is a UserError naming the file."""
    if not os.path.isfile(path):
        raise UserError(f"--reward-function {path}:{fn_name}: no such file {path!r}")
    # A path-derived module name keeps two reward files with the same basename apart.
    module_name = "custom_reward_" + re.sub(r"\W", "_", os.path.abspath(path))
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"--reward-function {path}: cannot be imported (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # as EasyR1: dataclasses and pickling inside the file need it
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: say where it broke, in one line
        del sys.modules[module_name]
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
                 if os.path.abspath(f.filename) == os.path.abspath(path)]
        line = e.lineno if isinstance(e, SyntaxError) else lines[-1] if lines else "?"
        hint = f" (pip install {e.name}?)" if isinstance(e, ModuleNotFoundError) and e.name else ""
        raise UserError(f"--reward-function {path}: importing it failed at line {line}: "
                        f"{type(e).__name__}: {e}{hint}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UserError(f"--reward-function {path}:{fn_name}: the file has no function {fn_name!r} (name the one to "
                        "call with file.py:function; 'main' is EasyR1's default)")
    return fn, getattr(module, "REWARD_TYPE", "batch")


def check_scores(scores, items, prompts, reward_name):
    """Scores must be one dict per item with a finite number "overall" (and numbers for the other parts):
    a NaN reward would otherwise skip every optimizer step in silence. Raises a UserError naming the sample."""
    if not isinstance(scores, (list, tuple)) or len(scores) != len(items):
        n = len(scores) if isinstance(scores, (list, tuple)) else type(scores).__name__
        raise UserError(f"reward function {reward_name!r} returned {n} scores for {len(items)} responses: it must "
                        f"return one dict per response (got {str(scores)[:200]})", rank_local=True)
    for sc, item, prompt in zip(scores, items, prompts):
        what = None
        if not isinstance(sc, dict) or "overall" not in sc:
            what = f"returned {str(sc)[:100]!r}, not a dict with an 'overall' score"
        else:
            for key, v in sc.items():
                if not -FLOAT32_MAX <= _number(v) <= FLOAT32_MAX:  # NaN fails both
                    what = f"gave {key}={v!r}: every score must be a finite number (they are averaged and logged)"
                    break
        if what:
            raise UserError(f"reward function {reward_name!r} {what}, for the sample with prompt "
                            f"{str(prompt)[:80]!r}, response {str(item['response'])[:80]!r}, ground truth "
                            f"{str(item['ground_truth'])[:80]!r}", rank_local=True)


def _number(v) -> float:
    try:
        return float(v) if not isinstance(v, (str, bytes)) else math.nan
    except (TypeError, ValueError):
        return math.nan
