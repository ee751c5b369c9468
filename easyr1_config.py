"""easyr1_config.py -- the command line in EasyR1's terms: its defaults (or the demo's), its YAML config read unchanged
(`--config FILE`, or EasyR1's `config=FILE worker.rollout.n=8 ...`: dotted keys merged as OmegaConf does), then the
flags; and the checks of the values (`check`). TABLE holds every EasyR1 key: the option it sets, or none and why
(docs/easyr1.md). A key that cannot be honoured, or an unknown one, stops the run; one with no effect is listed."""
import json
import os
import re
import sys
import tempfile
import typing
from dataclasses import asdict, replace

import tyro
import yaml

import data
from common import UserError


def _off(v):  # EasyR1's -1 means off / unlimited; here that is 0
    return 0 if v == -1 else v


def _only(*ok, why):  # a key that cannot be honoured unless its value is one of `ok` (then it changes nothing)
    def check(v, y):
        if v not in ok:
            raise ValueError(why)
        return {}
    return check


def _pick(option, names):  # a value spelled differently here
    def conv(v, y):
        if v not in names:
            raise ValueError(f"choose one of {sorted(names)}")
        return {option: names[v]}
    return conv


def _loss_type(v, y):
    """EasyR1's losses as EasyR1 computes them: its gspo is dual-clipped, its cispo bounds the weight below (the
    flags --no-gspo-dual-clip / --no-cispo-clip-low still give the papers')."""
    got = _pick("loss_type", {"default": "ppo_clip", "ppo_clip": "ppo_clip", "gspo": "gspo", "gspo_token":
                              "gspo_token", "cispo": "cispo", "sapo": "sapo"})(v, y)
    return {**got, **{"gspo": {"gspo_dual_clip": True}, "cispo": {"cispo_clip_low": True}}.get(v, {})}


def _tokenizer(v, y):
    if v is not None and v != y.get("worker.actor.model.model_path"):
        raise ValueError("the tokenizer and processor come from the model folder")
    return {}


def _reward(v, y):  # EasyR1: "file.py" alone means its function `main`
    return {"reward_function": f"{v}:main" if v.endswith(".py") else v} if v else {}


def _reward_kwargs(v, y):  # a YAML mapping here, a JSON string in the option (checked against the function later)
    if v in (None, {}):
        return {}
    if isinstance(v, str):
        return {"reward_function_kwargs": v}
    if not isinstance(v, dict):
        raise ValueError("give a mapping of argument names to values, e.g. '{\"max_response_length\": 4096}'")
    return {"reward_function_kwargs": json.dumps(v)}


def _loggers(v, y):
    names = {"file": "jsonl", **{x: x for x in ("console", "jsonl", "tensorboard", "wandb", "swanlab", "mlflow")}}
    if bad := [x for x in v if x not in names]:
        raise ValueError(f"{bad} not supported here; choose from console, file, tensorboard, wandb, swanlab, mlflow")
    return {"logger": sorted({names[x] for x in v} | {"jsonl"})}


def _output_dir(v, y):  # EasyR1's rule when no path is given: checkpoints/<project_name>/<experiment_name>
    return {"output_dir": v or os.path.join("checkpoints", y.get("trainer.project_name", "easy_r1"),
                                            y.get("trainer.experiment_name", "demo"))}


SAME = "same option"
NO_EFFECT = "speed or memory only; nothing here to set"
FSDP = "FSDP2, fully sharded over all ranks; compute in --dtype (bf16 on GPUs), gradients reduced in fp32"


def _torch_dtype(v, y):  # EasyR1's actor storage dtype: null = fp32 master weights
    if v in (None, "fp32", "float32"):
        return {}
    if v in ("bf16", "bfloat16"):
        return {"precision": "bf16"}
    raise ValueError("choose null, fp32 or bf16")


