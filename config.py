"""config.py -- the options of grpo.py (dapo.py's DAPOConfig adds its own): one tyro dataclass, its comments the
--help text. The defaults are EasyR1's (examples/config.yaml); the demos' (tiny_model.DEMO, TEXT_DEMO, VIDEO_DEMO)
go over them where a flag does not say otherwise. easyr1_config.py reads EasyR1's YAML into these and checks them."""
from dataclasses import dataclass, field
from typing import Annotated, Literal

import tyro

from common import LORA_EXCLUDE, MAX_PIXELS, MIN_PIXELS


@dataclass
class Config:
    # --- model and data (empty model_path / train_files = the built-in demo) ---
    model_path: str = ""  # HF hub name or local folder; "" builds the tiny demo VLM in code
    # the demo's tiny model (no model_path): qwen2_5_vl / qwen3_vl (colour or video task), qwen2_vl / qwen3_vl_moe /
    # qwen3_5 / qwen3_5_moe (colour; Qwen3.5: Gated DeltaNet hybrid), gemma4 / internvl (colour; the generic path
    # for other image-text families), qwen3 / llama (largest digit)
    demo_model: Literal["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "gemma4",
                        "internvl", "qwen3", "llama"] = "qwen2_5_vl"
    # the VL demos' task: a picture's colour, a clip's last colour, or a dot's colour seen through the zoom tool
    demo_task: Literal["color", "video", "zoom"] = "color"
    train_files: str = ""  # hub "name@split", a parquet/json/jsonl file or a folder; "" = the synthetic colour task
    val_files: str = ""  # validation data, same forms; "" = none (the demo: 200 unseen pictures)
    prompt_key: str = "problem"  # column with the question text (<image> marks where each image goes)
    answer_key: str = "answer"  # column with the ground truth the reward function compares against
    image_key: str = "images"  # column with the list of images (bytes, paths or PIL images)
    image_dir: str | None = None  # folder that relative image (and video) paths in the data start from
    video_key: str = "videos"  # column with the list of videos (each a video file path or a list of frames)
    video_fps: float = 2.0  # frames per second taken from a video file; a list of frames is taken to be this far apart
    max_frames: int = 768  # frames per video at most (evenly spread over it when it has more)
    video_min_pixels: int | None = None  # pixels per frame at least (Qwen3-VL: per clip); None = min_pixels
    video_max_pixels: int | None = None  # pixels per frame at most (Qwen3-VL: per clip); None = max_pixels (EasyR1)
    format_prompt: str | None = None  # jinja template (string or .jinja file) around {{ content }}
    reward_function: str = "math"  # math | r1v | color | dapo | path/to/file.py:fn (an EasyR1 reward file)
    reward_function_kwargs: str = ""  # JSON object of keyword arguments for the reward function, as EasyR1's
    max_prompt_length: int = 2048  # prompt tokens, image tokens included
    max_response_length: int = 2048  # generated tokens per sample at most
    min_pixels: int = MIN_PIXELS  # smaller images are scaled up to this many pixels (keeping their aspect)
    max_pixels: int = MAX_PIXELS  # larger images are scaled down to this many pixels
    filter_overlong_prompts: bool = True  # drop (and list) prompts over max_prompt_length; off: they are bad rows
    skip_bad_rows: bool = False  # drop rows the data check rejects (and list them) instead of stopping
    # --- tools: multi-turn rollouts (tools.py; README "Tools") ---
    tools: str = ""  # a tools file (its functions: type hints and a docstring) or a built-in (zoom); "" = one turn
    max_turns: int = 4  # the model's turns per sample at most (1: one answer, a tool call in it is not run)
    max_turn_tokens: int = 0  # the model's tokens per turn; 0 = all --max-response-length (with tools: the budget of
    # the whole trajectory after the prompt, the model's and the tools' tokens)
    tool_timeout: float = 10.0  # seconds per tool call; a call that takes longer answers that it timed out
    # --- rollout ---
    rollout_engine: Literal["auto", "vllm", "hf"] = "auto"  # auto = vllm when it imports and CUDA is there, else hf
    n: Annotated[int, tyro.conf.arg(aliases=("--rollout-n", "--num-generations"), help=(
        "samples per prompt (the group); under torchrun spell it --rollout-n: torchrun reads --n as its --nnodes"))] = 5
    temperature: float = 1.0  # sampling temperature of the training rollouts (> 0)
    top_p: float = 1.0  # nucleus sampling of the training rollouts; 1 = off
    val_temperature: float = 0.0  # sampling temperature of validation; 0 = greedy (EasyR1's example: 0.6, top_p 0.95)
    val_top_p: float = 1.0  # nucleus sampling of validation
    val_n: int = 1  # answers per validation prompt: val/mean over all, val/pass@n per prompt
    tensor_parallel_size: int = 1  # vLLM tensor parallelism; data parallel engines = world size / this
    gpu_memory_utilization: float = 0.6  # share of GPU memory vLLM may take for weights and KV cache
    kv_cache_memory_gb: float = 0.0  # vLLM's KV cache (GiB) set, not profiled: runs can share a GPU; 0 = measured
    max_num_batched_tokens: int = 8192  # vLLM: tokens per engine step
    enforce_eager: bool = False  # vLLM without CUDA graphs (slower, starts faster)
    # 1: the engine's weights wait in host memory while training; 2: dropped, re-sent before generating; auto: 2 for
    # full fine-tuning (every weight is re-sent anyway), 1 with LoRA (and --debug-skip-sync)
    sleep_level: int | Literal["auto"] = "auto"
    # each prompt's samples seeded from its place in the data: the same run on any layout and on resume (vLLM's V1
    # runner, Qwen3.5's and MoE models': each call seeded from its prompts' seeds); off: vLLM seeds each request
    per_prompt_seeds: bool = True
    # vLLM's intake of the next step's requests (its processor on every image) on the prefetch thread while this step
    # trains. auto: where it can (tensor parallel 1); on: the same, and one line where it cannot; off: when generating
    prefetch_requests: Literal["auto", "on", "off"] = "auto"
    limit_images: int = 1  # images per prompt the engine accepts (EasyR1's limit_images); raise for multi-image data
    limit_videos: int = 0  # videos per prompt the engine accepts; 0 = the most any training or validation row has
    # --- batch arithmetic (EasyR1's names: batch sizes count prompts, micro-batches count samples) ---
    rollout_batch_size: int = 512  # prompts per step, over all ranks
    global_batch_size: int = 128  # prompts per optimizer step; rollout_batch_size / global_batch_size updates per step
    ppo_epochs: int = 1  # passes over each rollout batch
    micro_batch_size_per_device: int = 64  # samples per forward/backward, at most
    max_token_len_per_device: int = 16384  # padded tokens per forward/backward, at most
    # the no-grad old/reference log-prob passes' tokens per forward, no sample cap (veRL's
    # log_prob_max_token_len_per_gpu); 0 = the update's bounds
    logprob_max_token_len_per_device: int = 0
    # --- optimisation ---
    lr: float = 1e-6  # AdamW learning rate; the demo's tiny model, trained from scratch, uses 1e-3
    weight_decay: float = 1e-2  # AdamW's decoupled weight decay
    lr_warmup_steps: int = 0  # optimizer steps of linear warmup, then constant
    lr_warmup_ratio: float = 0.0  # warm-up as a share of all optimizer steps (when lr_warmup_steps is 0; EasyR1's)
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"  # after warm-up: constant, or EasyR1's cosine decay
    min_lr_ratio: float = 0.0  # cosine: the learning rate ends at lr x this
    max_grad_norm: float = 1.0  # clip the gradient norm; a step with a non-finite norm is skipped
    max_skipped_steps: int = 3  # stop when this many optimizer steps in a row were skipped; 0 = never stop
    # --- the algorithm ---
    adv_estimator: Annotated[Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                     "grpo_passk", "remax"],
                             tyro.conf.arg(help="rewards -> advantages; veRL's names and formulas: reinforce_plus_plus "
                                           "has no group baseline, reinforce_plus_plus_baseline removes the group "
                                           "mean; grpo_passk credits only each group's best; remax: a greedy response "
                                           "per prompt is the baseline (README: Algorithms)")] = "grpo"
    # policy loss: per-token ratio / sequence ratio (gspo_token: EasyR1's name for it, dual-clipped) / CISPO / SAPO
    loss_type: Literal["ppo_clip", "gspo", "gspo_token", "cispo", "sapo"] = "ppo_clip"
    loss_avg_mode: Literal["token", "seq", "seq-mean-token-sum-norm"] = "token"  # how token losses are averaged
    clip_ratio_low: float = 0.2  # PPO clip: the ratio may fall to 1 - this
    clip_ratio_high: float = 0.3  # PPO clip: the ratio may rise to 1 + this
    clip_ratio_dual: float = 3.0  # dual clip: bounds the loss of negative-advantage tokens with huge ratios
    gspo_dual_clip: bool = False  # also dual-clip GSPO's sequence ratio, as EasyR1 does (the paper and veRL do not)
    cispo_clip_low: bool = False  # bound CISPO's weight below by 1 - clip_ratio_low, as EasyR1/veRL (the paper: none)
    tau_positive: float = 1.0  # SAPO's gate temperature for positive advantages (EasyR1's default)
    tau_negative: float = 1.05  # SAPO's for negative advantages: a steeper fade
    # MoE: weight of the router's load-balancing loss (the config's router_aux_loss_coef formula); 0 = off, RL's
    # default: a balancing pull moves the policy for a reason other than the reward
    router_aux_loss_coef: float = 0.0
    kl_coef: float = 1e-2  # weight of the KL-to-reference loss term; 0 drops the reference model entirely
    entropy_coeff: float = 0.0  # veRL's: the loss minus this x the policy's tokens' mean entropy (a bonus)
    kl_penalty: Literal["k1", "k2", "k3", "low_var_kl", "abs"] = "low_var_kl"  # KL estimator (k3 = low_var_kl)
    kl_in_reward: bool = False  # the KL penalty goes into the reward (EasyR1's use_kl_loss: false), not into the loss
    kl_type: Literal["fixed", "adaptive"] = "fixed"  # kl_in_reward: adaptive moves kl_coef towards kl_target
    kl_target: float = 0.1  # adaptive KL: the per-token KL aimed at
    kl_horizon: float = 10000.0  # adaptive KL: samples over which the coefficient may change by 20%
    # dynamic sampling (DAPO's; EasyR1's online_filtering): generate until the batch holds rollout_batch_size groups
    filter_groups: bool = False  # keep only groups whose filter_key scores differ (dapo.py: on)
    filter_key: str = "overall"  # the score a group must vary in (EasyR1's filter_key; veRL's "acc"; dapo.py: accuracy)
    filter_low: float | None = 0.01  # keep the groups whose mean filter_key is above this (EasyR1's rule)
    filter_high: float | None = 0.99  # ... and below this; both None: the groups whose scores are not all equal
    gen_batch_size: int = 0  # prompts per try, all ranks together; 0 = rollout_batch_size (dapo.py: 3 x, the paper's)
    max_try_make_batch: int = 20  # tries before giving up with an error; 0 = unlimited
    # truncated importance sampling from the engine's own log-probs (veRL's rollout_is, TRL's vllm_importance_sampling)
    rollout_correction: Literal["none", "tis"] = "none"  # tis: weight each token's loss by pi_old / pi_engine, capped
    rollout_correction_level: Literal["token", "sequence"] = "token"  # one weight per token, or per sequence
    rollout_correction_cap: float = 2.0  # weights above it are truncated to it (veRL's rollout_is_threshold)
    # the engine returns log-probs for one training prompt in K (all with tis): the agreement metric needs a sample,
    # each token costs vLLM's loop ~7 us (BENCHMARKS.md, 2026-12-02); 0 = auto: 1 with --rollout-correction tis, else 8
    rollout_logprobs_every: int = 0
    # --- engineering ---
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # compute dtype; auto = bf16 on GPU, fp32 on CPU
    precision: Literal["amp", "bf16"] = "amp"  # amp: fp32 master weights, compute in --dtype; bf16: weights, gradients and AdamW state in bf16 (10 bytes per parameter against 16; README: Memory modes)
    bf16_rounding: Literal["kahan", "stochastic", "nearest"] = "kahan"  # how --precision bf16 keeps updates below half a bf16 ulp (nearest loses them; README: Memory modes)
    offload_params: bool = False  # policy weights, gradients and AdamW state on the host (FSDP2's CPUOffloadPolicy; the step runs there), and the reference model between its uses
    offload_optimizer: bool = False  # AdamW state on the host between optimizer steps (in for the step, out after it)
    freeze_vision_tower: bool = False  # train the language model only (the vision tower keeps its weights)
    lora_rank: int = 0  # LoRA (peft) rank; 0 = full fine-tuning. With LoRA only adapters train: the vision tower is frozen unless targeted
    lora_alpha: int = 64  # LoRA scale = alpha / rank (EasyR1's default)
    lora_target_modules: str = "all-linear"  # comma-separated module names, or peft's "all-linear"
    lora_exclude_modules: str = LORA_EXCLUDE  # regex of modules left without adapters (the vision towers)
    lora_modules_to_save: str = ""  # comma-separated modules trained in full beside the adapters (peft's), e.g. lm_head
    # MoE: LoRA on the experts' fused 3-D tensors too (peft's target_parameters, r per expert); off: attention only
    # (the experts are not nn.Linear, so all-linear leaves them frozen). An error on a model without experts
    lora_target_experts: bool = False
    gradient_checkpointing: bool = True  # recompute activations in backward: less memory, ~1/3 more compute
    # with gradient checkpointing: the share of decoder layers that recompute (the first, rounded up). 1 = all; auto:
    # as few as fit this GPU by the memory model with its 15 % error bound (1 where it does not know it, or on the CPU)
    checkpoint_layers: float | Literal["auto"] = 1.0
    attn_implementation: str | None = None  # e.g. flash_attention_2; None = transformers' default (sdpa)
    padding_free: Literal["auto", "on", "off"] = "auto"  # one packed row per micro-batch (varlen attention); auto: where a fast kernel runs
    # padding-free rows hold each prompt once, its n samples' responses after it (exact: the n copies of the prompt
    # computed the same thing); 26% fewer tokens per step on the 3B bar's 424-token prompts x 8 samples x 1024
    share_prompts: bool = True
    vision_varlen: Literal["auto", "on", "off"] = "auto"  # the vision tower's windows in one attention call per layer
    torch_compile: Literal["auto", "on", "off"] = "auto"  # fused norm/MLP/rotary/log-prob kernels; auto: CUDA, bf16, hidden >= 1024
    logprob_chunk_size: int = 4096  # tokens per chunk of the vocabulary projection (memory vs speed)
    # Ulysses sequence parallelism: K ranks train each packed row together (each 1/K of its tokens; all-to-all around
    # attention), micro-batches of up to K x --max-token-len-per-device; data parallel over world / K. K divides the
    # ranks and the attention heads; Qwen2-VL, Qwen2.5-VL, Qwen3-VL and text LLMs
    ulysses_size: int = 1
    peak_tflops: float = 989.0  # per GPU, for perf/mfu_*: H100/H200 dense bf16 (the figure veRL and EasyR1 use)
    # --- trainer ---
    max_steps: int = 0  # training steps (one rollout batch each); 0 = total_epochs passes over the training data
    total_epochs: int = 15  # EasyR1's: used when max_steps is 0
    val_freq: int = 5  # validate every k steps and at the end; 0 = never
    val_before_train: bool = True  # validate once before the first step
    val_max_rows: int = 0  # validate on the first k rows; 0 = the whole validation set
    save_freq: int = 5  # checkpoint every k steps and at the end; 0 = only at the end; -1 = never (benchmarks)
    save_limit: int = 3  # keep the newest k checkpoints (12 bytes/param each) and the best by val/mean; 0 = all
    output_dir: str = "outputs/run"  # metrics, samples, config and checkpoints go here
    resume: str = "auto"  # auto (the newest checkpoint of output_dir) | never (a new run only) | checkpoints/step_N
    config: str | None = None  # an EasyR1 YAML config (examples/config.yaml, unchanged); flags override it
    seed: int = 1  # data order, sampling seeds and initialisation
    shuffle: bool = True  # one seeded permutation of the training rows per epoch (EasyR1's data.shuffle); False: file order
    log_samples: int = 4  # generations written to samples.jsonl per step
    logger: Annotated[list[Literal["console", "jsonl", "tensorboard", "wandb", "swanlab", "mlflow"]], tyro.conf.arg(
        help="trackers; jsonl always on; wandb, swanlab offline without an API key; mlflow: output_dir/mlflow.db")] = field(
        default_factory=lambda: ["console", "jsonl"])
    project_name: str = "vlm_rl"  # for wandb
    experiment_name: str = ""  # for wandb; "" = the output folder's name
    debug_skip_sync: bool = False  # never send new weights to the engine: rollout/logprob_diff_* must then grow


def bf16_compute(cfg, cuda):
    """Whether the matmuls run in bf16 (pure bf16 always; --dtype auto: on a GPU), else fp32."""
    return cfg.precision == "bf16" or cfg.dtype == "bf16" or (cfg.dtype == "auto" and cuda)
