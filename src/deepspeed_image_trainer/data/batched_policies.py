"""torchvision's auto-augment policies (RandAugment, TrivialAugmentWide, AutoAugment, AugMix) on a whole uint8
batch at once, each image with its own ops and magnitudes, for the tiers that keep their batches on the GPU.

The DataLoader tier applies torchvision's transforms.v2 classes image by image in worker processes; a Python loop
over the images of a resident batch would cost launches per image and op. Here the loop is over ops: each round
sorts the batch by the op each image drew, every op runs once on the contiguous run of images that drew it with
their magnitudes broadcast, and the geometric ops of a round run together as one affine grid. The draws come only
from the caller's torch.Generator; the op spaces, magnitudes and arithmetic are torchvision's, so each image gets
torchvision's pixels for the ops it drew (tests/test_batched_policies.py pins it image by image).
"""
import itertools
import math

import torch
from torch.nn.functional import conv2d
from torchvision.transforms.v2 import functional as F
# torchvision's own private kernels, so that a batch gets their exact arithmetic; an import error on a new release
# says loudly that they moved
from torchvision.transforms.v2.functional._color import _rgb_to_grayscale_image
from torchvision.transforms.v2.functional._geometry import (_apply_grid_transform, _check_interpolation,
                                                            _get_inverse_affine_matrix)

# the --auto_augment name of each torchvision class (AutoAugment's are its policies' names)
POLICY_OF_CLASS = {"RandAugment": "ra", "TrivialAugmentWide": "ta_wide", "AugMix": "augmix"}
GEOMETRIC_OPS = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
# the number of magnitude bins AutoAugment's sub-policies index (its forward's magnitudes_fn(10, ...))
AUTO_AUGMENT_BINS = 10