def _world(v, y):
    """EasyR1 starts n_gpus_per_node x nnodes workers itself, here the launcher: with several processes the two must
    agree. One process is the one-GPU try of an EasyR1 script: not stopped."""
    gpus, nodes = y.get("trainer.n_gpus_per_node", 8), y.get("trainer.nnodes", 1)  # EasyR1's defaults
    world = os.environ.get("WORLD_SIZE", "1")
    if int(world) > 1 and int(world) != gpus * nodes:
        raise ValueError(f"trainer.n_gpus_per_node x trainer.nnodes = {gpus} x {nodes} = {gpus * nodes} processes, but "
                         f"torchrun started {world} (WORLD_SIZE): launch torchrun --nnodes {nodes} --nproc_per_node "
                         f"{gpus}, or set trainer.n_gpus_per_node={int(world) // nodes or 1}")
    return {}


def _flag(option):
    return lambda v, y: {option: True} if v else {}


# EasyR1 keys whose option here has the same name (data.max_pixels -> --max-pixels)
SAME_NAME = """
data.train_files data.val_files data.prompt_key data.answer_key data.image_key data.video_key data.image_dir
data.video_fps data.max_prompt_length data.max_response_length data.rollout_batch_size data.format_prompt
data.seed data.shuffle data.min_pixels data.max_pixels data.filter_overlong_prompts
algorithm.adv_estimator algorithm.kl_coef algorithm.kl_type algorithm.kl_horizon algorithm.kl_target
algorithm.filter_key algorithm.filter_low algorithm.filter_high
worker.actor.global_batch_size worker.actor.max_grad_norm worker.actor.clip_ratio_low
worker.actor.clip_ratio_high worker.actor.clip_ratio_dual worker.actor.loss_avg_mode worker.actor.ppo_epochs
worker.actor.tau_positive worker.actor.tau_negative
worker.actor.model.freeze_vision_tower
worker.actor.optim.lr_scheduler_type
worker.rollout.n worker.rollout.temperature worker.rollout.top_p worker.rollout.gpu_memory_utilization
worker.rollout.enforce_eager worker.rollout.tensor_parallel_size worker.rollout.max_num_batched_tokens
trainer.val_before_train trainer.save_freq
""".split()
# EasyR1 key: (our option, conversion (value, whole flat config) -> {option: value} or None, note).
# Later entries win: algorithm.disable_kl comes after algorithm.kl_coef.
TABLE = {
    **{k: (k.rpartition(".")[2], None, SAME) for k in SAME_NAME},
    "data.mini_rollout_batch_size": ("gen_batch_size", lambda v, y: {"gen_batch_size": v or y.get(
        "data.rollout_batch_size", 512)}, "prompts per dynamic-sampling try (null: the rollout batch)"),
    "data.val_batch_size": (None, None, "validation runs 64 prompts per rank at a time (memory only)"),
    "data.override_chat_template": (None, _only(None, why="not supported: the model's own chat template is used"),
                                    "must be null: the model's own chat template is used"),
    "data.filter_overlong_prompts_workers": (None, None, NO_EFFECT),
    "algorithm.gamma": (None, _only(1, 1.0, why="no discounting here"), "must be 1"),
    "algorithm.lam": (None, _only(1, 1.0, why="GAE (a critic) is not implemented"), "must be 1 (no GAE here)"),
    "algorithm.kl_penalty": ("kl_penalty", _pick("kl_penalty", {"kl": "k1", "mse": "k2", "abs": "abs", "low_var_kl":
                                                                 "low_var_kl", "k1": "k1", "k2": "k2", "k3": "k3"}),
                             "kl -> k1, mse -> k2, low_var_kl and abs the same; full is not implemented"),
    "algorithm.disable_kl": ("kl_coef", lambda v, y: {"kl_coef": 0.0} if v else {},
                             "true -> --kl-coef 0 (no reference model)"),
    "algorithm.use_kl_loss": ("kl_in_reward", lambda v, y: {"kl_in_reward": not v},
                              "false -> --kl-in-reward (the KL penalty in the reward)"),
    "algorithm.online_filtering": ("filter_groups", lambda v, y: {"filter_groups": v},
                                   "dynamic sampling (DAPO's), in grpo.py and dapo.py"),
    "worker.hybrid_engine": (None, _only(True, why="the trainer and vLLM always share the GPUs"), "always colocated"),
    "worker.actor.strategy": (None, _only("fsdp", why="FSDP2 only"), "FSDP2"),
    "worker.actor.micro_batch_size_per_device_for_update": (
        None, None, "micro-batches do not change the result; here --max-token-len-per-device and "
                    "--micro-batch-size-per-device bound them (the log-prob passes' too, unless "
                    "--logprob-max-token-len-per-device)"),
    "worker.actor.micro_batch_size_per_device_for_experience": (
        None, None, "as for_update; EasyR1 gives its log-prob passes this x the padded length in tokens, here "
                    "--logprob-max-token-len-per-device sets their own token bound"),
    "worker.actor.loss_type": ("loss_type", _loss_type, "default -> ppo_clip; gspo -> gspo with --gspo-dual-clip; "
                                                         "cispo -> cispo with --cispo-clip-low (EasyR1's formulas)"),
    "worker.actor.padding_free": ("padding_free", lambda v, y: {"padding_free": "auto" if v else "off"},
                                  "true = auto (on where a fast varlen kernel runs)"),
    "worker.actor.dynamic_batching": (None, None, "always on: micro-batches by padded tokens"),
    "worker.actor.ulysses_size": ("ulysses_size", None, "Ulysses sequence parallelism (each packed row over K ranks)"),
    "worker.actor.use_torch_compile": ("torch_compile", lambda v, y: {"torch_compile": "auto" if v else "off"},
                                       "true = auto (on for CUDA in bf16)"),
    "worker.actor.model.model_path": ("model_path", None, None),
    "worker.actor.model.tokenizer_path": (None, _tokenizer, "must be null: the model folder's tokenizer is used"),
    "worker.actor.model.override_config": (None, _only({}, None, why="not supported"), "must be empty"),
    "worker.actor.model.enable_gradient_checkpointing": ("gradient_checkpointing", None, None),
    "worker.actor.model.trust_remote_code": (None, None, "not needed: the models are built into transformers"),
    "worker.actor.model.lora.rank": ("lora_rank", None, "0 = full fine-tuning"),
    "worker.actor.model.lora.alpha": ("lora_alpha", None, None),
    "worker.actor.model.lora.target_modules": ("lora_target_modules", None, "all-linear or a comma-separated list"),
    "worker.actor.model.lora.exclude_modules": ("lora_exclude_modules", None, "a regex (EasyR1's example: the ViT)"),
    "worker.actor.optim.lr": ("lr", None, None),
    "worker.actor.optim.weight_decay": ("weight_decay", None, None),
    "worker.actor.optim.betas": (None, _only([0.9, 0.999], why="AdamW's betas are (0.9, 0.999) here"),
                                 "must be [0.9, 0.999]"),
    "worker.actor.optim.strategy": (None, None, "AdamW (adamw_bf16 runs as adamw; --precision bf16 keeps weights and state in bf16)"),
    "worker.actor.optim.lr_warmup_ratio": ("lr_warmup_ratio", None, "x the optimizer steps, once the data are loaded"),
    "worker.actor.optim.lr_warmup_steps": ("lr_warmup_steps", lambda v, y: {"lr_warmup_steps": v} if v else {}, None),
    "worker.actor.optim.min_lr_ratio": ("min_lr_ratio", lambda v, y: {"min_lr_ratio": v or 0.0}, "null -> 0"),
    "worker.actor.fsdp.torch_dtype": ("precision", _torch_dtype, "null / fp32 -> amp (fp32 master weights); bf16 -> "
                                      "bf16 (weights, gradients, AdamW state in bf16)"),
    "worker.actor.fsdp.enable_cpu_offload": ("offload_params", _flag("offload_params"),
                                             "FSDP2's CPUOffloadPolicy: weights, gradients, AdamW state on the host"),
    "worker.actor.fsdp.*": (None, None, FSDP),
    "worker.actor.offload.offload_params": ("offload_params", _flag("offload_params"),
                                            "FSDP2 offloads weights, gradients and AdamW state together"),
    "worker.actor.offload.offload_optimizer": ("offload_optimizer", _flag("offload_optimizer"),
                                               "AdamW state on the host between optimizer steps"),
    "worker.critic.*": (None, None, "no critic (GAE is not implemented)"),
    "worker.rollout.name": ("rollout_engine", None, "vllm (or hf: transformers' generate)"),
    "worker.rollout.top_k": (None, _only(-1, 0, why="top-k sampling is not implemented"), "must be -1"),
    "worker.rollout.seed": (None, None, "each prompt's samples are seeded from --seed and its place in the data"),
    "worker.rollout.limit_images": ("limit_images", lambda v, y: {"limit_images": v} if v else {},
                                    "0 (vLLM's default) keeps ours: 1"),
    "worker.rollout.dtype": (None, None, "the engine runs the compute dtype (--dtype)"),
    "worker.rollout.ignore_eos": (None, _only(False, why="not supported"), "must be false"),
    "worker.rollout.enable_chunked_prefill": (None, None, "vLLM's V0 engine only"),
    "worker.rollout.max_model_len": (None, None, "max_prompt_length + max_response_length"),
    "worker.rollout.disable_log_stats": (None, None, "display only"),
    "worker.rollout.disable_tqdm": (None, None, "display only"),
    "worker.rollout.val_override_config.temperature": ("val_temperature", None, None),
    "worker.rollout.val_override_config.top_p": ("val_top_p", None, None),
    "worker.rollout.val_override_config.n": ("val_n", None, "answers per validation prompt: val/mean, val/pass@n"),
    "worker.ref.*": (None, None, "the reference model: FSDP2-sharded in the compute dtype; on the host between its "
                                 "passes with --offload-params"),
    "worker.reward.reward_function": ("reward_function", _reward, "file.py:fn, built-ins math | r1v | dapo"),
    "worker.reward.reward_function_kwargs": ("reward_function_kwargs", _reward_kwargs,
                                             "a mapping: keyword arguments of the reward function, as EasyR1"),
    "worker.reward.skip_special_tokens": (None, _only(True, why="responses are always decoded without special tokens"),
                                          "must be true"),
    "worker.reward.num_cpus": (None, None, "rewards run in the trainer's processes"),
    "trainer.total_epochs": ("total_epochs", None, "used when max_steps is null"),
    "trainer.max_steps": ("max_steps", lambda v, y: {"max_steps": v} if v else {}, "null -> total_epochs"),
    "trainer.project_name": ("project_name", None, "wandb, swanlab, mlflow (its experiment)"),
    "trainer.experiment_name": ("experiment_name", None, "wandb, swanlab, mlflow (its run name)"),
    "trainer.logger": ("logger", _loggers, "file -> jsonl (always on); wandb and swanlab offline without an API key, "
                                           "mlflow into output_dir/mlflow.db without MLFLOW_TRACKING_URI"),
    "trainer.nnodes": (None, lambda v, y: {} if "trainer.n_gpus_per_node" in y else _world(v, y),
                       "torchrun's --nnodes (see n_gpus_per_node)"),
    "trainer.n_gpus_per_node": (None, _world, "torchrun's --nproc_per_node: python grpo.py runs one process, torchrun "
                                              "--nproc_per_node N grpo.py N; with several, n_gpus_per_node x nnodes "
                                              "must be their number"),
    "trainer.max_try_make_batch": ("max_try_make_batch", lambda v, y: {"max_try_make_batch": _off(v)},
                                   "-1 -> 0 (unlimited)"),
    "trainer.critic_warmup": (None, None, "no critic"),
    "trainer.val_freq": ("val_freq", lambda v, y: {"val_freq": _off(v)}, "-1 -> 0 (never)"),
    "trainer.val_only": (None, _only(False, why="not supported"), "must be false"),
    "trainer.val_generations_to_log": (None, None, "validation answers are not logged (--log-samples: training's)"),
    "trainer.save_limit": ("save_limit", lambda v, y: {"save_limit": _off(v)}, "-1 -> 0 (keep all)"),
    "trainer.save_model_only": (None, None, "checkpoints always hold the optimizer (an exact resume); merge.py "
                                            "extracts the model"),
    "trainer.find_last_checkpoint": ("resume", lambda v, y: {"resume": "auto" if v else "never"},
                                     "true -> auto; false -> never (refuses a folder that holds a run)"),
    "trainer.load_checkpoint_path": ("resume", lambda v, y: {"resume": v} if v else {}, "a checkpoints/step_N folder"),
    "trainer.save_checkpoint_path": ("output_dir", _output_dir, "null -> checkpoints/<project_name>/<experiment_name>"),
    "trainer.ray_timeline": (None, None, "no Ray"),
}


