"""tools.py -- multi-turn rollouts with tools ("thinking with images"), token in, token out. --tools FILE (or zoom)
names plain Python functions: type hints and docstring make each one's JSON schema; it returns text or PIL images. A
turn: one engine call for the rank's active samples; the calls it sampled (Qwen's formats) run on threads, cut at
--tool-timeout; their answers, rendered by the model's chat template, follow the sampled ids exactly: nothing
sampled is re-tokenized (Agent-R1 #46). The trainer learns from the sampled tokens only (`policy_mask`)."""
import importlib.util
import inspect
import json
import os
import re
import shutil
import threading
import time
import types
import typing
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context

import torch
from PIL import Image

import data
import rollout as engines
from common import UserError, all_reduce_cpu

HIDDEN = ("images",)  # parameters the loop fills in (the images of the trajectory so far), not the model
SENTINEL = "\x00end of the assistant's turn\x00"  # where the model's own tokens end in a rendered chat
_WORKER, _POOLS, _SAID = {}, {}, set()  # a pixel_pool process's processor; the run's pools by (model, min, max pixels)


# ------------------------------------------------------------------------------------------------ tools, schemas
def load_tools(spec):
    """--tools: a built-in name (BUILTIN_TOOLS) or a Python file, whose public functions defined in it (or those its
    TOOLS list names) are the tools. Returns {name: function}; a file that cannot be used is a UserError now."""
    if spec in BUILTIN_TOOLS:
        return {f.__name__: f for f in BUILTIN_TOOLS[spec]}
    path = os.path.expanduser(spec)
    if not os.path.isfile(path):
        raise UserError(f"--tools {spec}: no such file (or a built-in: {sorted(BUILTIN_TOOLS)})")
    mod = importlib.util.module_from_spec(importlib.util.spec_from_file_location("user_tools", path))
    mod.__spec__.loader.exec_module(mod)
    fns = getattr(mod, "TOOLS", None) or [f for n, f in vars(mod).items() if inspect.isfunction(f)
                                          and f.__module__ == mod.__name__ and not n.startswith("_")]
    if not fns:
        raise UserError(f"--tools {spec}: no public function in it")
    for f in fns:
        if not inspect.getdoc(f):
            raise UserError(f"--tools {spec}: {f.__name__} has no docstring (the model reads it as the tool's "
                            "description)")
    return {f.__name__: f for f in fns}


JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def schema(fn):
    """The function's JSON schema, as chat templates take `tools`: the docstring's first paragraph describes it, a
    line "name: text" of it describes that parameter; the type hints give the types; no default = required."""
    doc, hints = inspect.getdoc(fn) or "", typing.get_type_hints(fn)
    said = dict(re.findall(r"^\s*(\w+):\s*(.+)$", doc, re.M))
    props, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        if name in HIDDEN:
            continue
        t = hints.get(name, str)
        if typing.get_origin(t) in (typing.Union, types.UnionType):  # Optional[int] / int | None: the int
            t = next(a for a in typing.get_args(t) if a is not type(None))
        props[name] = {"type": JSON_TYPES.get(typing.get_origin(t) or t, "string"), **(
            {"description": said[name]} if name in said else {})}
        if p.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "function", "function": {"name": fn.__name__, "description": doc.split("\n\n")[0], "parameters": {
        "type": "object", "properties": props, "required": required}}}


def schemas(fns):
    """The chat template's `tools` for load_tools' functions (None without tools)."""
    return [schema(f) for f in fns.values()] if fns else None


# ------------------------------------------------------------------------------------------------ parsing a turn
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
XML_CALL = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
XML_PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def parse_calls(text):
    """The tool calls of a turn in Qwen's formats: <tool_call>{"name": ..., "arguments": {...}}</tool_call> (hermes
    JSON) or <tool_call><function=NAME><parameter=K>V</parameter></function></tool_call> (Qwen3.5's XML form).
    Each is (name, arguments) or, malformed, (None, its error answer)."""
    out = []
    for body in CALL.findall(text):
        if m := XML_CALL.search(body):
            out.append((m.group(1), {k: _json_or_text(v) for k, v in XML_PARAM.findall(m.group(2))}))
            continue
        try:
            obj = json.loads(body)
            args = obj.get("arguments", {})
            args = json.loads(args) if isinstance(args, str) else args
            if not isinstance(obj.get("name"), str) or not isinstance(args, dict):
                raise ValueError("it needs a string name and an arguments object")
            out.append((obj["name"], args))
        except (ValueError, AttributeError) as e:  # (json's errors are ValueErrors; a list has no .get)
            out.append((None, f"error: the tool call is not JSON with a name and arguments ({e})"))
    return out


