"""Validation accuracy of the two data paths over several seeds: does keeping the dataset on the device cost accuracy?

Every variant trains the real trainer (launch_deepspeed.py) on the built-in sample dataset with the same
settings and the same seeds; only the data flags differ. A seed fixes the model's initial weights and the
shuffle, so the comparison is paired by seed: the table gives each variant's last-epoch validation accuracy
per seed, its mean and standard deviation, and the mean difference to the DataLoader path with a 95%
interval (Student's t over the seeds). Before training it compares the pixels themselves: for the same
crop boxes, each device variant's training crops against torchvision's antialiased RandomResizedCrop of
the decoded image (what the DataLoader path feeds), as the mean absolute difference and the ratio of
high-frequency energy (variance of the Laplacian; below 1: blurrier, above 1: aliased), by crop area.
Runs on a CPU as well as a GPU (the device path keeps the tensors in RAM there); --jobs runs several
trainings at once (they are small), and --update adds runs to an earlier JSON, so the seeds can be
spread over several invocations. Prints the table last and writes JSON
to benchmarks/results/data_path_accuracy_<machine>.json.

    python benchmarks/data_path_accuracy.py --seeds 1 2 3 4 5 6 7 8 9 10 --jobs 6
    python benchmarks/data_path_accuracy.py --seeds 7 8 --variants "data on device" --update

With torchvision's new-recipe augmentation beside the same runs without it, paired by seed:

    python benchmarks/data_path_accuracy.py --variants "data on device" "data on device, recipe" --epochs 16 \
        --seeds 1 2 3 4 5 6 7 --jobs 14 --output_dir benchmarks/results/recipe_accuracy
"""
import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import functional as TF

from common import ROOT, draw_sample_data, earlier_results, environment, run_trainer, settings_of, shown
from deepspeed_image_trainer.data.device import ResizedCrops, random_resized_crops, resize_and_crop, train_square_size
from machine import machine_slug

REFERENCE = "DataLoader"
VARIANTS = {
    REFERENCE: ["--data_on_device", "off"],
    "data on device": ["--data_on_device", "on"],
    # The sample images are 96 px: squares of that side keep all of their detail.
    "data on device, 96 px squares": ["--data_on_device", "on", "--device_train_size", "96"],
}
# torchvision's "new recipe" augmentation and label smoothing (its schedule, EMA and optimizer aside): each
# "<variant>, recipe" is also paired with <variant> by seed (--output_dir benchmarks/results/recipe_accuracy)
RECIPE = ["--auto_augment", "ta_wide", "--random_erase", "0.1", "--mixup_alpha", "0.2", "--cutmix_alpha", "1.0",
          "--label_smoothing", "0.1"]
RECIPE_SUFFIX = ", recipe"
VARIANTS.update({name + RECIPE_SUFFIX: flags + RECIPE for name, flags in list(VARIANTS.items())[:2]})
CROP_AREAS = ((0.08, 0.3), (0.3, 0.6), (0.6, 1.0))
LAPLACIAN = torch.tensor([[0.0, 1, 0], [1, -4, 1], [0, 1, 0]]).view(1, 1, 3, 3).repeat(3, 1, 1, 1)
# Two-sided 95% quantiles of Student's t, by degrees of freedom.
T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
         11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 17: 2.11, 18: 2.10, 19: 2.09, 20: 2.09}


def train(flags, seed, args):
    """One run of the trainer; its last and best validation accuracy from the history it writes."""
    result = run_trainer(["--num_gpus", "1", "--train_dir", str(args.sample_data / "train"),
                          "--val_dir", str(args.sample_data / "val"), "--epochs", str(args.epochs),
                          "--batch_size", str(args.batch_size), "--image_size", str(args.image_size), "--bf16",
                          "--seed", str(seed), "--save_every", "0", "--save_last_every", "0", *flags])
    if "error" in result:
        return {**result, "seed": seed}
    history = result.pop("history")
    return {**result, "seed": seed, "val_acc": history["epochs"][-1]["val_acc"],
            "best_val_acc": history["best"]["val_acc"], "wall_s": round(result["wall_s"], 1)}


def train_size(flags, image_size):
    given = int(flags[flags.index("--device_train_size") + 1]) if "--device_train_size" in flags else None
    return train_square_size(image_size, given)