def _leaves(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict) and v and f"{prefix}{k}" not in TABLE:  # a key whose value is a dict stays whole
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _entry(key):
    """The TABLE key that covers an EasyR1 key (itself, or a `prefix.*` row), or None."""
    if key in TABLE:
        return key
    return next((k for k in TABLE if k.endswith(".*") and key.startswith(k[:-1])), None)


def _coerce(v, tp):
    """A YAML value as the option's type (YAML reads 1e-6 as a string; EasyR1's OmegaConf converts it by type)."""
    args = typing.get_args(tp)
    if v is None:
        if type(None) in args:
            return None
        raise ValueError("null is not allowed here")
    if type(None) in args:
        tp = next(a for a in args if a is not type(None))
    if typing.get_origin(tp) is typing.Literal:
        if v not in typing.get_args(tp):
            raise ValueError(f"choose one of {list(typing.get_args(tp))}")
        return v
    if tp is bool:
        if not isinstance(v, bool):
            raise ValueError("expected true or false")
        return v
    if tp in (int, float):
        out = tp(float(v))
        if tp is int and out != float(v):
            raise ValueError("expected an integer")
        return out
    return str(v) if tp is str else v


def translate(config, cls, sources=None):
    """A nested EasyR1 config -> ({option: value} for `cls`, notes on the keys without effect here); one ValueError
    lists every key that cannot be honoured. `sources` gets the EasyR1 key that set each option."""
    y = dict(_leaves(config))
    y.setdefault("trainer.save_checkpoint_path", None)  # EasyR1 derives it when absent, so do we
    hints = typing.get_type_hints(cls)
    opts, notes, errors = {}, {}, [f"{k}: not an EasyR1 key" for k in y if _entry(k) is None]
    for key, (option, conv, note) in TABLE.items():
        for k in [k for k in y if _entry(k) == key]:
            try:
                got = conv(y[k], y) if conv else ({option: y[k]} if option else {})
                if not got:  # nothing set: say why
                    why = f"no option here: {note}" if option is None else f"nothing to set: {note}"
                    notes.setdefault(why, []).append(f"{k}={y[k]!r}")
                for o, v in got.items():
                    if o not in hints:  # an option of dapo.py read by grpo.py
                        notes.setdefault(f"not an option of this script: {note}", []).append(f"{k}={y[k]!r}")
                        continue
                    opts[o] = _coerce(v, hints[o])
                    if sources is not None:
                        sources[o] = f"{k}={y[k]!r}"
            except ValueError as e:
                errors.append(f"{k}={y[k]!r}: {e}")
    if errors:
        raise UserError("EasyR1 config: " + "; ".join(errors))
    return opts, [f"{', '.join(keys)} ({why})" for why, keys in notes.items()]


