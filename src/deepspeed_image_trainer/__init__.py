"""An image-classification trainer on DeepSpeed: see docs/architecture.md for the map."""
