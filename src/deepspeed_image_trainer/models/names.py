"""The names of models: torchvision's, the one the default model is saved under, and each family's repeated
block."""

DEFAULT_MODEL = "resnet18"
MODEL_NAME = "ResNet18Animals90"  # what --model resnet18 builds, and its name in checkpoints and exports


def architecture(name):
    """The torchvision name of a model named in a checkpoint or export (old ones say ResNet18Animals90)."""
    return DEFAULT_MODEL if name == MODEL_NAME else name


def saved_name(name):
    """The model's name in histories, checkpoints and exports: ResNet18Animals90 for resnet18."""
    return MODEL_NAME if architecture(name) == DEFAULT_MODEL else name


# Each torchvision family's repeated block, fully qualified (a name matches one family only): ZeRO-3's leaf modules
# (engine/config.py), --layer_decay's layers (engine/finetune.py), --grad_checkpointing's recomputed units
# (models/checkpointing.py) and the FSDP2 reference's shards (benchmarks/common.py).
BLOCKS = tuple(f"torchvision.models.{name}" for name in (
    "resnet.BasicBlock", "resnet.Bottleneck", "vision_transformer.EncoderBlock",
    "swin_transformer.SwinTransformerBlock", "swin_transformer.SwinTransformerBlockV2", "convnext.CNBlock", "efficientnet.MBConv", "efficientnet.FusedMBConv",
    "mobilenetv2.InvertedResidual", "mobilenetv3.InvertedResidual", "shufflenetv2.InvertedResidual",
    "mnasnet._InvertedResidual", "regnet.ResBottleneckBlock", "densenet._DenseBlock", "squeezenet.Fire",
    "googlenet.Inception", "inception.InceptionA", "inception.InceptionB", "inception.InceptionC",
    "inception.InceptionD", "inception.InceptionE", "maxvit.MaxVitLayer"))
# Families without a repeated block (--model alexnet, vgg11, ...)
WITHOUT_BLOCKS = ("alexnet", "vgg")