SECTIONS = ("data", "algorithm", "worker", "trainer")  # EasyR1's top-level keys


class _YAML(yaml.SafeLoader):
    """YAML as OmegaConf reads it: 1e-6 is a number (YAML 1.1 wants a dot, and would give the string "1e-6" to a
    reward function's keyword argument)."""


_YAML.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
    r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def split_argv(args):
    """EasyR1's words (`config=FILE`, `section.key=value`) apart from this project's flags, in their order. Only
    words that start with `config=` or one of EasyR1's sections count, so a flag's value holding `=` stays a value."""
    easyr1, flags = [], []
    for a in args:
        head = a.partition("=")[0]
        ours = "=" in a and (head == "config" or head.split(".")[0] in SECTIONS) and " " not in head
        (easyr1 if ours else flags).append(a)
    return easyr1, flags


def _merge(old, new):  # OmegaConf's merge: mappings key by key, anything else replaced
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: _merge(old.get(k), v) for k, v in new.items()}}
    return new


def from_words(words, config_flag=None):
    """EasyR1's command line -> (its nested config, the file read or None): the `config=` file (or --config), then
    every dotted key merged over it, as EasyR1's main. Values are YAML (OmegaConf's dotlist): `[a,b]`, `{"n":16}`, true."""
    files = [w.partition("=")[2] for w in words if w.startswith("config=")]
    given = files + ([config_flag] if config_flag else [])
    if len(given) > 1:
        raise UserError(f"config= / --config given {len(given)} times ({', '.join(given)}): give one file")
    path = (files or [config_flag])[0]
    if path is not None and not os.path.isfile(path):
        raise UserError(f"{'config=' if files else '--config '}{path}: no such file")
    config = {}
    if path is not None:
        with open(path) as f:
            config = yaml.load(f, _YAML) or {}
    for w in words:
        key, _, text = w.partition("=")
        if key == "config":
            continue
        try:
            value = yaml.load(text, _YAML)
        except yaml.YAMLError as e:
            raise UserError(f"{key}={text}: not a YAML value ({str(e).splitlines()[0]}); quote the word for the "
                            "shell, e.g. key='[a,b]'") from None
        *parents, last = key.split(".")
        node = config
        for i, p in enumerate(parents):
            if node.get(p) is None:  # absent (or null in the file): a new mapping
                node[p] = {}
            elif not isinstance(node[p], dict):
                raise UserError(f"{key}={text}: {'.'.join(parents[:i + 1])} holds a value, not keys")
            node = node[p]
        node[last] = _merge(node.get(last), value)
    return config, path


