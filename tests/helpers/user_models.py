"""Stand-ins for a user's own model module, resolved through ``model.factory`` in tests."""

from __future__ import annotations

from torch import nn

NOT_CALLABLE = 42


def tiny_net(hidden: int = 16) -> nn.Module:
    """A digits-sized classifier: (B, 1, 8, 8) -> (B, 10)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def not_a_module() -> dict[str, int]:
    return {"hidden": 16}


def failing(hidden: int = 16) -> nn.Module:
    raise ValueError(f"hidden={hidden} must be even")
