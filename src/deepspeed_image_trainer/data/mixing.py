"""Mixup and cutmix of a training batch (--mixup_alpha, --cutmix_alpha), with torchvision's transforms.v2 MixUp
and CutMix, on every data tier (the batch is mixed where the step gets it). Each micro-batch draws from
(seed, rank, epoch, step), so a resumed run mixes its batches as the uninterrupted run did."""
import torch
from torchvision.transforms import v2


class BatchMixing:
    def __init__(self, mixup_alpha, cutmix_alpha, num_classes, seed, rank):
        mixes = [mix(alpha=alpha, num_classes=num_classes)
                 for mix, alpha in ((v2.MixUp, mixup_alpha), (v2.CutMix, cutmix_alpha)) if alpha]
        # both: one of the two per batch, as torchvision's reference scripts choose
        self.mix = mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)
        self.seed, self.rank = seed, rank

    def __call__(self, images, labels, epoch, step):
        """(mixed images, soft targets: each row the classes' shares) of micro-batch `step` of `epoch`."""
        with torch.random.fork_rng(devices=[]):  # the draws are made on the CPU, whatever the batch's device
            torch.manual_seed(hash((self.seed, self.rank, epoch, step)) % 2**63)
            mixed, targets = self.mix(images, labels)
        # MixUp's roll returns the default layout: the GPU's channels_last batch came back NCHW, and every batch
        # norm and convolution of the step then ran in its slow layout (ResNet18's epochs at 0.63 on an H200)
        return mixed.contiguous(memory_format=layout(images)), targets


def layout(images):
    """The memory format `images` is laid out in: channels_last (the GPU's batches) or the default."""
    if images.ndim == 4 and not images.is_contiguous() and images.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def batch_mixing(args, num_classes, rank):
    """The run's BatchMixing, or None without --mixup_alpha and --cutmix_alpha."""
    if not (args.mixup_alpha or args.cutmix_alpha):
        return None
    return BatchMixing(args.mixup_alpha, args.cutmix_alpha, num_classes, args.seed, rank)
