"""Host memory per rank while FSDP ranks load pretrained weights: ``python -m trainforge.bench.pretrained``.

Writes a Llama of ``--hidden``/``--layers`` (about 1.1 GB of float32 weights by default) as a
Hugging Face directory, then in ``--workers`` local gloo ranks builds it, shards it with FSDP2 and
loads the directory twice: as ``model.pretrained`` does under FSDP (parameters built on the meta
device, sharded, memory for the shards only; each rank reads the slices it keeps out of the
memory-mapped file) and, for comparison, as a random init of the whole model per rank followed by a
whole copy of the file (every tensor copied into the process, then each rank keeps its slices).
Both the build and the load are measured. A thread samples each rank's
resident memory every 5 ms; a figure is the peak over the phase minus the resident memory before
it. The goal for the sliced load is below 1/N of the weights plus the largest tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import tempfile
import time
from typing import Any

import torch

from trainforge.bench.ranks import spawn_ranks

GB = 1e9


def llama_config(hidden: int, layers: int, vocab: int) -> Any:
    from transformers import LlamaConfig

    heads = max(1, hidden // 64)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        tie_word_embeddings=False,
    )


def rank_load(rank: int, world: int, folder: str, hidden: int, layers: int, vocab: int, mode: str) -> dict[str, Any]:
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from trainforge.models.pretrained import (
        PeakMemory,
        load_pretrained,
        local_index,
        materialize,
        parameters_on_meta,
        target_tensors,
    )

    # "slices" builds as trainforge's workers do with model.pretrained under FSDP: parameters on the
    # meta device, sharded, then memory for the shards only. "whole": random weights, whole, sharded.
    with PeakMemory() as building:
        with parameters_on_meta() if mode == "slices" else contextlib.nullcontext():
            model = LlamaForCausalLM(llama_config(hidden, layers, vocab))
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        if mode == "slices":
            materialize(model, torch.device("cpu"))
        gc.collect()
    started = time.perf_counter()
    with PeakMemory() as memory:
        if mode == "slices":
            read = load_pretrained(model, folder).bytes_read
        else:
            # a whole copy in this process (load_file alone maps the file and copies lazily)
            whole = {name: t.clone() for name, t in load_file(f"{folder}/model.safetensors").items()}
            read = sum(t.numel() * t.element_size() for t in whole.values())
            with torch.no_grad():
                for name, tensor in target_tensors(model).items():
                    index, local = local_index(tensor)
                    local.copy_(whole[name][index])
            del whole
    elapsed = time.perf_counter() - started
    return {"rank": rank, "mode": mode, "read": read, "added": memory.added, "build": building.added, "s": elapsed}


def run(hidden: int, layers: int, vocab: int, workers: int) -> list[dict[str, Any]]:
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="tf-pretrained-") as tmp:
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(hidden, layers, vocab))
        weights = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        largest = max(p.numel() * p.element_size() for p in model.state_dict().values())
        model.save_pretrained(tmp)
        del model
        print(
            f"llama hidden {hidden}, {layers} layers, vocab {vocab}: {weights / GB:.2f} GB of weights, "
            f"largest tensor {largest / GB:.3f} GB; goal per rank (1/{workers} + largest): "
            f"{(weights / workers + largest) / GB:.2f} GB"
        )
        rows = []
        for mode in ("slices", "whole"):
            rows += spawn_ranks(rank_load, workers, tmp, hidden, layers, vocab, mode)
        header = f"{'load':<8} {'rank':>4} {'read GB':>8} {'load: peak added GB':>20} {'s':>6}"
        print(f"{header} {'build: peak added GB':>21}")
        for row in rows:
            print(
                f"{row['mode']:<8} {row['rank']:>4} {row['read'] / GB:>8.2f} {row['added'] / GB:>20.2f} "
                f"{row['s']:>6.2f} {row['build'] / GB:>21.2f}"
            )
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    run(args.hidden, args.layers, args.vocab, args.workers)


if __name__ == "__main__":
    main()
