"""The models, for scripts that import them from here (`from model import ResNet18Animals90`): they live in
deepspeed_image_trainer.models."""
from deepspeed_image_trainer.models.build import (ResNet18Animals90, build_model, list_models,  # noqa: F401
                                                  load_weights, model_for_weights)
