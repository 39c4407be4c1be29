"""``trainforge export --format hf`` into the Hugging Face ecosystem: a built-in GPT-2 (tied
embeddings) and a factory's bare ``GPT2LMHeadModel`` trained on a byte corpus, a ``llama_tiny`` on a
BPE corpus. Each export loads in ``AutoModelForCausalLM`` with trainforge's logits, its tokenizer in
``AutoTokenizer`` with the corpus's ids for any text, ``pipeline("text-generation")`` generates from
it, and a fine-tune from it starts at the loss of the run's own weights. The factory's module lies
only in the working directory when it is exported. Training runs in gloo ranks without Ray
(tests/helpers/sessions.py); the CLI in this process."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.runs import tiny_run
from tests.helpers.sessions import Trained, train_each_once
from trainforge.cli import main
from trainforge.config import load_config, to_yaml
from trainforge.data.corpus import PrepareOptions, prepare_corpus
from trainforge.data.tokenizer import Tokenizer, load_corpus_tokenizer
from trainforge.models.export import run_model
from trainforge.models.pretrained import load_pretrained

# Six short trainings in gloo ranks (about a minute on 2 busy cores): out of the fast subset.
pytestmark = pytest.mark.slow

WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from")
GPT2 = {"n_layer": 1, "n_embd": 32, "n_head": 2}
LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
FACTORY_MODULE = "tf_export_factory_gpt2"
FACTORY_CODE = """
from transformers import GPT2Config, GPT2LMHeadModel


def make(vocab_size: int = 257):
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_layer=1, n_embd=32, n_head=2, n_positions=64))
"""
STEPS = 4
CORPORA = {"bytes": "bytes", "bpe": "bpe:300", "prepared_again": "bytes"}
MODELS = ("gpt2_small", "llama_tiny", "factory_gpt2")


def make_corpus(root: Path, name: str, tokenizer: str) -> Path:
    raw = root / f"{name}-texts"
    raw.mkdir()
    rng = random.Random(0)
    for number in range(20):
        text = "".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + ".\n" for _ in range(20))
        (raw / f"doc{number:02d}.txt").write_text(text + "naïve café – 東京 🙂\n")
    prepare_corpus(PrepareOptions([str(raw)], root / name, tokenizer=tokenizer, val_fraction=0.1))
    return root / name


def lm_run(tmp: Path, corpus: Path, name: str, steps: int, model: dict[str, Any]) -> dict[str, Any]:
    return tiny_run(
        tmp,
        run={"name": name, "output_dir": str(tmp)},
        model=model,
        data={"name": "tokens", "path": str(corpus), "seq_len": 16},
        train={"max_steps": steps, "batch_size": 8, "log_every_n_steps": 1, "eval_every_n_steps": steps},
        optim={"name": "adamw", "lr": 3e-3},
        schedule={"name": "constant"},
        checkpoint={"every_n_steps": steps},
        seed=3,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("export-hf")
    code = tmp / "code"
    code.mkdir()
    (code / f"{FACTORY_MODULE}.py").write_text(FACTORY_CODE)
    corpora = {name: make_corpus(tmp, name, tokenizer) for name, tokenizer in CORPORA.items()}
    models = {
        "gpt2_small": ("bytes", {"name": "gpt2_small", "kwargs": GPT2}),
        "llama_tiny": ("bpe", {"name": "llama_tiny", "kwargs": LLAMA}),
        "factory_gpt2": ("bytes", {"name": None, "factory": f"{FACTORY_MODULE}:make"}),
        "gpt2_prepared_again": ("prepared_again", {"name": "gpt2_small", "kwargs": GPT2}),
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(code))  # the ranks import the factory as a run's workers do
        trained = train_each_once({name: lm_run(tmp, corpora[c], name, STEPS, m) for name, (c, m) in models.items()})
    sys.modules.pop(FACTORY_MODULE, None)  # from here on importable from the working directory only
    shutil.rmtree(corpora["prepared_again"])  # its vocabulary changes under the trained run
    shutil.rmtree(tmp / "prepared_again-texts")
    make_corpus(tmp, "prepared_again", "bpe:300")
    exported = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(code)
        for name in MODELS:
            exported[name] = tmp / "exports" / name  # --output makes its parent folders
            main(["export", str(trained[name].run_dir), "--format", "hf", "--output", str(exported[name]),
                  "--trust-run-config"])  # fmt: skip
        assert FACTORY_MODULE in sys.modules
    fine_tunes = {
        f"{name}-{origin}": lm_run(
            tmp, corpora[models[name][0]], f"{name}-{origin}", 1, {**models[name][1], "pretrained": str(source)}
        )
        for name in MODELS
        for origin, source in (("export", exported[name]), ("run", trained[name].run_dir))
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(code))
        tuned = train_each_once(fine_tunes)
    return {"tmp": tmp, "corpora": corpora, "trained": trained, "exported": exported, "tuned": tuned}


def trainforge_logits(run: Trained, ids: torch.Tensor) -> torch.Tensor:
    """The run's model as trainforge builds and loads it (its newest checkpoint), on ``ids``."""
    model = run_model(load_config(run.config))
    load_pretrained(model, str(run.run_dir))
    with torch.no_grad():
        output = model.eval()(ids)
    return output if isinstance(output, torch.Tensor) else output.logits


