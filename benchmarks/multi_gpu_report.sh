#!/usr/bin/env bash
# The multi-GPU results in benchmarks/results/, on a host with 2 GPUs, in two parts of under 10 minutes:
#
#   bash benchmarks/multi_gpu_report.sh speed  OUT   # scaling.py: DDP, ZeRO 0-3, offload, real epochs; 1 vs 2 GPUs
#   bash benchmarks/multi_gpu_report.sh memory OUT   # scaling.py's accuracy runs; memory_profile.py on 1 and 2 GPUs
#
# Everything is written under OUT (default benchmarks/results); each part prints its tables last.
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:?speed or memory}
out=${2:-benchmarks/results}
mkdir -p "$out"

case "$part" in
speed)
    python3 benchmarks/scaling.py --only reference synthetic real --steps 40 --warmup_steps 10 --epochs 3 \
        --output_dir "$out"
    ;;
memory)
    tables=()
    # ResNet18: activations dominate; wide_resnet101_2 (127 M parameters) at a small batch: model states do.
    for model in "resnet18 64" "wide_resnet101_2 8"; do
        set -- $model
        python3 src/memory_profile.py --model "$1" --batch_size "$2" --bf16 --output_dir "$out" > "$out/memory_$1_x1.log"
        deepspeed --num_gpus 2 src/memory_profile.py --model "$1" --batch_size "$2" --bf16 --output_dir "$out" \
            > "$out/memory_$1_x2.log" 2>&1
        tables+=("$out/memory_$1_x1.log" "$out/memory_$1_x2.log")
    done
    # The largest micro-batch per configuration on one GPU limited to 8 GiB, as on a smaller card.
    python3 src/memory_profile.py --model wide_resnet50_2 --bf16 --find_max_batch --gpu_memory_gib 8 --batch_size 4 \
        --output_dir "$out/max_batch_8gib" > "$out/max_batch_wide_resnet50_2.log"
    tables+=("$out/max_batch_wide_resnet50_2.log")
    # 8 epochs: the sample data is learned to 100% validation accuracy by epoch 30 on any GPU count
    python3 benchmarks/scaling.py --only accuracy --accuracy_epochs 8 --output_dir "$out" > "$out/accuracy.log"
    tail -n 14 "$out/accuracy.log"
    for table in "${tables[@]}"; do sed -n '/ rank(s) on /,$p' "$table"; done
    ;;
*)
    echo "error: the part is 'speed' or 'memory', not '$part'" >&2
    exit 2
    ;;
esac
