"""Recipes: the typed sections, loading with ``key=value`` overrides, and every rule across parts —
run at load, so every command accepts and refuses the same recipes before any data is touched."""

from ..errors import RecipeError
from .loading import load_recipe, recipe_from_yaml, recipe_to_dict, recipe_to_yaml
from .sections import (
    CheckpointConfig,
    LoggerConfig,
    LoRAConfig,
    ModelConfig,
    MultiTaskConfig,
    OptimConfig,
    RecipeConfig,
    ResamplerConfig,
    TrainerConfig,
)

__all__ = [
    "CheckpointConfig",
    "LoRAConfig",
    "LoggerConfig",
    "ModelConfig",
    "MultiTaskConfig",
    "OptimConfig",
    "RecipeConfig",
    "RecipeError",
    "ResamplerConfig",
    "TrainerConfig",
    "load_recipe",
    "recipe_from_yaml",
    "recipe_to_dict",
    "recipe_to_yaml",
]
