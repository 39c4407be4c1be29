"""``bench startup``'s cold plain Ray Train peer: the script a user writes, run by its path.

It imports torch and Ray and nothing of trainforge (run as a file, not ``-m``, so the package is not
imported either), defines its model and data in place (bench/workload.py's small CNN shape, random
3x32x32 images of 10 classes) and lets ``TorchTrainer.fit`` start a local Ray, as the user's command
does. Rank 0 stamps the wall-clock end of its first optimizer step; the script writes it to ``--out``
as ``{"first_step_unix": ...}``. (Its workers used to run bench/workload.py's loop, whose import of
trainforge's data and model builders was start-up a user's script does not have.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
from ray.train.torch import TorchTrainer
from torch import nn


def small_cnn(widths: tuple[int, ...] = (16, 32, 64), classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = []
    channels = 3
    for width in widths:
        layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        layers.append(nn.MaxPool2d(2, ceil_mode=True))
        channels = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))


def train_loop(config: dict[str, Any]) -> dict[str, float]:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    samples = config["batch_size"] * config["steps"] * ray.train.get_context().get_world_size()
    images = torch.randn(samples, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(images, labels), batch_size=config["batch_size"], shuffle=True
    )
    loader = ray.train.torch.prepare_data_loader(loader)
    model = ray.train.torch.prepare_model(small_cnn())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    first = 0.0
    for step, (x, y) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 0:
            first = time.time()
        if step + 1 == config["steps"]:
            break
    ray.train.report({"loss": loss.item()})
    return {"first_step_unix": first}


def main() -> None:
    parser = argparse.ArgumentParser(description="bench startup's plain Ray Train peer")
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    trainer = TorchTrainer(
        train_loop,  # type: ignore[arg-type]  # Train V2 passes the return value on; the stubs are V1's
        train_loop_config={"batch_size": args.batch_size, "steps": args.steps},
        scaling_config=ray.train.ScalingConfig(num_workers=args.workers),
        run_config=ray.train.RunConfig(name="ray", storage_path=str(out.parent)),
    )
    returned = getattr(trainer.fit(), "return_value", None)  # Train V2's Result; mypy sees V1's
    out.write_text(json.dumps(returned))


if __name__ == "__main__":
    main()
