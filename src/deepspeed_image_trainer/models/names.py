"""The names of models: torchvision's, and the one the default model is saved under."""

DEFAULT_MODEL = "resnet18"
MODEL_NAME = "ResNet18Animals90"  # what --model resnet18 builds, and its name in checkpoints and exports


def architecture(name):
    """The torchvision name of a model named in a checkpoint or export (old ones say ResNet18Animals90)."""
    return DEFAULT_MODEL if name == MODEL_NAME else name


def saved_name(name):
    """The model's name in histories, checkpoints and exports: ResNet18Animals90 for resnet18."""
    return MODEL_NAME if architecture(name) == DEFAULT_MODEL else name
