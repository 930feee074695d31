"""Normalisation layers that compute in fp32 under DeepSpeed's half-precision weights (batch norm optionally
synchronised over ranks, --sync_bn), swapped in for torch's own by class: below models/build.py and
models/timm_models.py, which both swap them in."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNorm
from torchvision.models.convnext import LayerNorm2d


class _SumOverRanks(torch.autograd.Function):
    """A sum over every rank that gradients flow back through (each rank's input receives the sum of the ranks'
    gradients), as torch.distributed.nn.functional.all_reduce, which torch deprecates; tests/test_distributed.py
    pins --sync_bn built on it to one process on the whole batch."""

    @staticmethod
    def forward(ctx, tensor):
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def differentiable_all_reduce(tensor):
    return _SumOverRanks.apply(tensor)


class BatchNorm2dFP32(nn.BatchNorm2d):
    """BatchNorm2d that normalises in fp32 and keeps its running statistics in fp32.

    DeepSpeed's fp16/bf16 modes cast every parameter to half precision but leave buffers in fp32,
    which plain BatchNorm2d rejects; half-precision statistics would also lose accuracy. This layer
    then upcasts the input and its affine weights, and returns the input's dtype. With fp32 weights
    (fp32 or autocast) BatchNorm2d's own kernels already take half-precision input and compute in fp32.

    With `sync = True` (see `synchronize_batch_norm`) training batches are normalised with the mean and
    variance over all ranks' micro-batches: through torch.nn.SyncBatchNorm's own fused kernels where they apply
    (CUDA, fp32 weights), otherwise (gloo on CPU, half-precision weights) by `_synced_forward`.
    """

    sync = False

    def forward(self, x):
        if self.sync and self.training and dist.is_initialized() and dist.get_world_size() > 1:
            if x.is_cuda and self.weight.dtype == torch.float32:
                return self._torch_synced_forward(x)
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

    def _torch_synced_forward(self, x):
        """What torch.nn.SyncBatchNorm.forward does in training on several ranks, on this layer's state."""
        self.num_batches_tracked.add_(1)
        momentum = self.momentum if self.momentum is not None else 1 / self.num_batches_tracked.item()
        return TorchSyncBatchNorm.apply(x, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                        momentum, dist.group.WORLD, dist.get_world_size())

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


def _float(tensor):
    return None if tensor is None else tensor.float()


class LayerNormFP32(nn.LayerNorm):
    """LayerNorm computing in fp32 under half-precision weights (ViT, Swin, MaxViT, ConvNeXt's head)."""

    def forward(self, x):
        if self.weight is None or self.weight.dtype == torch.float32:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), _float(self.bias),
                                self.eps).to(x.dtype)


class LayerNorm2dFP32(LayerNorm2d):
    """ConvNeXt's channels-first LayerNorm, computing in fp32 under half-precision weights."""

    def forward(self, x):
        if self.weight is None or self.weight.dtype == torch.float32:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            out = F.layer_norm(x.float().permute(0, 2, 3, 1), self.normalized_shape, self.weight.float(),
                               _float(self.bias), self.eps)
        return out.permute(0, 3, 1, 2).to(x.dtype)


class GroupNormFP32(nn.GroupNorm):
    def forward(self, x):
        if self.weight is None or self.weight.dtype == torch.float32:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            return F.group_norm(x.float(), self.num_groups, self.weight.float(), _float(self.bias),
                                self.eps).to(x.dtype)


# Each class above adds behaviour and no state: a layer's class is swapped in place, its state_dict unchanged.
FP32_NORMS = {nn.BatchNorm2d: BatchNorm2dFP32, nn.LayerNorm: LayerNormFP32, LayerNorm2d: LayerNorm2dFP32,
              nn.GroupNorm: GroupNormFP32}


def fp32_norms(model):
    """Make every normalisation layer of `model` compute in fp32 under half-precision weights; their count."""
    swapped = 0
    for module in model.modules():
        if type(module) in FP32_NORMS:
            module.__class__ = FP32_NORMS[type(module)]
            swapped += 1
    return swapped
