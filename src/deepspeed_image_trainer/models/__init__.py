"""torchvision classifiers built for the trainer (ResNet18Animals90 by default), their names and weights."""
