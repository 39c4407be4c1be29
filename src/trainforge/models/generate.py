"""``trainforge generate RUN_DIR``: text sampled from the final model of a run trained on a token corpus.

The run directory holds what is needed besides the tokenizer: the resolved ``config.yaml`` (which
model, which ``data.seq_len``, where the corpus is) and ``model.safetensors`` (the final weights).
The tokenizer is the corpus's own, read through the config's ``data.path``. Sampling runs on the CPU,
one token at a time, on the last ``data.seq_len`` tokens (the longest context the model was
trained on), and stops at the end-of-document token or after ``max_tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_model
from torch import nn

from trainforge.config import load_run_config
from trainforge.data.spec import DataSpec
from trainforge.data.tokenizer import Tokenizer
from trainforge.errors import CheckpointError, ModelError, printable
from trainforge.files import safetensors_header
from trainforge.models import build_model
from trainforge.models.export import final_model
from trainforge.models.hub import run_tokenizer, token_data
from trainforge.models.outputs import logits_of

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.yaml"


@dataclass(frozen=True)
class Sampling:
    """How to draw each token: ``temperature`` 0 is greedy; ``top_k`` 0 keeps every token."""

    max_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 0
    seed: int = 0


@dataclass
class RunModel:
    """A finished run's language model, ready to sample from."""

    model: nn.Module
    tokenizer: Tokenizer
    seq_len: int


def load_run_model(run_dir: Path, *, trust_run_config: bool = False) -> RunModel:
    """The final model of the run at ``run_dir`` and its corpus's tokenizer; one-line errors otherwise.
    The run's config is data: one that names code to import needs ``trust_run_config``."""
    config_path, weights = run_dir / CONFIG_FILE, run_dir / WEIGHTS_FILE
    if not config_path.is_file():
        raise CheckpointError(f"RUN_DIR {run_dir} holds no {CONFIG_FILE}: not a trainforge run directory")
    if not weights.is_file():
        raise CheckpointError(
            f"RUN_DIR {run_dir} holds no {WEIGHTS_FILE}: the run has not finished (or saved no checkpoint)"
        )
    config = load_run_config(config_path, f"RUN_DIR {run_dir}: {CONFIG_FILE}", trust=trust_run_config)
    tokenizer, manifest = run_tokenizer(config)
    seq_len = token_data(config).seq_len
    spec = DataSpec(kind="tokens", input_shape=(seq_len,), vocab_size=manifest.vocab_size, seq_len=seq_len)
    model = build_model(config.model, spec)
    safetensors_header(weights, f"RUN_DIR {run_dir}: {WEIGHTS_FILE}", ModelError)  # bounded before it is parsed
    try:
        if config.model.lora is not None:  # the file holds the adapters: the base and them, merged
            model = final_model(config, weights)
        else:
            load_model(model, str(weights), strict=True)
    except Exception as err:  # safetensors' header errors, missing or unexpected keys, shape mismatches
        first = printable(" ".join(str(err).split()))[:300]
        raise ModelError(
            f"{weights} does not load into {config.model.name or config.model.factory} with the corpus's "
            f"vocabulary of {manifest.vocab_size} ({type(err).__name__}: {first}); was data.path prepared again since?"
        ) from None
    model.eval()
    return RunModel(model, tokenizer, seq_len)


@torch.no_grad()
def sample(run: RunModel, prompt: str, sampling: Sampling) -> str:
    """``prompt`` and what the model writes after it, as text.

    The context starts with the end-of-document token: in training every document follows one, so
    the prompt reads as the start of a document.
    """
    generator = torch.Generator().manual_seed(sampling.seed)
    eod = run.tokenizer.eod_id
    ids = [eod, *run.tokenizer.encode(prompt).tolist()]
    for _ in range(sampling.max_tokens):
        context = torch.tensor([ids[-run.seq_len :]], dtype=torch.int64)
        logits = logits_of(run.model(context), "causal_lm")[0, -1].float()  # a ModelOutput's too
        token = next_token(logits, sampling, generator)
        if token == eod:
            break
        ids.append(token)
    return run.tokenizer.decode(ids[1:])


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