class BatchedPolicy:
    """One of --auto_augment's policies on uint8 (N, C, H, W) batches: draw(count, generator) gives every image
    its own ops, magnitude bins and signs (and AutoAugment's sub-policy and coin flips, AugMix's chains and
    weights), apply(images, params) applies them, __call__(images, generator) does both.

    The numbers are torchvision's classes' (fill None is their default, which differs from fill 0 at the border
    of geometric ops, as in torchvision)."""

    def __init__(self, reference):
        """`reference`: the torchvision class the DataLoader tier applies (folders.auto_augment_policy), whose op
        space, magnitudes, sub-policies and numbers this reads."""
        self.reference = reference
        self.policy = policy = POLICY_OF_CLASS.get(type(reference).__name__) or reference.policy.value
        self.mode = _check_interpolation(reference.interpolation).value
        if self.mode not in ("nearest", "bilinear"):
            raise ValueError(f"interpolation {self.mode} is not one of torchvision's tensor affine's (nearest, "
                             f"bilinear)")
        # torchvision's _convert_fill_arg: None, a number, or a float per channel
        fill = reference.fill
        self.fill = fill if fill is None or isinstance(fill, (int, float)) else [float(value) for value in fill]
        if policy == "augmix" and not reference.all_ops:
            space = self.reference._PARTIAL_AUGMENTATION_SPACE
        else:
            space = self.reference._AUGMENTATION_SPACE
        self.space = space
        # Identity first (AutoAugment's skipped ops, AugMix's shorter chains), then torchvision's order, which keeps
        # the geometric ops together so that a round's sort puts their images in one run
        self.op_names = ("Identity",) + tuple(name for name in space if name != "Identity")
        geometric = [self.op_names.index(name) for name in GEOMETRIC_OPS if name in self.op_names]
        assert geometric == list(range(geometric[0], geometric[0] + len(geometric))), self.op_names
        self.geometric = (geometric[0], geometric[-1] + 1)
        self.signed = torch.tensor([name in space and space[name][1] for name in self.op_names])

        if policy in ("ra", "ta_wide"):
            self.num_bins = reference.num_magnitude_bins
            if policy == "ra" and not 0 <= reference.magnitude < self.num_bins:
                raise ValueError(f"RandAugment's magnitude {reference.magnitude} is not a bin of 0-{self.num_bins - 1}")
            self.num_rounds = reference.num_ops if policy == "ra" else 1
        elif policy == "augmix":
            self.num_bins = self.reference._PARAMETER_MAX
            chain_depth = reference.chain_depth
            self.max_depth = chain_depth if chain_depth > 0 else 3  # torchvision's randint(1, 4)
            self.num_rounds = reference.mixture_width * self.max_depth
        else:
            self.num_bins = AUTO_AUGMENT_BINS
            self.num_rounds = 2
            sub_policies = self.reference._policies
            self.sub_policy_ops = torch.tensor([[self.op_names.index(name) for name, _, _ in ops]
                                                for ops in sub_policies])
            self.sub_policy_probabilities = torch.tensor([[probability for _, probability, _ in ops]
                                                          for ops in sub_policies])
            self.sub_policy_bins = torch.tensor([[bin or 0 for _, _, bin in ops] for ops in sub_policies])
        self._cache = {}

    def __call__(self, images, generator):
        return self.apply(images, self.draw(len(images), generator))

    def draw(self, count, generator):
        """Every image's ops, drawn from `generator` alone as torchvision's class draws them for one image, as
        tensors on the generator's device: op (count, rounds) indexes op_names, bin the magnitude bin, negate the
        sign flip of signed ops; AutoAugment adds sub_policy (count,) and applied (count, 2), AugMix depth
        (count, mixture_width) and its two Dirichlet draws, mixing (count, 2: the original's weight, the chains')
        and chains (count, mixture_width)."""
        device = generator.device
        shape = (count, self.num_rounds)

        def uniform(*size):
            return torch.rand(size, generator=generator, device=device)

        params = {}
        if self.policy == "ra":
            op = torch.randint(len(self.op_names), shape, generator=generator, device=device)
            bin = torch.full(shape, self.reference.magnitude, device=device)
        elif self.policy == "ta_wide":
            op = torch.randint(len(self.op_names), shape, generator=generator, device=device)
            bin = torch.randint(self.num_bins, shape, generator=generator, device=device)
        elif self.policy == "augmix":
            width = self.reference.mixture_width
            if self.reference.chain_depth > 0:
                depth = torch.full((count, width), self.max_depth, device=device)
            else:
                depth = torch.randint(1, self.max_depth + 1, (count, width), generator=generator, device=device)
            # op 0 is Identity, outside AugMix's space: it pads the chains shorter than max_depth
            op = torch.randint(1, len(self.op_names), shape, generator=generator, device=device)
            step = torch.arange(self.max_depth, device=device).repeat(width)
            op = op.where(step < depth.repeat_interleave(self.max_depth, dim=1), 0)
            bin = torch.randint(self.reference.severity, shape, generator=generator, device=device)
            alpha = float(self.reference.alpha)
            mixing = torch._sample_dirichlet(torch.full((count, 2), alpha, device=device), generator=generator)
            chains = torch._sample_dirichlet(torch.full((count, width), alpha, device=device), generator=generator)
            params.update(depth=depth, mixing=mixing, chains=chains)
        else:
            sub_policy = torch.randint(len(self.sub_policy_ops), (count,), generator=generator, device=device)
            applied = uniform(*shape) <= self._on(device, "sub_policy_probabilities")[sub_policy]
            op = self._on(device, "sub_policy_ops")[sub_policy].where(applied, 0)
            bin = self._on(device, "sub_policy_bins")[sub_policy]
            params.update(sub_policy=sub_policy, applied=applied)
        negate = (uniform(*shape) <= 0.5) & self._on(device, "signed")[op]
        params.update(op=op, bin=bin, negate=negate)
        return params

    def _on(self, device, name):
        """The constant tensor `name` on `device`, copied there once (a copy from pageable memory waits for the
        device)."""
        key = (name, str(device))
        if key not in self._cache:
            self._cache[key] = getattr(self, name).to(device)
        return self._cache[key]

    def _magnitudes(self, name, height, width):
        """torchvision's magnitudes of op `name` per bin, as the Python floats its forward takes; None if the op
        has none."""
        magnitudes = self.space[name][0](self.num_bins, height, width) if name in self.space else None
        return None if magnitudes is None else [float(magnitude) for magnitude in magnitudes]

    def apply(self, images, params):
        """The batch with each image's drawn ops applied, uint8 on the images' device. Params drawn on the CPU
        cost no host synchronisation; params on the GPU cost one, reading how many images drew each op."""
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(f"BatchedPolicy takes uint8 (N, C, H, W) batches, not {images.dtype} "
                             f"{tuple(images.shape)}")
        op = params["op"]
        counts = torch.zeros(op.shape[1], len(self.op_names), dtype=torch.long, device=op.device)
        counts = counts.scatter_add_(1, op.T, torch.ones_like(op.T)).tolist()  # per round, images per op
        params = {key: to_device(value, images.device) for key, value in params.items()}
        tables = self._tables_for(*images.shape[-2:], images.device)
        if self.policy != "augmix":
            return self._apply_rounds(images, params, range(self.num_rounds), counts, tables)
        # torchvision's AugMix: the original and each chain's result weighted per image, then truncated to uint8
        mixing = params["mixing"].view(len(images), 2, 1, 1, 1)
        chains = (params["chains"] * params["mixing"][:, 1:]).view(len(images), -1, 1, 1, 1)
        mixed = mixing[:, 0] * images
        for chain in range(self.reference.mixture_width):
            rounds = range(chain * self.max_depth, (chain + 1) * self.max_depth)
            mixed.add_(chains[:, chain] * self._apply_rounds(images, params, rounds, counts, tables))
        return mixed.to(torch.uint8)

    def _apply_rounds(self, images, params, rounds, counts, tables):
        """The ops of `rounds` in order. Each round sorts the batch by op (a stable argsort, no host sync), so each
        op's images are a contiguous run; the image order is restored once at the end."""
        count = len(images)
        batch, order = images, None
        for round in rounds:
            if counts[round][0] == count:  # all Identity
                continue
            op = params["op"][:, round]
            sort = torch.argsort(op if order is None else op[order], stable=True)
            order = sort if order is None else order[sort]
            batch = batch[sort]  # a copy: the caller's images stay as they were
            entry = ((op * self.num_bins + params["bin"][:, round]) * 2 + params["negate"][:, round].long())[order]
            starts = [0, *itertools.accumulate(counts[round])]
            first, last = self.geometric
            if starts[last] > starts[first]:  # all geometric ops of the round: one grid
                run = slice(starts[first], starts[last])
                batch[run] = self._geometric(batch[run], entry[run], tables)
            for k, name in enumerate(self.op_names):
                if starts[k + 1] > starts[k] and name != "Identity" and name not in GEOMETRIC_OPS:
                    run = slice(starts[k], starts[k + 1])
                    batch[run] = self._colour(name, batch[run], entry[run], tables)
        if order is None:
            return images.clone()
        return torch.empty_like(batch).index_copy_(0, order, batch)

    def _tables_for(self, height, width, device):
        """Per (op, bin, sign): torchvision's magnitude (float64, as its Python float), its affine matrix for the
        geometric ops (float32, from torchvision's own _get_inverse_affine_matrix) and Posterize's bit mask."""
        key = (height, width, str(device))
        if key not in self._cache:
            magnitudes, matrices, masks = [], [], []
            for name in self.op_names:
                op_magnitudes = self._magnitudes(name, height, width) or [0.0] * self.num_bins
                signed = name in self.space and self.space[name][1]
                for bin in range(self.num_bins):
                    for negate in (False, True):  # draw never negates an unsigned op
                        magnitude = -op_magnitudes[bin] if negate and signed else op_magnitudes[bin]
                        magnitudes.append(magnitude)
                        matrices.append(affine_matrix(name, magnitude, height, width))
                        bits = int(magnitude) if name == "Posterize" else 8
                        masks.append(((1 << bits) - 1) << (8 - bits) if bits < 8 else 255)
            self._cache[key] = {
                "magnitude": torch.tensor(magnitudes, dtype=torch.float64, device=device),
                "matrix": torch.tensor(matrices, dtype=torch.float32, device=device).view(-1, 2, 3),
                "posterize": torch.tensor(masks, dtype=torch.uint8, device=device),
                "grid": base_grid(height, width, device),
                "half": torch.tensor([0.5 * width, 0.5 * height], dtype=torch.float32, device=device),
                "sharpness": sharpness_kernel(device),
            }
        return self._cache[key]

    def _geometric(self, images, entry, tables):
        """torchvision's tensor affine_image / rotate_image (its _affine_grid and _apply_grid_transform) with a
        matrix per image."""
        height, width = images.shape[-2:]
        theta = tables["matrix"][entry]
        scaled = theta.transpose(1, 2).div_(tables["half"])
        grid = tables["grid"].expand(len(images), -1, -1).bmm(scaled).view(len(images), height, width, 2)
        return _apply_grid_transform(images, grid, self.mode, fill=self.fill)

    def _colour(self, name, images, entry, tables):
        """torchvision's colour kernels with a magnitude per image, broadcast."""
        magnitude = tables["magnitude"][entry].view(-1, 1, 1, 1)
        channels, height, width = images.shape[-3:]
        if name == "Brightness":
            return images.mul((1.0 + magnitude).float()).clamp_(0, 255).to(torch.uint8)
        if name == "Color":
            if channels == 1:
                return images
            return blend(images, grey(images), magnitude)
        if name == "Contrast":
            # the floored grey levels sum exactly in float32 up to 65793 pixels, so the mean does not depend on
            # the reduction's order (batched here, one image in torchvision)
            levels = grey(images) if channels == 3 else images.float()
            return blend(images, levels.mean(dim=(-3, -2, -1), keepdim=True), magnitude)
        if name == "Sharpness":
            return sharpen(images, magnitude, tables["sharpness"])
        if name == "Posterize":
            return images.bitwise_and(tables["posterize"][entry].view(-1, 1, 1, 1))
        if name == "Solarize":
            # torchvision compares with 255 * magnitude as float32, its uint8 image promoted
            return torch.where(images >= (255.0 * magnitude).float(), images.bitwise_not(), images)
        if name == "AutoContrast":
            return F.autocontrast(images)  # per image and channel on a batch already
        if name == "Equalize":
            return F.equalize(images)  # per image and channel on a batch already
        if name == "Invert":
            return F.invert(images)
        raise ValueError(f"no batched op {name}")


