#!/usr/bin/env bash
# Train with DeepSpeed; extra arguments go to launch_deepspeed.py, e.g.
#   bash train_deepspeed.sh --num_gpus 2 --bf16 --epochs 30
# Set PYTHON to choose the interpreter (default: python3 on the PATH).
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/launch_deepspeed.py" "$@"
