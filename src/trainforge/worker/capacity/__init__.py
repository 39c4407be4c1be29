"""The memory planner: what each rank holds for a config (``estimate.py``: parameters, gradients,
optimizer state, buffers; ``activations.py``: activations measured on fake tensors), the largest
micro-batch that fits (for ``train.batch_size: auto``), and ``trainforge plan``'s table (``render.py``)."""