def cli(cls, demo, args=None, text_demo=None, video_demo=None, tools_demo=None, family_demo=None):
    """Parse the command line over the defaults in force: `cls`'s (EasyR1's), or the demo's (`demo`; `text_demo`,
    `video_demo`, `tools_demo`, then `family_demo` on top), the EasyR1 config between the defaults and the flags. Rank
    0 says which set is in force, what the config and the flags changed, and where a flag won."""
    script = sys.modules["__main__"].__doc__ or sys.modules[cls.__module__].__doc__  # grpo.py's Config is config.py's
    desc = (f"{script.splitlines()[0]} Also EasyR1's form: config=FILE and dotted keys (worker.rollout.n=8), with the "
            "flags in any order; a flag wins. Defaults shown are EasyR1's; the demo (no --model-path) uses "
            + ", ".join(f"{k}={v}" for k, v in demo.items()) + ".")
    words, args = split_argv(sys.argv[1:] if args is None else list(args))
    first = tyro.cli(cls, args=args, description=desc)  # --help stops here, showing the real defaults
    from_yaml, notes, sources, path = {}, [], {}, None
    if first.config or words:
        config, path = from_words(words, first.config)
        from_yaml, notes = translate(config, cls, sources)
    is_demo = not (first.model_path or from_yaml.get("model_path"))
    model = getattr(first, "demo_model", "")  # the text demo's settings, else the video's or the tool's (tools.py)
    task = "text" if data.is_text_demo(model) else getattr(first, "demo_task", "")
    demo = {**demo, **({"text": text_demo, "video": video_demo, "zoom": tools_demo}.get(task) or {}),
            **(family_demo or {}).get(model, {})}  # then a family's (FAMILY_DEMO)
    defaults = replace(cls(), **{**(demo if is_demo else {}), **from_yaml})
    cfg = tyro.cli(cls, args=args, default=defaults, description=desc)
    if os.environ.get("RANK", "0") == "0":
        changed = [f"{k}={v}" for k, v in asdict(cfg).items() if v != getattr(defaults, k)]
        dotted = sum(not w.startswith("config=") for w in words)
        origin = " and ".join([path] * bool(path) + [f"{dotted} dotted key(s)"] * bool(dotted))
        won = [f"--{o.replace('_', '-')} {getattr(cfg, o)} over {sources[o]}" for o in from_yaml
               if getattr(cfg, o) != from_yaml[o]]  # only a flag makes them differ
        print(f"[config] defaults: {'demo (tiny model)' if is_demo else 'EasyR1'}"
              + (f"; from {origin}: " + " ".join(f"{k}={v}" for k, v in from_yaml.items()) if from_yaml else "")
              + f"; set: {' '.join(changed) or 'nothing'}" + "".join(f"\n[config] {n}" for n in notes)
              + (f"\n[config] flags win: {'; '.join(won)}" if won else ""), flush=True)
    return cfg