@pytest.mark.parametrize("name", MODELS)
def test_the_export_loads_in_transformers_with_trainforge_s_logits(runs: dict[str, Any], name: str) -> None:
    from transformers import AutoModelForCausalLM

    folder: Path = runs["exported"][name]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    record = json.loads((folder / "trainforge_export.json").read_text())
    assert record["step"] == STEPS and "tokenizer.json" in record["sha256"]
    theirs = AutoModelForCausalLM.from_pretrained(folder).eval()
    vocab = theirs.config.vocab_size
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = theirs(ids).logits
    torch.testing.assert_close(got, trainforge_logits(runs["trained"][name], ids), atol=1e-5, rtol=0)
    if name != "llama_tiny":  # GPT-2 ties its output layer to the input embedding: still tied in transformers
        assert theirs.lm_head.weight.data_ptr() == theirs.transformer.wte.weight.data_ptr()


@pytest.mark.parametrize("name", MODELS)
def test_pipeline_generates_text_from_the_export(runs: dict[str, Any], name: str) -> None:
    from transformers import pipeline

    generator = pipeline("text-generation", model=str(runs["exported"][name]), device="cpu")
    prompt = "the cat"
    text = generator(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert text.startswith(prompt) and len(text) > len(prompt), text
    eos = generator.tokenizer.eos_token_id
    assert generator.model.config.eos_token_id == eos == generator.model.generation_config.pad_token_id
    assert generator.tokenizer.convert_ids_to_tokens(eos) == "<|endoftext|>"


@pytest.mark.parametrize("name", MODELS)
def test_a_fine_tune_from_the_export_starts_at_the_run_s_own_loss(runs: dict[str, Any], name: str) -> None:
    """The same first batch through the exported weights and through the run's checkpoint."""
    tuned = runs["tuned"]
    from_export, from_run = tuned[f"{name}-export"].outcome.losses[1], tuned[f"{name}-run"].outcome.losses[1]
    assert from_export == pytest.approx(from_run, abs=1e-5), (from_export, from_run)
    assert from_export < runs["trained"][name].outcome.losses[1]  # the trained weights, not a fresh init


TEXTS = [
    "",
    " ",
    "\n\n\t  \r\n",
    "the cat sat",
    "  leading and trailing  ",
    "naïve café – 東京 🙂 👩🏽‍💻",
    "<|endoftext|>",
    "a<|endoftext|>b <|endoftext|>",
    "\x00\x01\x7f",
    "Ġ Ċ ĉ",  # GPT-2's printable stand-ins for bytes, as text
]


def corpus_and_export(runs: dict[str, Any], kind: str) -> tuple[Tokenizer, Any]:
    from transformers import AutoTokenizer

    corpus = runs["corpora"][kind]
    name = "gpt2_small" if kind == "bytes" else "llama_tiny"
    tokenizer = load_corpus_tokenizer(corpus, "bytes" if kind == "bytes" else "bpe", str(corpus))
    return tokenizer, AutoTokenizer.from_pretrained(runs["exported"][name])


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_the_exported_tokenizer_gives_the_corpus_s_ids(runs: dict[str, Any], kind: str) -> None:
    ours, theirs = corpus_and_export(runs, kind)
    assert theirs.eos_token == "<|endoftext|>" and theirs.eos_token_id == ours.eod_id
    assert len(theirs) == ours.vocab_size and theirs.model_max_length == 16
    for text in TEXTS:
        assert theirs.encode(text) == ours.encode(text).tolist(), text
        assert theirs(text)["input_ids"] == ours.encode(text).tolist(), text
        assert theirs.decode(theirs.encode(text), skip_special_tokens=True) == ours.decode(ours.encode(text)), text

    @settings(max_examples=300, deadline=None)
    @given(st.text(max_size=80))
    def same_ids(text: str) -> None:
        assert theirs.encode(text) == ours.encode(text).tolist()

    same_ids()


def test_generate_imports_the_factory_from_the_working_directory(
    runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A finished run's directory (its config.yaml and final weights) of a factory model whose module
    lies beside the user, not on the Python path: generate imports it as the run's workers did."""
    run: Trained = runs["trained"]["factory_gpt2"]
    run_dir = runs["tmp"] / "finished-factory"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(to_yaml(load_config(run.config)))
    shutil.copy(sorted(run.run_dir.glob("checkpoint_*"))[-1] / "model.safetensors", run_dir / "model.safetensors")
    sys.modules.pop(FACTORY_MODULE, None)
    monkeypatch.chdir(runs["tmp"] / "code")
    capsys.readouterr()
    main(["generate", str(run_dir), "--prompt", "the", "--max-tokens", "4", "--trust-run-config"])
    assert capsys.readouterr().out.startswith("the") and FACTORY_MODULE in sys.modules
    sys.modules.pop(FACTORY_MODULE, None)
    with pytest.raises(SystemExit) as exited:  # the run directory's config is still data without the flag
        main(["generate", str(run_dir), "--prompt", "the"])
    assert exited.value.code == 2 and FACTORY_MODULE not in sys.modules


def test_export_output_under_a_file_is_one_line(runs: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    blocker = runs["tmp"] / "a-file"
    blocker.write_text("mine")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["export", str(runs["trained"]["gpt2_small"].run_dir), "--format", "hf", "--output", str(blocker / "b")])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exited.value.code == 2 and len(errors) == 1 and "is a file, not a folder" in errors[0], errors
    assert blocker.read_text() == "mine"


def test_a_run_whose_corpus_changed_since_is_one_line_that_says_so(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Its weights no longer fit the model the config rebuilds: no model.pretrained_strict hint (export has no
    such key), the likely cause instead."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["export", str(runs["trained"]["gpt2_prepared_again"].run_dir), "--format", "safetensors",
              "--output", str(runs["tmp"] / "never-written")])  # fmt: skip
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exited.value.code == 2 and len(errors) == 1, errors
    assert "does not fit the model" in errors[0] and "was data.path prepared again" in errors[0], errors
    assert "pretrained_strict" not in errors[0] and not (runs["tmp"] / "never-written").exists()