def _json_or_text(v):
    try:
        return json.loads(v)
    except ValueError:
        return v


# ------------------------------------------------------------------------------------------------ running calls
def run_calls(tools, calls, images, timeout):
    """Run calls [(name, arguments)] (a turn's, each on a thread) -> a record per call: name, arguments, result,
    status ok / error (it raised: its one-line error) / timeout (cut at `timeout` s, the thread left behind) /
    invalid, seconds. images: per call, the trajectory's images so far (copies). A tool never stops the run."""
    recs, running = [], []
    for (name, args), imgs in zip(calls, images):
        rec = dict(name=name, arguments=args, status="invalid", result=None, seconds=0.0)
        recs.append(rec)
        fn = tools.get(name)
        if name is None:
            rec["result"] = args
            continue
        if fn is None:
            rec["result"] = f"error: unknown tool {name!r}; the tools are {', '.join(sorted(tools))}"
            continue
        kw = {k: v for k, v in args.items() if k not in HIDDEN}
        if "images" in inspect.signature(fn).parameters:  # (copies: a tool that draws on one changes no turn's)
            kw["images"] = [im.copy() for im in imgs]
        try:
            inspect.signature(fn).bind(**kw)
        except TypeError as e:
            rec["result"] = f"error: bad arguments for {name}: {e}"
            continue
        box = {}  # the thread writes here only: after a timeout its late result goes nowhere
        th = threading.Thread(target=_call, args=(fn, kw, box), daemon=True)
        running.append((rec, box, th, time.time()))
        th.start()
    for rec, box, th, t0 in running:
        th.join(max(0.0, t0 + timeout - time.time()))
        rec["seconds"] = time.time() - t0
        if th.is_alive():
            rec.update(status="timeout", result=f"error: {rec['name']} timed out after {timeout:g} s")
        else:
            rec.update(box)
    return recs


def _call(fn, kw, box):
    try:
        out = fn(**kw)
        box.update(status="ok", result=out if isinstance(out, (Image.Image, list)) else str(out))
    except BaseException as e:  # noqa: BLE001 (a tool's SystemExit too: it is the tool's answer)
        line = (str(e).strip().splitlines() or [""])[0]
        box.update(status="error", result=f"error: {type(e).__name__}: {line}"[:500])


# ------------------------------------------------------------------------------------------------ the tools' answer
def _answer_text(proc, recs, ended, lo, hi):
    """(text, pictures within lo..hi pixels) of the tokens after a turn with calls: the template's rendering of the
    tool messages and the next assistant header, after the turn's content, less the end of turn it sampled (`ended`)."""
    msgs, images = [], []
    for r in recs:
        parts = r["result"] if isinstance(r["result"], list) else [r["result"]]
        pics = [data.resize_image(x if x.mode == "RGB" else x.convert("RGB"), lo, hi) for x in parts
                if isinstance(x, Image.Image)]
        images += pics
        content = [{"type": "image"} if isinstance(x, Image.Image) else {"type": "text", "text": str(x)} for x in parts]
        msgs.append({"role": "tool", "name": r["name"] or "",
                     "content": content if pics else "".join(c["text"] for c in content)})
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": SENTINEL}] + msgs
    tail = proc.apply_chat_template(chat, tokenize=False, add_generation_prompt=True).split(SENTINEL, 1)[1]
    return (tail[len(ended):] if ended and tail.startswith(ended) else tail), images  # its token kept, not twice


