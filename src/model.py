"""ResNet18 for Animals-90, with batch norm that always computes in fp32."""
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet

MODEL_NAME = "ResNet18Animals90"
# torchvision's file name for the ImageNet ResNet18 weights (ResNet18_Weights.IMAGENET1K_V1).
TORCHVISION_WEIGHTS_FILE = "resnet18-f37072fd.pth"


class BatchNorm2dFP32(nn.BatchNorm2d):
    """BatchNorm2d that normalises in fp32 and keeps its running statistics in fp32.

    DeepSpeed's fp16/bf16 modes cast every parameter to half precision but leave buffers in fp32,
    which plain BatchNorm2d rejects; half-precision statistics would also lose accuracy. This layer
    then upcasts the input and its affine weights, and returns the input's dtype. With fp32 weights
    (fp32 or autocast) BatchNorm2d's own kernels already take half-precision input and compute in fp32.
    """

    def forward(self, x):
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
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"pretrained weights file not found: {path}")
        state = torch.load(path, map_location="cpu", weights_only=True)
        if "fc.weight" in state and state["fc.weight"].shape != self.fc.weight.shape:
            state = {k: v for k, v in state.items() if not k.startswith("fc.")}
        missing, unexpected = self.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"fc.weight", "fc.bias"}:
            raise ValueError(f"{path} is not a ResNet18 state_dict "
                             f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")


def torchvision_weights_path():
    return Path(torch.hub.get_dir()) / "checkpoints" / TORCHVISION_WEIGHTS_FILE
