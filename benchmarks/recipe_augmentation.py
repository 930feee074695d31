"""Time of the GPU data path's recipe augmentation per batch: the trainer's DeviceTrainLoader cutting crops from
resident uint8 squares, then with each --auto_augment policy (data/batched_policies.py), random erasing, and
mixup/cutmix on the batch, against torchvision's transforms.v2 policy applied image by image on the same device
(what one writes by hand without a batched version), measured in the same run.

Prints a table last and writes JSON to benchmarks/results/recipe_augmentation/recipe_augmentation_<machine>.json.

    python benchmarks/recipe_augmentation.py --policies ta_wide ra
"""
import argparse
import json
from pathlib import Path

import torch
from torchvision.transforms import InterpolationMode

from augmentation import synchronize, time_per_batch
from common import ROOT, environment, settings_of, shown
from deepspeed_image_trainer.data.device import DeviceTrainLoader, recipe_arguments
from deepspeed_image_trainer.data.folders import auto_augment_policy
from deepspeed_image_trainer.data.mixing import BatchMixing
from deepspeed_image_trainer.data.recipe import AUTO_AUGMENT_POLICIES, RECIPE_DEFAULTS
from machine import machine_slug

PLAIN = "crops and flips"


def recipe(policy=None, random_erase=0.0):
    return {**RECIPE_DEFAULTS, "auto_augment": policy, "random_erase": random_erase}


def per_image(policy):
    """torchvision's class for `policy` applied to each uint8 crop of the trainer's batch in a Python loop."""
    transform = auto_augment_policy(recipe(policy), InterpolationMode.BILINEAR)

    def batches(loader, epoch):
        for indices, boxes in loader.epoch_boxes(epoch):
            crops = loader.crops(loader.images[indices], *boxes[:, :5].unbind(1))
            pixels = crops.round().clamp_(0, 255).to(torch.uint8, memory_format=torch.contiguous_format)
            yield loader.normalize(torch.stack([transform(image) for image in pixels])), loader.labels[indices]
    return batches


def mixed(mixing):
    """The loader's batches, each then mixed (mixup or cutmix) as the training loop does."""
    def batches(loader, epoch):
        for step, (images, labels) in enumerate(loader.epoch(epoch)):
            yield mixing(images, labels, epoch, step)
    return batches


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--square_size", type=int, default=256, help="side of the stored training squares")
    parser.add_argument("--num_images", type=int, default=4320, help="resident images (Animals-90's training set)")
    parser.add_argument("--policies", nargs="+", choices=AUTO_AUGMENT_POLICIES, default=list(AUTO_AUGMENT_POLICIES))
    parser.add_argument("--reference_batches", type=int, default=2,
                        help="timed batches per epoch of torchvision's per-image loop (slow)")
    parser.add_argument("--batches", type=int, default=16, help="timed batches per epoch")
    parser.add_argument("--repeats", type=int, default=5, help="timed epochs; the median is reported")
    parser.add_argument("--output_dir", type=Path, default=ROOT / "benchmarks" / "results" / "recipe_augmentation")
    return parser


def main():
    args = get_args_parser().parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment()
    images = torch.randint(0, 256, (args.num_images, 3, args.square_size, args.square_size), dtype=torch.uint8,
                           device=device, generator=torch.Generator(device).manual_seed(0))
    labels = torch.randint(0, 90, (args.num_images,), device=device, generator=torch.Generator(device).manual_seed(1))

    def loader(**recipe_flags):
        return DeviceTrainLoader(images, labels, micro_batch_size=args.batch_size, image_size=args.image_size,
                                 rank=0, world_size=1, seed=0, dtype=torch.bfloat16,
                                 **recipe_arguments(recipe(**recipe_flags) if recipe_flags else None))

    cases = {PLAIN: (loader(), lambda loader, epoch: loader.epoch(epoch), args.batches),
             "+ random_erase 0.25": (loader(random_erase=0.25), lambda loader, epoch: loader.epoch(epoch),
                                     args.batches),
             "+ mixup 0.2 / cutmix 1.0": (loader(), mixed(BatchMixing(0.2, 1.0, 90, 0, 0)), args.batches)}
    for policy in args.policies:
        cases[f"+ {policy}"] = (loader(policy=policy), lambda loader, epoch: loader.epoch(epoch), args.batches)
        alone = loader(policy=policy)
        if alone.policy_chunk > 1:  # the trainer runs the policy on several batches at once: without that
            alone.policy_chunk = 1
            cases[f"+ {policy}, a batch at a time"] = (alone, lambda loader, epoch: loader.epoch(epoch), args.batches)
        cases[f"+ {policy}, torchvision per image"] = (loader(), per_image(policy), args.reference_batches)
    results = {}
    for name, (case_loader, batches, count) in cases.items():
        timed = argparse.Namespace(batches=count, repeats=args.repeats)
        ms = time_per_batch(batches, case_loader, timed, device)
        results[name] = {"ms_per_batch": ms, "images_per_s": args.batch_size * 1000 / ms}
        print(f"{name}: {ms:.2f} ms per batch", flush=True)
        synchronize(device)
    for name, r in results.items():
        r["added_ms_per_batch"] = r["ms_per_batch"] - results[PLAIN]["ms_per_batch"]

    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"recipe_augmentation_{machine_slug(env)}.json"
    path.write_text(json.dumps({"environment": env, "settings": settings_of(args), "results": results}, indent=2)
                    + "\n")
    print(f"\n{env['gpu'] or 'CPU'} | torch {env['torch']} | torchvision {env['torchvision']} | batch "
          f"{args.batch_size}, {args.image_size} px crops from {args.square_size} px uint8 squares, bf16 out")
    print(f"{'variant':<40}{'ms/batch':>9}{'added ms':>9}{'images/s':>10}")
    for name, r in results.items():
        print(f"{name:<40}{r['ms_per_batch']:>9.2f}{r['added_ms_per_batch']:>9.2f}{r['images_per_s']:>10.0f}")
    print(f"results: {shown([str(path)])}")


if __name__ == "__main__":
    main()
