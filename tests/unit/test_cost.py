"""Cost tracking: the ``cost`` section, the arithmetic and its projection to the end of the run."""

from __future__ import annotations

import pytest

from trainforge.config import load_config
from trainforge.errors import ConfigError

BASE = {"model": {"name": "mlp"}, "train": {"max_steps": 10}}


def test_cost_is_off_by_default_and_takes_prices_and_a_currency() -> None:
    assert not load_config(BASE, env={}).cost.enabled
    config = load_config(BASE, ["cost.price_per_gpu_hour=2.5", "cost.currency=EUR"], env={})
    assert config.cost.enabled and config.cost.price_per_gpu_hour == 2.5 and config.cost.currency == "EUR"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("cost.price_per_cpu_hour=-0.1", "cost.price_per_cpu_hour = -0.1: Input should be greater than or equal to 0"),
        ("cost.currency=usd", "cost.currency = 'usd': must be a 3-letter ISO 4217 currency code"),
        ("cost.currency=DOLLARS", "cost.currency = 'DOLLARS': must be a 3-letter"),
        ("cost.price_per_gpu_hour=cheap", "cost.price_per_gpu_hour = 'cheap'"),
    ],
)
def test_bad_cost_values_name_the_key(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match="^" + expected.replace("(", r"\(").replace(".", r"\.")):
        load_config(BASE, [override], env={})
