"""Helpers shared by the dataset kinds."""

from __future__ import annotations


def task_of(recipe, where: str):
    """The task config whose ``data`` is at ``where`` (``tasks.<name>.data``)."""
    return recipe.tasks[where.split(".")[1]]
