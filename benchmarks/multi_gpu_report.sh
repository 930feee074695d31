#!/usr/bin/env bash
# The multi-GPU results in benchmarks/results/, on a host with 2 GPUs (GPUS=4 for 4, and so on), in parts of under
# 10 minutes each:
#
#   bash benchmarks/multi_gpu_report.sh steps MODEL OUT   # scaling.py: DDP and the trainer's step per ZeRO stage, 1 vs 2 GPUs
#   bash benchmarks/multi_gpu_report.sh epochs MODEL OUT  # scaling.py: end-to-end epochs, ZeRO 0-3 data on GPU, ZeRO-2 cache
#   bash benchmarks/multi_gpu_report.sh sync_bn - OUT     # scaling.py: --sync_bn beside DDP with torch's SyncBatchNorm
#   bash benchmarks/multi_gpu_report.sh accuracy - OUT    # scaling.py: same global batch on 1 and 2 GPUs, with and without --sync_bn
#   bash benchmarks/multi_gpu_report.sh resume - OUT      # scaling.py: ZeRO-2 and 3 runs saved on 1 GPU resumed on 2, and back
#   bash benchmarks/multi_gpu_report.sh chain - OUT       # scaling.py: ZeRO-2 and 3 runs stopped mid-epoch, 1 -> 2 -> 1 GPUs
#                                                         # (CHAIN="2 4 1": on 2, then 4, finished on 1)
#   bash benchmarks/multi_gpu_report.sh memory - OUT      # memory_profile.py: vit_h_14 per ZeRO stage on 1 and 2 GPUs
#                                                         # (MEMORY_GPUS="4": on those counts only)
#   bash benchmarks/multi_gpu_report.sh shard MODEL OUT   # capacity.py: ZeRO-3 on 2 GPUs held to 8 GiB each
#   bash benchmarks/multi_gpu_report.sh giants MODEL OUT  # zero3_settings.py: a timm giant, the trainer's ZeRO-3
#                                                         # against FSDP2 (bf16 weights), into OUT/timm/zero3_xGPUS
#
# MODEL: resnet18 or vit_b_16 for steps and epochs (the two-GPU issue's); for shard, one of the ladder's models
# ZeRO-3 cannot train on one GPU held to 8 GiB (benchmarks/results/capacity_8gib): vit_l_16, vit_h_14 or
# regnet_y_128gf; for giants, vit_gigantic_patch14_clip_224 (micro-batch 32 a GPU), eva02_enormous_patch14_clip_224
# or vit_7b_patch16_dinov3 (16, which 4 H200s hold without activation checkpointing). OUT defaults to
# benchmarks/results. Each part prints its tables last and adds to its JSON (--update).
# The drawn dataset has 30 x GPUS images a class (80% train): each epoch has the same number of steps on N GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:?steps, epochs, sync_bn, accuracy, resume, chain, memory, shard or giants}
model=${2:--}
out=${3:-benchmarks/results}
gpus=${GPUS:-2}
mkdir -p "$out"
[ "$model" = - ] && model=  # the part's default

# one set of settings for every part: they add to one JSON per model (scaling.py --update refuses others)
# 8 accuracy epochs: the sample data is learned to 100% validation accuracy by epoch 30 on any GPU count
scaling=(python3 benchmarks/scaling.py --steps 40 --warmup_steps 10 --epochs 3 --accuracy_epochs 8 --output_dir "$out"
         --update --max_gpus "$gpus" --images_per_class $((30 * gpus)))

case "$part" in
steps)
    "${scaling[@]}" --model "${model:-resnet18}" --only reference synthetic
    ;;
epochs)
    "${scaling[@]}" --model "${model:-resnet18}" --only reference real
    ;;
sync_bn | accuracy | resume)
    "${scaling[@]}" --only "$part"
    ;;
chain)
    # shellcheck disable=SC2086  # CHAIN is three counts
    "${scaling[@]}" --only chain ${CHAIN:+--chain_gpus $CHAIN}
    ;;
memory)
    # vit_h_14 (631 M parameters) at a small micro-batch: the model states dominate; each ZeRO stage on 1 and 2 GPUs
    configs=("ZeRO-0 (DDP-like)" ZeRO-1 ZeRO-2 ZeRO-3)
    for n in ${MEMORY_GPUS:-1 $gpus}; do
        if [ "$n" = 1 ]; then
            python3 src/memory_profile.py --model vit_h_14 --batch_size 8 --bf16 --configs "${configs[@]}" \
                --output_dir "$out" > "$out/memory_vit_h_14_x1.log" 2>&1
        else
            deepspeed --num_gpus "$n" src/memory_profile.py --model vit_h_14 --batch_size 8 --bf16 \
                --configs "${configs[@]}" --output_dir "$out" > "$out/memory_vit_h_14_x$n.log" 2>&1
        fi
        sed -n '/ rank(s) on /,$p' "$out/memory_vit_h_14_x$n.log"
    done
    ;;
shard)
    python3 benchmarks/capacity.py --models "${model:-vit_h_14}" --gib 8 --num_gpus "$gpus" --configs ZeRO-3 \
        --output_dir "$out" --update
    ;;
giants)
    model=${model:-vit_gigantic_patch14_clip_224}
    case "$model" in vit_gigantic*) batch=32 ;; *) batch=16 ;; esac
    python3 benchmarks/zero3_settings.py --model "timm:$model" --batch_size "$batch" --num_gpus "$gpus" --half_weights \
        --steps 10 --warmup_steps 3 --case_timeout 240 --reference "torch bf16 FSDP2" \
        --variants "zero3 (trainer: blocks as leaf modules)" --output_dir "$out/timm/zero3_x$gpus"
    ;;
*)
    echo "error: the part is steps, epochs, sync_bn, accuracy, resume, chain, memory, shard or giants, not '$part'" >&2
    exit 2
    ;;
esac
