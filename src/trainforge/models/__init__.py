"""Models and tasks: ``build_model`` turns the ``model`` config section into an ``nn.Module``,
``build_task`` picks the loss and metrics that go with it.

Importing the builder modules here registers every built-in before anyone can look one up.
"""

from __future__ import annotations

from trainforge.models import language, vision  # noqa: F401  (importing them registers the built-ins)
from trainforge.models.registry import BUILTIN_MODELS, build_model
from trainforge.models.task_registry import build_task
from trainforge.models.tasks import CausalLMTask, ClassificationTask, Task

__all__ = [
    "BUILTIN_MODELS",
    "CausalLMTask",
    "ClassificationTask",
    "Task",
    "build_model",
    "build_task",
]
