"""``trainforge bench gpu``: the headline workloads on whatever NVIDIA GPUs this machine has.

* ResNet-50 training (forward, backward, SGD) in bf16 autocast, channels-last, batch 256 of
  224x224 images per GPU, eager and ``torch.compile``: images/s on one GPU.
* The built-in ``llama_1b`` (models/language.py) trained with FSDP2 (``fully_shard`` per decoder
  layer and the root, bf16 parameters, fp32 gradient reduction) over every local GPU (NCCL):
  tokens/s and MFU, the model FLOPs per token (6 x non-embedding parameters + 12 x layers x
  heads x head_dim x sequence length for attention, as torchtitan counts them) times tokens/s over
  the GPUs' peak dense bf16 FLOP/s (``PEAKS``).

Without CUDA it refuses before doing or writing anything (one line, exit code 2). Figures are the
median step time of the timed steps after warm-up, with ``torch.cuda.synchronize`` around each.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from trainforge.errors import TrainforgeError


@dataclass(frozen=True)
class Peak:
    """A device's peak dense bf16 tensor-core throughput, as its maker publishes it (without sparsity)."""

    pattern: str  # matched against torch.cuda.get_device_name()
    device: str
    bf16_tflops: float
    source: str


# Dense figures: NVIDIA's datasheets give bf16 "with sparsity"; the dense peak is half of it.
PEAKS = (
    Peak(r"H100.*PCIe", "H100 PCIe", 756.0, "NVIDIA H100 Tensor Core GPU datasheet (1,513 TFLOPS with sparsity)"),
    Peak(r"H100.*(SXM|HBM3)", "H100 SXM", 989.0, "NVIDIA H100 Tensor Core GPU datasheet (1,979 TFLOPS with sparsity)"),
    Peak(r"H200(?!.*NVL)", "H200 SXM", 989.0, "NVIDIA H200 Tensor Core GPU datasheet (1,979 TFLOPS with sparsity)"),
    Peak(r"A100", "A100", 312.0, "NVIDIA A100 Tensor Core GPU datasheet (624 TFLOPS with sparsity)"),
    Peak(r"L40S", "L40S", 362.0, "NVIDIA L40S datasheet (733 TFLOPS with sparsity)"),
    Peak(r"\bL4\b", "L4", 121.0, "NVIDIA L4 Tensor Core GPU datasheet (242 TFLOPS with sparsity)"),
    Peak(r"\bA10\b", "A10", 125.0, "NVIDIA A10 Tensor Core GPU datasheet (250 TFLOPS with sparsity)"),
)

NO_CUDA = (
    "bench gpu: no CUDA device found (torch {version}, torch.cuda.is_available() is False); it needs an NVIDIA "
    "GPU with its driver and a CUDA build of PyTorch. Nothing was run or written."
)


def peak_for(device_name: str) -> Peak | None:
    """The peak of the first ``PEAKS`` entry whose pattern matches the device's name."""
    return next((peak for peak in PEAKS if re.search(peak.pattern, device_name)), None)


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise TrainforgeError(NO_CUDA.format(version=torch.__version__))


@dataclass(frozen=True)
class Figure:
    workload: str
    gpus: int
    step_s: float
    throughput: float
    unit: str  # "images/s" or "tokens/s"
    mfu: float | None = None


def llama_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """6 x non-embedding parameters + 12 x layers x heads x head_dim x seq_len (torchtitan's count);
    ``model`` is the built-in's module (``HFLogits`` around a transformers ``LlamaForCausalLM``)."""
    config: Any = model.model.config  # type: ignore[union-attr]
    embedding = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" in name)
    params = sum(p.numel() for p in model.parameters()) - embedding
    head_dim = config.hidden_size // config.num_attention_heads
    return 6.0 * params + 12.0 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_len


