"""benchmarks/memory_profile.py, under the command the docs have always given:

    python src/memory_profile.py --model resnet18 --batch_size 64 --bf16
    deepspeed --num_gpus 2 src/memory_profile.py --model wide_resnet50_2 --bf16
"""
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_profile.py"
    sys.path.insert(0, str(script.parent))
    sys.argv[0] = str(script)
    runpy.run_path(str(script), run_name="__main__")
