"""ResNet18 for Animals-90, with batch norm that always computes in fp32 (optionally synchronised over ranks)."""
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce
from torchvision.models.resnet import BasicBlock, ResNet

from failures import UsageError
from loading import load_checked

MODEL_NAME = "ResNet18Animals90"
# torchvision's file name for the ImageNet ResNet18 weights (ResNet18_Weights.IMAGENET1K_V1).
TORCHVISION_WEIGHTS_FILE = "resnet18-f37072fd.pth"


class BatchNorm2dFP32(nn.BatchNorm2d):
    """BatchNorm2d that normalises in fp32 and keeps its running statistics in fp32.

    DeepSpeed's fp16/bf16 modes cast every parameter to half precision but leave buffers in fp32,
    which plain BatchNorm2d rejects; half-precision statistics would also lose accuracy. This layer
    then upcasts the input and its affine weights, and returns the input's dtype. With fp32 weights
    (fp32 or autocast) BatchNorm2d's own kernels already take half-precision input and compute in fp32.

    With `sync = True` (see `synchronize_batch_norm`) training batches are normalised with the mean and
    variance over all ranks' micro-batches, as torch.nn.SyncBatchNorm does. That one needs CUDA and fp32
    weights; this one works over gloo on CPU too and under half-precision weights.
    """

    sync = False

    def forward(self, x):
        if self.sync and self.training and dist.is_initialized() and dist.get_world_size() > 1:
            return self._synced_forward(x)
        if self.weight.dtype == torch.float32:
            return super().forward(x)
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        with torch.autocast(x.device.type, enabled=False):
            out = F.batch_norm(
                x.float(), self.running_mean, self.running_var,
                self.weight.float(), self.bias.float(),
                self.training, self.momentum, self.eps,
            )
        return out.to(x.dtype)

    def _synced_forward(self, x):
        """Batch statistics over every rank: all-reduce the sum, then the squared deviations (two passes,
        no cancellation). The all-reduces are differentiable, so gradients flow through the global
        statistics to every rank's input, as in SyncBatchNorm."""
        with torch.autocast(x.device.type, enabled=False):
            xf = x.float()
            sums = differentiable_all_reduce(torch.cat([xf.sum(dim=(0, 2, 3)), xf.new_full((1,), xf[:, 0].numel())]))
            count = sums[-1]
            mean = sums[:-1] / count
            centered = xf - mean[None, :, None, None]
            var = differentiable_all_reduce(centered.square().sum(dim=(0, 2, 3))) / count
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else 1 / self.num_batches_tracked.item()
                self.running_mean.lerp_(mean, momentum)
                self.running_var.lerp_(var * count / (count - 1).clamp(min=1), momentum)
            scale = self.weight.float() * torch.rsqrt(var + self.eps)
            out = centered * scale[None, :, None, None] + self.bias.float()[None, :, None, None]
        return out.to(x.dtype)


def synchronize_batch_norm(model):
    """Make every BatchNorm2dFP32 in `model` normalise training batches over all ranks (--sync_bn)."""
    layers = [m for m in model.modules() if isinstance(m, BatchNorm2dFP32)]
    for layer in layers:
        layer.sync = True
    return len(layers)


class ResNet18Animals90(ResNet):
    """torchvision's ResNet18 (same state_dict keys) with fp32 batch norm and `num_classes` outputs.

    `pretrained` is False, or the path of a local torchvision ResNet18 weights file, or True to use
    torchvision's own cached copy (TORCH_HOME). Nothing is ever downloaded; the classifier head is
    freshly initialised whenever its shape differs from the file's.
    """

    def __init__(self, num_classes=90, pretrained=False):
        super().__init__(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, norm_layer=BatchNorm2dFP32)
        if pretrained:
            self.load_backbone(torchvision_weights_path() if pretrained is True else pretrained)

    def load_backbone(self, path):
        """Take the weights of a torchvision ResNet18 state_dict file (its fc too when the class count matches)."""
        path = Path(path)
        if not path.is_file():
            raise UsageError(f"--pretrained {path}: file not found")
        state = load_checked(path, deepspeed_classes=False)
        if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
            raise UsageError(f"--pretrained {path} is not a state_dict (tensors by name)"
                             + ("; for a checkpoint of this trainer, export it first with export_model.py"
                                if isinstance(state, dict) and "module" in state else ""))
        if "fc.weight" in state and state["fc.weight"].shape != self.fc.weight.shape:
            state = {k: v for k, v in state.items() if not k.startswith("fc.")}
        try:
            missing, unexpected = self.load_state_dict(state, strict=False)
        except RuntimeError as err:  # a tensor of another shape
            raise UsageError(f"--pretrained {path} is not a ResNet18 state_dict ({str(err).splitlines()[-1].strip()})") from None
        if unexpected or set(missing) - {"fc.weight", "fc.bias"}:
            raise UsageError(f"--pretrained {path} is not a ResNet18 state_dict "
                             f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")


def load_weights(model, state_dict, source):
    """model.load_state_dict(state_dict), strict; keys or shapes that do not fit are a UsageError naming `source`."""
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as err:  # torch's first line only names the model; the next says what did not fit
        detail = next((line.strip() for line in str(err).splitlines()[1:] if line.strip()), str(err).strip())
        raise UsageError(f"{source}: not a {MODEL_NAME} state_dict ({detail[:300]})") from None


def torchvision_weights_path():
    return Path(torch.hub.get_dir()) / "checkpoints" / TORCHVISION_WEIGHTS_FILE