def mfu(tokens_per_s: float, flops_per_token: float, gpus: int, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the GPUs' peak."""
    return tokens_per_s * flops_per_token / (gpus * peak_tflops * 1e12)


def timed_steps(step: Callable[[], None], warmup: int, steps: int) -> float:
    """Median seconds per ``step`` after ``warmup`` untimed ones, synchronising around each."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def resnet50_images_per_s(compiled: bool, batch: int, warmup: int, steps: int) -> Figure:
    from trainforge.data.spec import DataSpec
    from trainforge.models.registry import build_builtin

    device = torch.device("cuda", 0)
    spec = DataSpec(kind="image", input_shape=(3, 224, 224), num_classes=1000)
    model = build_builtin("resnet50", spec, {}).to(device)
    model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch accepts it; its stubs do not
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images = torch.randn(batch, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch,), device=device)
    forward = torch.compile(model) if compiled else model

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(forward(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step_s = timed_steps(step, warmup, steps)
    name = "resnet50 bf16 channels_last" + (" compiled" if compiled else "")
    return Figure(name, 1, step_s, batch / step_s, "images/s")


def llama_fsdp_rank(rank: int, world: int, batch: int, seq_len: int, warmup: int, steps: int) -> dict[str, float]:
    """One NCCL rank of the llama_1b FSDP2 run (bench/ranks.spawn_ranks); rank 0's figures."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from trainforge.data.spec import DataSpec
    from trainforge.models.registry import build_builtin

    device = torch.device("cuda", rank)
    spec = DataSpec(kind="tokens", input_shape=(seq_len,), vocab_size=32_000, seq_len=seq_len)
    model = build_builtin("llama_1b", spec, {}).to(device)
    flops_per_token = llama_flops_per_token(model, seq_len)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers: Any = model.model.model.layers  # type: ignore[union-attr]  # HFLogits -> LlamaForCausalLM -> LlamaModel
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, 32_000, (batch, seq_len), device=device)

    def step() -> None:
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step_s = timed_steps(step, warmup, steps)
    return {"step_s": step_s, "flops_per_token": flops_per_token}


def llama_fsdp_tokens_per_s(batch: int, seq_len: int, warmup: int, steps: int, peak: float | None) -> Figure:
    from trainforge.bench.ranks import spawn_ranks

    gpus = torch.cuda.device_count()
    results = spawn_ranks(llama_fsdp_rank, gpus, batch, seq_len, warmup, steps, backend="nccl")
    step_s = max(r["step_s"] for r in results)
    tokens_per_s = gpus * batch * seq_len / step_s
    utilisation = mfu(tokens_per_s, results[0]["flops_per_token"], gpus, peak) if peak else None
    return Figure(f"llama_1b fsdp bf16 seq {seq_len}", gpus, step_s, tokens_per_s, "tokens/s", utilisation)


def run_gpu_bench(
    *,
    output: Path | None,
    console: Console,
    peak_tflops: float | None = None,
    resnet_batch: int = 256,
    llama_batch: int = 4,
    seq_len: int = 2048,
    warmup: int = 10,
    steps: int = 30,
) -> list[Figure]:
    """Run the workloads and print them; write them as JSON to ``output``. Refuses without CUDA."""
    require_cuda()
    name = torch.cuda.get_device_name(0)
    known = peak_for(name)
    peak = peak_tflops if peak_tflops is not None else known.bf16_tflops if known else None
    if peak is None:
        where = "peak unknown (give --peak-tflops for MFU)"
    else:
        origin = "--peak-tflops" if peak_tflops is not None else known.source if known else ""
        where = f"peak bf16 dense {peak:g} TFLOPS ({origin})"
    console.print(f"{torch.cuda.device_count()} x {name}; {where}", highlight=False)
    figures = [
        resnet50_images_per_s(False, resnet_batch, warmup, steps),
        resnet50_images_per_s(True, resnet_batch, warmup, steps),
        llama_fsdp_tokens_per_s(llama_batch, seq_len, warmup, steps, peak),
    ]
    table = Table("workload", "GPUs", "step ms", "throughput", "MFU")
    for figure in figures:
        table.add_row(
            figure.workload,
            str(figure.gpus),
            f"{figure.step_s * 1000:.1f}",
            f"{figure.throughput:,.0f} {figure.unit}",
            f"{figure.mfu * 100:.1f}%" if figure.mfu is not None else "–",
        )
    console.print(table)
    if output is not None:
        record: dict[str, Any] = {
            "device": name,
            "gpus": torch.cuda.device_count(),
            "peak_bf16_tflops": peak,
            "torch": torch.__version__,
            "figures": [asdict(f) for f in figures],
        }
        output.write_text(json.dumps(record, indent=1))
    return figures
