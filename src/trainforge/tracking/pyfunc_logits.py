"""The loader of a registered zoo model: MLflow copies this file into the model and runs it to load it.

Never imported by trainforge (``tracking/registry.py`` hands MLflow its path: "models from code").
It imports nothing of trainforge's, so ``mlflow.pyfunc.load_model("models:/NAME/1")`` needs only
MLflow, torch and transformers: the weights are the transformers folder that ``save_pretrained``
wrote (config.json, model.safetensors), rebuilt by the class its config names. No pickle is
loaded. ``predict`` takes token ids (int) or features (float, e.g. N x C x H x W pixels) as an
array and returns the logits, as trainforge's module gives them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlflow
from mlflow.pyfunc import PythonModel

WEIGHTS = "transformers"  # the artifact's key: the folder save_pretrained wrote


class TransformersLogits(PythonModel):
    """pyfunc around a transformers model: an array in, ``model(x).logits`` out (numpy)."""

    def load_context(self, context: Any) -> None:
        import transformers

        folder = Path(context.artifacts[WEIGHTS])
        architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
        self.model = getattr(transformers, architecture).from_pretrained(folder).eval()

    # No type hints: MLflow would read them as a schema for rows of input; the signature is the schema.
    def predict(self, context, model_input, params=None):
        import numpy as np
        import torch

        inputs = torch.as_tensor(np.asarray(model_input))
        if inputs.is_floating_point():
            inputs = inputs.to(self.model.dtype)
        with torch.no_grad():
            return self.model(inputs).logits.float().numpy()


mlflow.models.set_model(TransformersLogits())