def check(cfg, world):
    """The parsed options' checks before any process group or model loads (every rank raises the same UserError)."""
    positive = {"lr": cfg.lr, "max-response-length": cfg.max_response_length,
                "max-prompt-length": cfg.max_prompt_length, "temperature": cfg.temperature}  # log-probs divide by it
    for opt, v in positive.items():
        if not v > 0:
            raise UserError(f"--{opt} {v}: must be > 0" + " (greedy is for --val-temperature)" * (opt == "temperature"))
    if cfg.rollout_logprobs_every < 0 or (cfg.rollout_correction == "tis" and cfg.rollout_logprobs_every > 1):
        raise UserError(f"--rollout-logprobs-every {cfg.rollout_logprobs_every}: 0 (auto) or K >= 1, and 0 or 1 with "
                        "--rollout-correction tis (it weights every sample by the engine's log-probs)")
    if cfg.lora_target_experts and cfg.lora_rank <= 0:
        raise UserError("--lora-target-experts puts LoRA adapters on the experts: it needs --lora-rank > 0")
    if cfg.ulysses_size < 1 or world % cfg.ulysses_size:
        raise UserError(f"--ulysses-size {cfg.ulysses_size}: must divide the number of ranks ({world})")
    for opt, v in {"rollout-n": cfg.n, "rollout-batch-size": cfg.rollout_batch_size,
                   "global-batch-size": cfg.global_batch_size, "ppo-epochs": cfg.ppo_epochs}.items():
        if v < 1:
            raise UserError(f"--{opt} {v}: must be at least 1")
    rb, gb = cfg.rollout_batch_size, cfg.global_batch_size
    if gb > rb:
        raise UserError(f"--global-batch-size {gb} is larger than --rollout-batch-size {rb}: an optimizer step cannot "
                        "use more prompts than a rollout step makes; lower it")
    if rb % gb or gb % world:  # then world divides rollout_batch_size too
        raise UserError(f"--global-batch-size {gb} must divide --rollout-batch-size {rb} and be a multiple of the "
                        f"number of ranks ({world})")
    if not 0 < cfg.gpu_memory_utilization <= 1 or cfg.kv_cache_memory_gb < 0:
        raise UserError(f"--gpu-memory-utilization {cfg.gpu_memory_utilization} / --kv-cache-memory-gb "
                        f"{cfg.kv_cache_memory_gb}: the first is a share of the GPU in (0, 1], the second GiB >= 0")
    if (cfg.checkpoint_layers != "auto" and not 0 <= cfg.checkpoint_layers <= 1) \
            or cfg.logprob_max_token_len_per_device < 0:
        raise UserError(f"--checkpoint-layers {cfg.checkpoint_layers} / --logprob-max-token-len-per-device "
                        f"{cfg.logprob_max_token_len_per_device}: the first is a share in [0, 1] or auto, the second "
                        ">= 0")
    if cfg.sleep_level not in (1, 2, "auto"):
        raise UserError(f"--sleep-level {cfg.sleep_level}: 1 (weights kept in host memory), 2 (dropped, re-sent) "
                        "or auto")
    if cfg.precision == "bf16" and cfg.dtype == "fp32":
        raise UserError("--precision bf16 computes in bf16: drop --dtype fp32 (or use --precision amp)")
    data.check_model_path(cfg.model_path)
    data.check_source(cfg.train_files, "--train-files")
    data.check_source(cfg.val_files, "--val-files")
    try:  # a run that cannot write its checkpoints should fail now, not after its first hour
        os.makedirs(cfg.output_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=cfg.output_dir).close()
    except OSError as e:
        raise UserError(f"--output-dir {cfg.output_dir}: cannot write there ({e.strerror or e})") from e

