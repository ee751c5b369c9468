#!/usr/bin/env bash
# Launch recipes. Pick one: `bash run.sh demo|demo2|qwen25vl_7b|qwen35_9b|lora_7b_40gb|multinode|dapo [extra grpo.py
# options]`.
# Options after the recipe name are appended to its own (the last spelling of an option wins).
# Batch sizes count prompts (EasyR1's convention); grpo.py prints the derived arithmetic at start.
set -euo pipefail
cd "$(dirname "$0")"
recipe="${1:-demo}"
shift $(( $# > 0 ? 1 : 0 ))
case "$recipe" in
  demo)  # CPU or one GPU: tiny VLM built in code + synthetic colour task, nothing downloaded
    python grpo.py "$@" ;;
  demo2)  # the same demo sharded over 2 processes (gloo on CPU, NCCL on GPUs)
    torchrun --standalone --nproc_per_node 2 grpo.py --output-dir outputs/demo2 "$@" ;;
  qwen25vl_7b)  # one node, 8 GPUs: geometry3k with Qwen2.5-VL-7B (EasyR1's example recipe)
    torchrun --standalone --nproc_per_node 8 grpo.py \
      --model-path Qwen/Qwen2.5-VL-7B-Instruct \
      --train-files hiyouga/geometry3k@train --val-files hiyouga/geometry3k@test \
      --format-prompt '{{ content }} You FIRST think about the reasoning process as an internal monologue and then provide the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \boxed{}.' \
      --reward-function math --max-prompt-length 2048 --max-response-length 2048 \
      --min-pixels 3136 --max-pixels 1003520 \
      --rollout-batch-size 512 --global-batch-size 128 --rollout-n 5 --temperature 1.0 --top-p 1.0 \
      --micro-batch-size-per-device 16 --max-token-len-per-device 16384 \
      --lr 1e-6 --kl-coef 1e-2 --kl-penalty low_var_kl --clip-ratio-low 0.2 --clip-ratio-high 0.3 \
      --tensor-parallel-size 2 --gpu-memory-utilization 0.6 \
      --max-steps 300 --val-freq 5 --save-freq 5 --output-dir outputs/qwen25vl_7b_geo3k "$@" ;;
  qwen35_9b)  # one node, 8 GPUs: geometry3k with Qwen3.5-9B (hybrid Gated DeltaNet; pip install fla-core), from
    # examples/qwen3_5_9b_geo3k.yaml (EasyR1's config layout); options after the recipe name still win
    torchrun --standalone --nproc_per_node 8 grpo.py --config examples/qwen3_5_9b_geo3k.yaml "$@" ;;
  lora_7b_40gb)  # ONE 40 GB GPU: Qwen2.5-VL-7B with LoRA (rank 64) in pure bf16. Measured as bench.py's 7B cell on an
    # H200 capped to 40 GB (README, Memory modes): the KV cache fixed at 1.5 GB leaves room for the engine's activations
    # beside the trainer; 8k-token micro-batches. LoRA's usual lr is ~10x full fine-tuning's.
    python grpo.py \
      --model-path Qwen/Qwen2.5-VL-7B-Instruct \
      --train-files hiyouga/geometry3k@train --val-files hiyouga/geometry3k@test \
      --format-prompt '{{ content }} Think step by step, then put the final answer in \boxed{}.' \
      --reward-function math --max-prompt-length 1024 --max-response-length 1024 \
      --min-pixels 3136 --max-pixels 262144 \
      --rollout-batch-size 32 --global-batch-size 16 --rollout-n 5 \
      --lora-rank 64 --lora-alpha 64 --precision bf16 --lr 1e-5 --kl-coef 1e-2 \
      --max-token-len-per-device 8192 --kv-cache-memory-gb 1.5 \
      --max-steps 300 --val-freq 10 --save-freq 10 --output-dir outputs/qwen25vl_7b_lora_40gb "$@" ;;
  multinode)  # N nodes x 8 GPUs through torchrun's rendezvous: run the same line on every node.
    # NNODES, MASTER_ADDR (the first node's address) must be set; NPROC_PER_NODE (8), MASTER_PORT (29400, the
    # rendezvous port), RDZV_ID and LOCAL_ADDR (the address this node gives the others; default: its hostname)
    # may be. tests/test_multirank.py runs it as two 1-process nodes on 127.0.0.1.
    : "${NNODES:?set NNODES}" "${MASTER_ADDR:?set MASTER_ADDR (the first node)}"
    torchrun --nnodes "$NNODES" --nproc_per_node "${NPROC_PER_NODE:-8}" --rdzv_backend c10d \
      --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29400}" --rdzv_id "${RDZV_ID:-vlm_rl}" \
      ${LOCAL_ADDR:+--local-addr "$LOCAL_ADDR"} grpo.py \
      --model-path Qwen/Qwen2.5-VL-7B-Instruct \
      --train-files hiyouga/geometry3k@train --val-files hiyouga/geometry3k@test --reward-function math \
      --max-response-length 2048 --rollout-batch-size 512 --global-batch-size 128 --rollout-n 5 --lr 1e-6 \
      --tensor-parallel-size 2 --output-dir outputs/multinode "$@" ;;
  dapo)  # DAPO on the demo task
    python dapo.py "$@" ;;
  *) echo "unknown recipe $recipe (demo|demo2|qwen25vl_7b|qwen35_9b|lora_7b_40gb|multinode|dapo)"; exit 2 ;;
esac