def render_answers(proc, recs, ended, min_pixels, max_pixels, pool=None):
    """Per trajectory, what follows its turn with calls (recs[i]; ended[i]: its sampled end-of-turn text, or ""):
    (raw ids (one pad per image: vLLM's), ids (pads expanded), images, mm_inputs: a callable). Answers alike share
    their ids, so one of each kind goes through the processor now, the others' pixels on threads while the engine
    runs (`pixels` waits for them) or in a `pool` of processes (pixel_pool), split evenly."""
    tok, texts, groups, kinds = getattr(proc, "tokenizer", proc), [], {}, []
    for i, (r, e) in enumerate(zip(recs, ended)):
        texts.append(_answer_text(proc, r, e, min_pixels, max_pixels))
        kinds.append((texts[-1][0], tuple(im.size for im in texts[-1][1])))
        groups.setdefault(kinds[-1], []).append(i)
    workers, out = pool._max_workers if pool else min(8, os.cpu_count() or 1), {}  # a group in up to `workers` parts
    ex = ThreadPoolExecutor(workers)
    first = dict(zip(groups, ex.map(lambda key: (tok.encode(key[0], add_special_tokens=False),  # (waited for)
                                                 *_render(proc, key[0], [texts[groups[key][0]][1]])[0]), groups)))
    for key, idx in groups.items():  # (answers of text alone: all share the first's ids and its empty mm)
        out, c = {**out, **dict.fromkeys(idx, lambda mm=first[key][2]: mm)}, max(1, -(-(len(idx) - 1) // workers))
        for k in range(1, len(idx) if key[1] else 1, c):
            job = (pool or ex).submit(_render, None if pool else proc, key[0], [texts[i][1] for i in idx[k:k + c]])
            out.update({i: (lambda job=job, j=j: _share(job, j)) for j, i in enumerate(idx[k:k + c])})
    ex.shutdown(wait=False)  # (the threads finish the pixels; the next turn starts now)
    return [(*first[k][:2], texts[i][1], out[i]) for i, k in enumerate(kinds)]


def _share(job, j):
    try:
        return job.result()[j][1]
    except BrokenProcessPool:  # (one line, not the pool's traceback)
        raise UserError("a tool picture's pixel process (tools.pixel_pool) died, most often killed for memory: give "
                        "the node more host memory, or run fewer ranks on it", rank_local=True) from None


def _pool_init(model_path, min_pixels, max_pixels):
    torch.set_num_threads(1)  # (a process a core)
    _WORKER["proc"] = data.load_processor(model_path, min_pixels, max_pixels)


def pixel_pool(model_path, min_pixels, max_pixels, pics=(), workers=None):
    """The run's processes for later turns' pixels (render_answers' `pool`), or None (threads: they share the GIL with
    vLLM's intake and loop) without pictures or where /dev/shm can't hold their tensors twice (~24 bytes a pixel)."""
    need = 48 * sum(im.width * im.height for im in pics if isinstance(im, Image.Image))
    free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    if not need or need > free:
        if need and "shm" not in _SAID:  # (said once a run)
            _SAID.add("shm") or print(f"[tools] /dev/shm has {free >> 20} MB free, the tool pictures' pixels want "
                                      f"{need >> 20} MB: made on threads, slower beside vLLM (docker: --shm-size)")
        return None
    key = (model_path, min_pixels, max_pixels)
    if key not in _POOLS:  # (each rank its share of the node's cores)
        _POOLS[key] = ProcessPoolExecutor(workers or max(1, min(8, (os.cpu_count() or 1) // int(os.environ.get(
            "LOCAL_WORLD_SIZE", 1)))), get_context("forkserver"), initializer=_pool_init, initargs=key)
    return _POOLS[key]


