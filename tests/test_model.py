import os

import pytest
import torch
import torchvision

from deepspeed_image_trainer.models.build import ResNet18Animals90
from deepspeed_image_trainer.models.norms import BatchNorm2dFP32
from deepspeed_image_trainer.utils.failures import UsageError


def test_same_architecture_and_keys_as_torchvision_resnet18():
    model = ResNet18Animals90()
    reference = torchvision.models.resnet18(num_classes=90)
    assert list(model.state_dict()) == list(reference.state_dict())
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 90)
    assert ResNet18Animals90(num_classes=7)(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_pretrained_loads_a_local_torchvision_file_and_reinitialises_the_head(tmp_path):
    torch.manual_seed(0)
    imagenet = torchvision.models.resnet18()  # 1000 classes, like torchvision's ImageNet weights
    path = tmp_path / "resnet18.pth"
    torch.save(imagenet.state_dict(), path)
    model = ResNet18Animals90(num_classes=90, pretrained=str(path))
    assert torch.equal(model.conv1.weight, imagenet.conv1.weight)
    assert torch.equal(model.layer4[1].bn2.running_var, imagenet.layer4[1].bn2.running_var)
    assert model.fc.weight.shape == (90, 512)


def test_pretrained_errors_are_clear(tmp_path):
    with pytest.raises(UsageError, match=r"missing.pth: no such file, and not a weights name of resnet18 \(DEFAULT, "
                                         r"IMAGENET1K_V1\)"):
        ResNet18Animals90(pretrained=tmp_path / "missing.pth")
    path = tmp_path / "other.pth"
    torch.save({"weight": torch.zeros(3)}, path)
    with pytest.raises(UsageError, match=r"not a resnet18 state_dict \(missing conv1.weight.*; unexpected weight"):
        ResNet18Animals90(pretrained=path)
    torch.save({**torchvision.models.resnet18().state_dict(), "conv1.weight": torch.zeros(3)}, path)
    with pytest.raises(UsageError, match=r"not a resnet18 state_dict \(other shapes conv1.weight"):
        ResNet18Animals90(pretrained=path)
    torch.save({"module": ResNet18Animals90(num_classes=3).state_dict(), "ds_version": "0.19"}, path)
    with pytest.raises(UsageError, match="not a state_dict .*export it first with export_model.py"):
        ResNet18Animals90(pretrained=path)
    path.write_bytes(os.urandom(4096))
    with pytest.raises(UsageError, match="is damaged or not a torch file"):
        ResNet18Animals90(pretrained=path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_batch_norm_computes_in_fp32_under_half_precision_weights(dtype):
    torch.manual_seed(0)
    bn = BatchNorm2dFP32(8)
    reference = torch.nn.BatchNorm2d(8)
    x = torch.randn(4, 8, 5, 5) * 3 + 1
    # DeepSpeed's fp16/bf16 modes cast parameters, not buffers.
    bn.weight.data, bn.bias.data = bn.weight.data.to(dtype), bn.bias.data.to(dtype)
    out = bn(x.to(dtype))
    expected = reference(x.to(dtype).float())
    assert out.dtype == dtype
    assert bn.running_mean.dtype == torch.float32
    torch.testing.assert_close(bn.running_mean, reference.running_mean)
    torch.testing.assert_close(bn.running_var, reference.running_var)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    assert bn.num_batches_tracked.item() == 1
