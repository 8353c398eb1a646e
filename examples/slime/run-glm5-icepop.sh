#!/bin/bash
# GLM-5-style (744B-A40B, MLA + DSA, 256 experts top-8) RL with slime on H100 nodes, with the
# IcePop loss, the OPD advantage and the SGLang delta loader of glm_kernels plugged in through
# slime's --custom-*-path flags. Every flag is explained in examples/slime/README.md.
#
#   MODE=loss  bash run-glm5-icepop.sh   # GRPO + IcePop as slime's custom loss (default)
#   MODE=tis   bash run-glm5-icepop.sh   # slime's PPO loss + glm_kernels' IcePop TIS weight
#   MODE=opd   bash run-glm5-icepop.sh   # on-policy distillation, A = log pi_T - log pi_S
#   SYNC=delta MODE=... bash run-glm5-icepop.sh   # separate rollout nodes, weights synced as
#                                                 # byte deltas diffed on the GPU by glm_kernels
#
# Needs: a slime checkout at $SLIME_DIR (tested against THUDM/slime @ 624b824 for flag names;
# not run here: no GPU was available to this project), Megatron-LM on PYTHONPATH, a running
# Ray cluster over all nodes, glm_kernels installed on every node (pip install .[triton]).
set -euo pipefail

MODE=${MODE:-loss}
SLIME_DIR=${SLIME_DIR:-/root/slime}
BASE_DIR=${BASE_DIR:?set BASE_DIR to the shared directory with checkpoints and data}
NUM_NODES=${NUM_NODES:-32}           # 32 x 8 H100 80GB = 256 GPUs for 744B-A40B
GPUS_PER_NODE=8

# Architecture flags (layers, MLA ranks, MoE routing, DSA) come from slime's model file.
source "${SLIME_DIR}/scripts/models/glm5-744B-A40B.sh"   # defines MODEL_ARGS

CKPT_ARGS=(
  --hf-checkpoint "${BASE_DIR}/GLM-5"             # HF weights: tokenizer + the SGLang engine
  --ref-load "${BASE_DIR}/GLM-5_torch_dist"       # Megatron torch_dist checkpoint (reference)
  --load "${BASE_DIR}/GLM-5_icepop"               # resume from here if it exists
  --save "${BASE_DIR}/GLM-5_icepop"
  --save-interval 20
)

ROLLOUT_ARGS=(
  --prompt-data "${BASE_DIR}/dapo-math-17k/dapo-math-17k.jsonl"
  --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
  --rm-type deepscaler                            # verifiable math reward: 1 pass, 0 fail
  --num-rollout 3000
  --rollout-batch-size 8 --n-samples-per-prompt 8 # 8 prompts x G = 8 samples each
  --global-batch-size 64                          # one optimizer step per rollout batch
  --rollout-max-response-len 32768
  --rollout-temperature 1                         # the loss divides logits by the same T
)

PARALLEL_ARGS=(
  --tensor-model-parallel-size 4 --sequence-parallel   # logits reach the loss vocab-sharded
  --pipeline-model-parallel-size 4 --decoder-last-pipeline-num-layers 18
  --expert-model-parallel-size 32 --expert-tensor-parallel-size 1
  --context-parallel-size 2                       # with --allgather-cp from MODEL_ARGS
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --use-dynamic-batch-size --max-tokens-per-gpu 16384
  --data-pad-size-multiplier 4096
)

OPTIMIZER_ARGS=(
  --optimizer adam --lr 1e-6 --lr-decay-style constant
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
  --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer
)

# IcePop: gate [1/beta, beta] with beta = 2 on slime's TIS flags; asymmetric PPO clip.
ICEPOP_ARGS=(
  --advantage-estimator grpo
  --kl-coef 0.00 --kl-loss-coef 0.00 --entropy-coef 0.00
  --eps-clip 0.2 --eps-clip-high 0.28
  --tis-clip-low 0.5 --tis-clip 2.0
)
case "${MODE}" in
  loss)   # coupled IcePop on the rollout's own log-probs: no recompute forward
    ICEPOP_ARGS+=(
      --loss-type custom_loss
      --custom-loss-function-path glm_kernels.integrations.slime.icepop_loss_function
      --use-rollout-logprobs
    ) ;;
  tis)    # decoupled IcePop: slime recomputes old log-probs, glm_kernels gates the mismatch
    ICEPOP_ARGS+=(
      --use-tis
      --custom-tis-function-path glm_kernels.integrations.slime.icepop_tis_function
    ) ;;
  opd)    # GLM-5 OPD: teacher log-probs from an SGLang teacher server, no outcome reward
    ICEPOP_ARGS+=(
      --loss-type custom_loss
      --custom-loss-function-path glm_kernels.integrations.slime.icepop_loss_function
      --use-rollout-logprobs
      --use-opd --opd-type sglang --opd-kl-coef 0
      --custom-advantage-function-path glm_kernels.integrations.slime.opd_log_ratio_advantages
      --custom-rm-path slime.rollout.on_policy_distillation.reward_func
      --custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards
      --rm-url "${TEACHER_URL:?set TEACHER_URL to the teacher SGLang server /generate URL}"
      --n-samples-per-prompt 1 --global-batch-size 8
    ) ;;
  *) echo "MODE must be loss, tis or opd (got ${MODE})" >&2; exit 2 ;;