def _render(proc, text, pics):
    """[(ids, mm_inputs)] of answers of one `text` and pictures pics[j], through the processor (None: a pool process's:
    it sends the tensors back once, in shared memory, the answers' are views of them; a thread's, copies) together."""
    proc = _WORKER["proc"] if proc is None else proc
    if not pics[0]:  # (answers of text alone)
        return [(getattr(proc, "tokenizer", proc).encode(text, add_special_tokens=False), {})] * len(pics)
    enc = proc(text=[text] * len(pics), images=pics, return_tensors="pt", add_special_tokens=False)
    mm = {k: v for k, v in enc.items() if k not in data.TOKEN_KEYS and isinstance(v, torch.Tensor)}
    if any(v.shape[0] % len(pics) for v in mm.values()):  # not one share per answer: one by one
        return [x for p in pics for x in _render(proc, text, [p])]
    mm = {k: v.split(v.shape[0] // len(pics)) for k, v in mm.items()}
    return [(enc["input_ids"][j].tolist(), {k: v[j] if _WORKER else v[j].clone() for k, v in mm.items()})
            for j in range(len(pics))]


def merge_mm(a, b):
    """Two records' processor tensors, the images of `a` first (Qwen-VL concatenates them along dim 0)."""
    return {k: torch.cat([a[k], b[k]]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}


def pixels(parts):
    """A trajectory's tool pictures' processor tensors, in order (render_answers' callables: waits for the threads)."""
    return merge_mm(pixels(parts[:-1]), parts[-1]()) if parts else {}


def continuation(t, expand=True):
    """A trajectory as a prompt record for the engine's next turn: the prompt's ids + every token so far (the HF
    engine's expanded ids and pixels with `expand`; vLLM's raw ids and images: it expands them, no pixels copied)."""
    p = t["prompt"]
    return dict(p, prompt_ids=p["prompt_ids"] + t["ids"], raw_prompt_ids=p["raw_prompt_ids"] + t["raw"],
                images=list(p.get("images") or []) + t["images"],
                mm_inputs=merge_mm(p["mm_inputs"], pixels(t["mm"])) if expand else None)


# ------------------------------------------------------------------------------------------------ the turn loop
def rollout(ctx, call):
    """generate_and_score's samples with tools (`call`: grpo.rollout_call's). Turn 1 is that call; each later turn one
    engine call with this rank's active trajectories (n=1, own seeds). --max-response-length bounds the trajectory
    after the prompt, --max-turn-tokens a turn, --limit-images its pictures. Every rank joins each turn's all-reduce
    of the active counts until all are 0 (a TP group generates together; a sample's tools run on its own rank)."""
    cfg, tok, eng = ctx.cfg, ctx.tokenizer, ctx.rollout
    budget = cfg.max_response_length
    per_turn = call["max_tokens"]  # (rollout_call's: --max-turn-tokens, within the budget)
    trajs = [dict(prompt=p, seed=s, j=j, want=j < w, ids=[], raw=[], mask=[], logp=[] if j < w else None, images=[],
                  mm=[], messages=[], calls=[], turn_tokens=[], last=[], finished=False)
             for p, s, w in zip(call["prompts"], call["seeds"], call["logprobs"]) for j in range(call["n"])]
    tp = getattr(eng, "tp", 1) if getattr(eng, "tp_group", None) is not None else 1
    hf = not isinstance(eng, engines.VLLMRollout)  # the HF engine reads expanded ids and pixels; vLLM raw ids, images
    active, outs = list(range(len(trajs))), [o for g in eng.generate(**call) for o in g]  # (what vLLM may queue)
    for turn in range(cfg.max_turns):
        if turn:  # every rank: the active counts of all ranks (a one-hot sum), then this rank's group's share
            counts = torch.zeros(max(ctx.world, 1))
            counts[ctx.rank] = len(active)
            counts = all_reduce_cpu(counts)
            if counts.sum() == 0:
                break
            mine = [trajs[i] for i in active]
            outs = [g[0] for g in eng.generate(
                prompts=[continuation(t, hf) for t in mine], n=1, temperature=call["temperature"], top_p=call["top_p"],
                max_tokens=min(per_turn, max(budget - len(t["ids"]) for t in mine)),
                seeds=[(t["seed"] * 7919 + t["j"] * 101 + turn) % 2**31 for t in mine],
                logprobs=[int(t["want"]) for t in mine])] if counts[ctx.rank // tp * tp:][:tp].sum() > 0 else []
        pending = []  # (trajectory's index, its calls) to run this turn
        for i, o in zip(active, outs):
            t = trajs[i]
            ids = list(o["response_ids"])[:budget - len(t["ids"])]  # the sampled ids, as they are (cut at the budget)
            lp = o.get("logprobs")
            t["logp"] = t["logp"] + list(lp[:len(ids)]) if t["logp"] is not None and lp is not None else None
            t["ids"], t["raw"], t["mask"] = t["ids"] + ids, t["raw"] + ids, t["mask"] + [1] * len(ids)
            t["turn_tokens"].append(len(ids))
            t["last"], t["finished"] = ids, o["finished"] and len(ids) == len(o["response_ids"])
            t["messages"].append({"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)})
            calls = parse_calls(tok.decode(ids, skip_special_tokens=False))
            if calls and turn + 1 < cfg.max_turns and len(t["ids"]) < budget:
                pending.append((i, calls))
        flat = [(trajs[i], c) for i, calls in pending for c in calls]
        recs = iter(run_calls(ctx.tools, [c for _, c in flat], [list(t["prompt"].get("images") or []) + t["images"]
                                                                for t, _ in flat], cfg.tool_timeout))
        dones = [[next(recs) for _ in calls] for _, calls in pending]
        ends = [tok.decode(trajs[i]["last"][-1:]) if trajs[i]["finished"] else "" for i, _ in pending]
        active = []
        pics = [x for d in dones for r in d for x in (r["result"] if isinstance(r["result"], list) else [r["result"]])]
        pool = None if hf else pixel_pool(ctx.model_path, cfg.min_pixels, cfg.max_pixels, pics)  # (HF waits for them)
        for (i, _), done, (raw, ids, imgs, mm) in zip(pending, dones, render_answers(
                ctx.processor, dones, ends, cfg.min_pixels, cfg.max_pixels, pool)):
            t = trajs[i]
            t["calls"] += done
            t["messages"] += [{"role": "tool", "name": r["name"], "content": r["result"]} for r in done]
            shown = len(t["prompt"].get("images") or []) + len(t["images"]) + len(imgs)
            if len(t["ids"]) + len(ids) >= budget or (imgs and shown > cfg.limit_images):  # no room for the answer
                t["finished"] = False  # and a reply (or more pictures than the engine takes): the trajectory ends, cut
                continue
            t["ids"], t["raw"], t["mask"] = t["ids"] + ids, t["raw"] + raw, t["mask"] + [0] * len(ids)
            t["logp"] = t["logp"] + [0.0] * len(ids) if t["logp"] is not None else None  # (masked: never read)
            t["images"], t["mm"] = t["images"] + imgs, t["mm"] + [mm]
            active.append(i)
    return [_sample(t) for t in trajs]


def _sample(t):
    """A trajectory as grpo's sample dict: response_ids = all after the prompt, policy_mask = 1 on the sampled
    tokens. With tool images: a prompt record of its own (its images after the prompt's, in sequence order)."""
    p = t["prompt"]
    if t["images"]:
        p = dict(p, images=list(p.get("images") or []) + t["images"],
                 mm_inputs=merge_mm(p["mm_inputs"], pixels(t["mm"])), tool_images=len(t["images"]))
    st = [r["status"] for r in t["calls"]]
    stats = dict(turns=len(t["turn_tokens"]), calls=len(st), call_rate=float("ok" in st), errors=st.count("error"),
                 timeouts=st.count("timeout"), invalid=st.count("invalid"), policy_tokens=sum(t["mask"]),
                 seconds=sum(r["seconds"] for r in t["calls"]), answer_tokens=len(t["mask"]) - sum(t["mask"]),
                 tokens_per_turn=sum(t["turn_tokens"]) / max(len(t["turn_tokens"]), 1))
    calls = [{k: (v if not isinstance(v, Image.Image) else "<image>") for k, v in r.items()} for r in t["calls"]]
    return dict(prompt=p, response_ids=t["ids"], finished=t["finished"], rollout_logp=t["logp"], policy_mask=t["mask"],
                last_turn=t["last"], tool_stats=stats, trajectory=dict(messages=t["messages"], tool_calls=calls))


def policy_tokens(s):
    """The tokens of a sample the loss covers (all of a single-turn response)."""
    return sum(s["policy_mask"]) if "policy_mask" in s else len(s["response_ids"])


def masked(logp, s):
    """A sample's per-token log-probs [R] with 0 where the policy sampled nothing (a tool's image pads: -inf)."""
    return logp.masked_fill(torch.tensor(s["policy_mask"]) == 0, 0.0) if "policy_mask" in s else logp


def metrics(samples, prefix="tools/"):
    """Means per sample over all ranks: turns, tool calls, call_rate (the share with a call that answered), errors,
    timeouts, invalid calls, seconds in tools, the model's and the tools' tokens, the model's tokens per turn."""
    keys = list(samples[0]["tool_stats"]) if samples else []
    tot = all_reduce_cpu([sum(s["tool_stats"][k] for s in samples) for k in keys] + [len(samples)]).tolist()
    return {f"{prefix}{k}": v / max(tot[-1], 1) for k, v in zip(keys, tot)}


# ------------------------------------------------------------------------------------------------ the zoom demo
# --demo-task zoom: a dot too small for the tiny vision tower, and `zoom`, which magnifies the picture's centre. The
# tiny tokenizer knows the call as one token (a random policy would never find a 20-token call by chance).
ZOOM_CALL = '<tool_call>{"name": "zoom", "arguments": {}}</tool_call>'


def zoom(x: int = -1, y: int = -1, size: int = 2, *, images) -> Image.Image:
    """Magnify a square of the picture: the size x size pixels centred on (x, y), 56 x 56 pixels wide.

    x: the centre's column in pixels of the picture as you see it (-1: the picture's centre)
    y: the centre's row (-1: the picture's centre)
    size: the square's side in pixels"""
    img = images[0]
    x, y = img.width // 2 if x < 0 else x, img.height // 2 if y < 0 else y
    box = (x - size // 2, y - size // 2, x - size // 2 + size, y - size // 2 + size)
    return img.crop(box).resize((56, 56), Image.NEAREST)


BUILTIN_TOOLS = {"zoom": [zoom]}