def high_frequency_energy(images):
    return F.conv2d(images, LAPLACIAN, groups=3).pow(2).mean().item()


def crop_detail(paths, side, image_size, seed=0):
    """The device path's training crops from `side`-pixel squares against torchvision's antialiased
    resized crop of each decoded image's centre square (the part the device path keeps), same boxes."""
    generator = torch.Generator().manual_seed(seed)
    by_area = {bucket: {"diff": [], "ours": 0.0, "torchvision": 0.0} for bucket in CROP_AREAS}
    crops = ResizedCrops(side, image_size, torch.device("cpu"))
    for path in paths:
        image = decode_image(str(path), mode=ImageReadMode.RGB)
        full = min(image.shape[-2:])
        square = TF.center_crop(image, [full, full]).float()
        stored = resize_and_crop(image, side, side).float()[None]
        top, left, height, width, flip = random_resized_crops(1, full, generator)
        expected = TF.resized_crop(square, int(top), int(left), int(height), int(width), [image_size] * 2,
                                   antialias=True)[None]
        # The same box on the stored square, in whole pixels of it as the trainer draws them (where side !=
        # full, rounding shifts it by up to half a stored pixel, which adds to the difference, not to the detail).
        box = [(v * side / full).round() for v in (top, left, height, width)]
        ours = crops(stored, *box, torch.zeros_like(flip))
        area = float(height * width) / full**2
        bucket = next(b for b in CROP_AREAS if area <= b[1])
        by_area[bucket]["diff"].append((ours - expected).abs().mean().item())
        by_area[bucket]["ours"] += high_frequency_energy(ours)
        by_area[bucket]["torchvision"] += high_frequency_energy(expected)
    return [{"crop_area": list(bucket), "crops": len(r["diff"]),
             "mean_abs_diff": statistics.mean(r["diff"]) if r["diff"] else None,
             "high_frequency_ratio": r["ours"] / r["torchvision"] if r["torchvision"] else None}
            for bucket, r in by_area.items()]


def summary(values):
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else None}


def paired_difference(values, reference):
    """Mean of values - reference (paired by seed) and the half-width of its 95% interval."""
    differences = [a - b for a, b in zip(values, reference)]
    if len(differences) < 2:
        return {"mean": statistics.mean(differences), "ci95": None}
    half_width = T_975.get(len(differences) - 1, 1.96) * statistics.stdev(differences) / len(differences) ** 0.5
    return {"mean": statistics.mean(differences), "ci95": half_width}


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample_data", type=Path, default=ROOT / "sample_data",
                        help="the built-in sample dataset; drawn there if missing")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--image_size", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--jobs", type=int, default=1, help="trainings run at the same time")
    parser.add_argument("--detail_images", type=int, default=512, help="training images the crop comparison uses")
    parser.add_argument("--update", action="store_true",
                        help="add to the JSON's runs (same machine, versions and settings) instead of replacing them; "
                             "a variant and seed run again replaces its earlier run")
    parser.add_argument("--output_dir", type=Path, default=ROOT / "benchmarks" / "results")
    return parser