def to_device(tensor, device):
    """`tensor` on `device`, without waiting for it: a CPU tensor goes to a GPU through pinned memory."""
    if tensor.device == device:
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def affine_matrix(name, magnitude, height, width):
    """The inverse affine matrix torchvision's _apply_image_or_video_transform gives op `name` (its affine_image
    and rotate_image arguments, through its own _get_inverse_affine_matrix); the identity for colour ops."""
    if name in ("ShearX", "ShearY"):
        shear = math.degrees(math.atan(magnitude))
        # center=[0, 0]: the top-left corner, in affine_image's centred coordinates
        return _get_inverse_affine_matrix([-0.5 * width, -0.5 * height], 0.0, [0.0, 0.0], 1.0,
                                          [shear, 0.0] if name == "ShearX" else [0.0, shear])
    if name in ("TranslateX", "TranslateY"):
        # int(): torchvision truncates the translation towards zero
        translate = [float(int(magnitude)), 0.0] if name == "TranslateX" else [0.0, float(int(magnitude))]
        return _get_inverse_affine_matrix([0.0, 0.0], 0.0, translate, 1.0, [0.0, 0.0])
    if name == "Rotate":
        # rotate_image's fast paths (0, 180, and 90 or 270 on squares) give the same pixels as its sampled grid
        # after rounding; tests/test_batched_policies.py checks 0 and 90
        return _get_inverse_affine_matrix([0.0, 0.0], -(magnitude % 360), [0.0, 0.0], 1.0, [0.0, 0.0])
    return [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def base_grid(height, width, device):
    """torchvision's _affine_grid's output pixel centres, (1, height * width, 3)."""
    grid = torch.empty(1, height, width, 3, dtype=torch.float32, device=device)
    grid[..., 0].copy_(torch.linspace((1.0 - width) * 0.5, (width - 1.0) * 0.5, steps=width, device=device))
    grid[..., 1].copy_(torch.linspace((1.0 - height) * 0.5, (height - 1.0) * 0.5, steps=height,
                                      device=device).unsqueeze_(-1))
    grid[..., 2].fill_(1)
    return grid.view(1, height * width, 3)


def grey(images):
    """torchvision's grey levels for saturation and contrast: its luma, floored for uint8 images."""
    return _rgb_to_grayscale_image(images, num_output_channels=1, preserve_dtype=False).floor_()


def fused_multiply_add(a, b, c):
    """float32 a * b + c rounded once, as torchvision's add_(other, alpha=...) is on the CPU (vectorised fmadd)
    and on CUDA (contracted). float64 holds a * b exactly, and the sum too for saturation's and sharpness's integer
    levels; contrast's fractional mean can take a second rounding, off by an ulp about once in 2^29 sums, a grey
    level only where that ulp crosses an integer. Rounding a * b first instead changed 6490 of 12 million pixels
    of torchvision's saturation and contrast blends."""
    return c.double().addcmul_(a.double(), b.double()).float()


def blend(images, other, magnitude):
    """torchvision's _blend(images, other, ratio) with ratio = 1 + magnitude per image, broadcast:
    images * ratio, plus other * (1 - ratio) fused, clamped and truncated to uint8."""
    ratio = 1.0 + magnitude  # float64, as torchvision's Python float; its kernels take it as float32
    scaled = images.mul(ratio.float())
    return fused_multiply_add(other, (1.0 - ratio).float(), scaled).clamp_(0, 255).to(torch.uint8)


def sharpness_kernel(device):
    """torchvision's smoothing for adjust_sharpness: 1s around a 5, normalised."""
    a, b = 1.0 / 13.0, 5.0 / 13.0
    return torch.tensor([[a, a, a], [a, b, a], [a, a, a]], dtype=torch.float32, device=device)


def sharpen(images, magnitude, kernel):
    """torchvision's adjust_sharpness_image with factor 1 + magnitude per image: the 3x3 smoothing (rounded)
    blended into the interior, the border rows and columns kept."""
    channels, height, width = images.shape[-3:]
    if height <= 2 or width <= 2:
        return images
    output = images.to(torch.float32, copy=True)
    blurred = conv2d(output, kernel.expand(channels, 1, 3, 3), groups=channels).round_()
    interior = output[..., 1:-1, 1:-1]
    interior.copy_(fused_multiply_add(blurred.sub_(interior), (1.0 - (1.0 + magnitude)).float(), interior))
    return output.clamp_(0, 255).to(torch.uint8)