esac

SGLANG_ARGS=(
  --rollout-num-gpus-per-engine 64                # one engine spans 8 nodes (DP-attention)
  --sglang-mem-fraction-static 0.70
  --sglang-enable-dp-attention --sglang-dp-size 64 --sglang-ep-size 64
  --sglang-moe-dense-tp-size 1 --sglang-enable-dp-lm-head
  --sglang-moe-a2a-backend deepep --sglang-deepep-mode auto
  --sglang-page-size 64 --sglang-attention-backend nsa
  --sglang-nsa-decode-backend flashmla_sparse --sglang-nsa-prefill-backend flashmla_sparse
  --sglang-cuda-graph-max-bs 8 --sglang-max-running-requests 512
  --sglang-chunked-prefill-size 131072 --sglang-watchdog-timeout 3600
  # Registers glm_kernels' delta loader in every engine: update_weights_from_tensor(...,
  # load_format="glm_kernels.integrations.sglang.load_delta_frames") then applies delta
  # frames in place. slime's own updaters do not send that load_format (see README).
  --sglang-custom-weight-loader glm_kernels.integrations.sglang.load_delta_frames
)

MISC_ARGS=(
  --attention-dropout 0.0 --hidden-dropout 0.0
  --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
  --moe-enable-deepep --moe-token-dispatcher-type flex
  --update-weight-buffer-size $((2 * 1024 * 1024 * 1024))
)

case "${SYNC:-colocate}" in
  colocate)
    SYNC_ARGS=(--colocate)                        # training and rollout share the GPUs
    ;;
  delta)
    # Rollout on its own ROLLOUT_NODES; each sync is published as zstd byte deltas on a shared
    # filesystem and patched into every rollout host's local checkpoint by slime's SGLang
    # /pull_weights. install() makes the trainer diff on the GPU (only changed bytes leave it).
    SYNC_ARGS=(
      --rollout-num-gpus $(( ${ROLLOUT_NODES:-8} * GPUS_PER_NODE ))
      --update-weight-mode delta --update-weight-transport disk
      --update-weight-disk-dir "${DELTA_DIR:-/shared/glm5-delta}"
      --update-weight-local-checkpoint-dir "${LOCAL_CKPT_DIR:-/local/nvme/glm5}"
      --update-weight-delta-encoding xor --update-weight-delta-checksum xxh3-128
      --custom-megatron-init-path glm_kernels.integrations.slime_delta.install
    )
    # Device memory each trainer rank may keep for the GPU diff's snapshots (empty: host
    # diff). An example value: check the training step's peak memory before raising it.
    DELTA_DEVICE_BYTES=${DELTA_DEVICE_BYTES:-4000000000}
    ;;
  *) echo "SYNC must be colocate or delta (got ${SYNC})" >&2; exit 2 ;;
esac

RUNTIME_ENV_JSON="{\"env_vars\": {\"PYTHONPATH\": \"/root/Megatron-LM/\",
  \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\", \"NVSHMEM_DISABLE_NCCL\": \"1\",
  \"GLM_KERNELS_SLIME_DELTA_DEVICE_BYTES\": \"${DELTA_DEVICE_BYTES:-}\"}}"

cd "${SLIME_DIR}"
ray job submit --address="http://127.0.0.1:8265" --runtime-env-json="${RUNTIME_ENV_JSON}" \
  -- python3 train.py \
  --actor-num-nodes "${NUM_NODES}" --actor-num-gpus-per-node "${GPUS_PER_NODE}" \
  "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
  "${OPTIMIZER_ARGS[@]}" "${ICEPOP_ARGS[@]}" "${SGLANG_ARGS[@]}" "${MISC_ARGS[@]}" \
  "${SYNC_ARGS[@]}"