def main():
    args = get_args_parser().parse_args()

    draw_sample_data(args.sample_data)
    env = environment()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"data_path_accuracy_{machine_slug(env)}.json"
    earlier, commands = {}, []
    if args.update and path.exists():
        earlier, commands = earlier_results(path, env)
        before = json.loads(path.read_text())["settings"]
        differs = [key for key in ("epochs", "image_size", "batch_size") if before.get(key) != getattr(args, key)]
        if differs:
            sys.exit(f"error: --update: {path} was run with another {', '.join(differs)}")
    train_paths = sorted((args.sample_data / "train").glob("*/*.jpg"))
    step = max(1, len(train_paths) // args.detail_images)
    cropped = [name for name in VARIANTS if name != REFERENCE and not name.endswith(RECIPE_SUFFIX)]
    detail = {name: crop_detail(train_paths[::step][:args.detail_images], train_size(VARIANTS[name], args.image_size),
                                args.image_size) for name in cropped}

    def run(case):
        name, seed = case
        result = train(VARIANTS[name], seed, args)
        shown_result = {k: v for k, v in result.items() if k != "command"}
        print(f"seed {seed}, {name}: {json.dumps(shown_result)[-300:]}", flush=True)
        return result

    cases = [(name, seed) for seed in args.seeds for name in args.variants]
    with ThreadPoolExecutor(args.jobs) as pool:
        done = dict(zip(cases, pool.map(run, cases)))
    runs = {name: {run["seed"]: run for run in r["runs"]} for name, r in earlier.items()}
    for (name, seed), result in done.items():
        runs.setdefault(name, {})[seed] = result
    failed = {name: r["error"] for name, rs in runs.items() for r in rs.values() if "error" in r}

    results = {}
    for name, by_seed in runs.items():
        results[name] = {"flags": VARIANTS[name], "runs": [by_seed[seed] for seed in sorted(by_seed)],
                         "crop_detail": detail.get(name)}
        accs = [run.get("val_acc") for run in results[name]["runs"]]
        if None not in accs:
            results[name]["val_acc"] = summary(accs)
        paired = [seed for seed in sorted(by_seed) if "val_acc" in by_seed[seed]
                  and "val_acc" in runs.get(REFERENCE, {}).get(seed, {})]
        if name != REFERENCE and paired:
            results[name]["difference_to_dataloader"] = {**paired_difference(
                [by_seed[s]["val_acc"] for s in paired], [runs[REFERENCE][s]["val_acc"] for s in paired]),
                "seeds": paired}
        plain = runs.get(name.removesuffix(RECIPE_SUFFIX), {}) if name.endswith(RECIPE_SUFFIX) else {}
        paired = [seed for seed in sorted(by_seed) if "val_acc" in by_seed[seed] and "val_acc" in plain.get(seed, {})]
        if paired:
            results[name]["difference_to_no_recipe"] = {**paired_difference(
                [by_seed[s]["val_acc"] for s in paired], [plain[s]["val_acc"] for s in paired]), "seeds": paired}
    settings = settings_of(args, leave_out=("seeds", "variants"))
    path.write_text(json.dumps({"environment": env, "commands": commands + [env["command"]], "settings": settings,
                                "results": results}, indent=2) + "\n")

    seeds = sorted({seed for by_seed in runs.values() for seed in by_seed})
    print(f"\n{env['gpu'] or 'CPU'} | torch {env['torch']} | DeepSpeed {env['deepspeed']} | sample data, "
          f"{args.epochs} epochs, {args.image_size} px, batch {args.batch_size}, bf16; last-epoch val acc")
    print(f"{'variant':<34}" + "".join(f"{f'seed {s}':>8}" for s in seeds) + f"{'mean':>8}{'std':>7}"
          f"{'vs DataLoader (95%)':>22}")
    for name, r in results.items():
        line = f"{name:<34}" + "".join(
            f"{runs[name][s]['val_acc']:>8.3f}" if "val_acc" in runs[name].get(s, {}) else
            f"{'failed' if s in runs[name] else '-':>8}" for s in seeds)
        if "val_acc" in r:
            std = r["val_acc"]["std"]
            line += f"{r['val_acc']['mean']:>8.3f}" + (f"{std:>7.3f}" if std is not None else f"{'-':>7}")
        for key in ("difference_to_dataloader", "difference_to_no_recipe"):
            diff = r.get(key)
            if diff:
                line += (f"{diff['mean']:>+14.3f}" + (f" ± {diff['ci95']:.3f}" if diff["ci95"] is not None else "")
                         + (" (vs no recipe)" if key == "difference_to_no_recipe" else ""))
        print(line)
    print("\ntraining crops against torchvision's for the same boxes: mean |difference| (0-255), high-frequency "
          "energy ratio")
    print(f"{'variant':<34}" + "".join(f"{f'area {lo:.2f}-{hi:.2f}':>18}" for lo, hi in CROP_AREAS))
    for name, r in results.items():
        if r["crop_detail"]:
            print(f"{name:<34}" + "".join(f"{row['mean_abs_diff']:>10.2f} {row['high_frequency_ratio']:>6.2f}x"
                                          if row["crops"] else f"{'-':>18}" for row in r["crop_detail"]))
    for name, error in failed.items():
        print(f"{name} FAILED: {error.strip().splitlines()[-1][:100] if error.strip() else '?'}")
    print(f"results: {shown([str(path)])}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
