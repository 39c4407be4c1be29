"""Fine-tuning from an export: a llama_tiny trained on one corpus, exported with ``trainforge export
--format hf`` (transformers loads it and gives the same logits), fine-tuned from that directory on a
second corpus. Its first validation loss is below a random init's, its last below training from
scratch for the same steps, and FSDP on 2 ranks starts from the same weights. LoRA r=8 on the same
fine-tune: a few percent of the parameters, optimizer state and checkpoint bytes, a crash and
restart bit-identical under DDP and FSDP, and a merged export transformers loads with the same
logits. The worker Session in gloo ranks without Ray (tests/helpers/sessions.py); the CLI in this
process."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import Trained, assert_bit_identical, final_weights, sessions, train_each_once
from trainforge.cli import main
from trainforge.config import load_config
from trainforge.data.corpus import PrepareOptions, prepare_corpus
from trainforge.models.export import run_model
from trainforge.models.pretrained import load_pretrained

# Several trainings in gloo ranks (about 100 s): in the full suite, out of the fast subset
# (test_pretrained.py keeps the loader's own checks there).
pytestmark = pytest.mark.slow

FIRST = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from")
SECOND = ("their", "often", "and", "into", "was", "forty", "one", "that", "with", "as", "but", "at", "fresh")
LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}


def make_corpus(root: Path, name: str, words: tuple[str, ...], seed: int) -> Path:
    raw = root / f"{name}-texts"
    raw.mkdir()
    rng = random.Random(seed)
    for number in range(30):
        text = "".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + ".\n" for _ in range(20))
        (raw / f"doc{number:02d}.txt").write_text(text)
    prepare_corpus(PrepareOptions([str(raw)], root / name, tokenizer="bytes", val_fraction=0.1))
    return root / name


def lm_run(tmp: Path, corpus: Path, name: str, steps: int, **extra: Any) -> dict[str, Any]:
    return tiny_run(
        tmp,
        run={"name": name, "output_dir": str(tmp)},
        model={"name": "llama_tiny", "kwargs": LLAMA, **extra.pop("model", {})},
        data={"name": "tokens", "path": str(corpus), "seq_len": 32},
        train={"max_steps": steps, "batch_size": 16, "log_every_n_steps": 1, "eval_every_n_steps": steps},
        optim={"name": "adamw", "lr": 3e-3, **extra.pop("optim", {})},
        schedule={"name": "constant"},
        checkpoint={"every_n_steps": steps},
        seed=3,
        **extra,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("finetune")
    first, second = make_corpus(tmp, "first", FIRST, 0), make_corpus(tmp, "second", SECOND, 1)
    base = train_each_once({"base": lm_run(tmp, first, "base", 150)})["base"]
    exported = tmp / "base-hf"
    main(["export", str(base.run_dir), "--format", "hf", "--output", str(exported)])
    pretrained = {"model": {"pretrained": str(exported)}}
    fsdp = {"parallel": {"strategy": "fsdp"}, "scaling": {"num_workers": 2}}
    trained = train_each_once(
        {
            "scratch_1": lm_run(tmp, second, "scratch_1", 1),
            "tuned_1": lm_run(tmp, second, "tuned_1", 1, **pretrained),
            "scratch": lm_run(tmp, second, "scratch", 30),
            "tuned": lm_run(tmp, second, "tuned", 30, **pretrained),
            "tuned_fsdp_1": lm_run(tmp, second, "tuned_fsdp_1", 1, **pretrained, **fsdp),
            # LoRA at a larger learning rate, as usual: only the low-rank updates move.
            "lora": lm_run(
                tmp, second, "lora", 30, model={"pretrained": str(exported), "lora": {"r": 8}}, optim={"lr": 1e-2}
            ),
        }
    )
    return {"base": base, "exported": exported, "tmp": tmp, **trained}


def val_loss(run: Trained) -> float:
    return float(run.outcome.final["val/loss"])


def test_the_hf_export_loads_in_transformers_with_the_same_logits(runs: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    exported: Path = runs["exported"]
    record = json.loads((exported / "trainforge_export.json").read_text())
    assert record["step"] == 150 and record["format"] == "hf" and "model.safetensors" in record["sha256"]
    theirs = AutoModelForCausalLM.from_pretrained(exported).eval()
    base: Trained = runs["base"]
    ours = run_model(load_config(base.config))
    ours.load_state_dict(load_file(str(base.run_dir / "checkpoint_000000150" / "model.safetensors")))
    ours.eval()
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(theirs(ids).logits, ours(ids), atol=1e-5)


def test_fine_tuning_from_the_export_starts_and_ends_below_training_from_scratch(runs: dict[str, Any]) -> None:
    assert val_loss(runs["tuned_1"]) < val_loss(runs["scratch_1"]) - 0.5, (runs["tuned_1"], runs["scratch_1"])
    assert val_loss(runs["tuned"]) < val_loss(runs["scratch"]), (runs["tuned"], runs["scratch"])
    # FSDP on 2 ranks starts from the same weights: its first step's loss is the warm start's, not a random init's.
    fsdp, single = runs["tuned_fsdp_1"].outcome.losses[1], runs["tuned_1"].outcome.losses[1]
    assert fsdp < runs["scratch_1"].outcome.losses[1] - 0.5 and abs(fsdp - single) < 0.3, (fsdp, single)


def test_a_safetensors_export_holds_the_run_config_and_loads_as_model_pretrained(runs: dict[str, Any]) -> None:
    base: Trained = runs["base"]
    out = runs["tmp"] / "base-st"
    main(["export", str(base.run_dir), "--format", "safetensors", "--output", str(out), "--checkpoint", "best"])
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors", "trainforge_export.json"]
    model = run_model(load_config(out / "config.yaml"))
    load_pretrained(model, str(out / "model.safetensors"))
    expected = load_file(str(base.run_dir / "checkpoint_000000150" / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--format", "onnx"], "--format 'onnx': one of hf, safetensors"),
        (["--format", "hf", "--checkpoint", "/nowhere"], "--checkpoint /nowhere: not a checkpoint directory"),
        (["--format", "hf", "--merge-lora"], "--merge-lora: this run trained no LoRA adapters"),
        (["--format", "hf", "--existing"], "exists and is not an empty folder (nothing is overwritten)"),
    ],
)
def test_export_refuses_in_one_line_and_writes_nothing(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    base: Trained = runs["base"]
    existing = runs["tmp"] / "taken"
    existing.mkdir(exist_ok=True)
    (existing / "keep.txt").write_text("mine")
    output = existing if "--existing" in args else runs["tmp"] / "never"
    args = [a for a in args if a != "--existing"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["export", str(base.run_dir), "--output", str(output), *args])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exited.value.code == 2 and len(errors) == 1 and expected in errors[0], errors
    assert not (runs["tmp"] / "never").exists() and (existing / "keep.txt").read_text() == "mine"
    assert not list(runs["tmp"].glob(".tmp-export-*"))


def test_train_refuses_pretrained_weights_that_do_not_fit_before_ray_starts(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:

    tmp: Path = runs["tmp"]
    deeper = lm_run(tmp, tmp / "second", "deeper", 5, model={"pretrained": str(runs["exported"])})
    deeper["model"]["kwargs"] = {**LLAMA, "num_hidden_layers": 3}
    error = train_refused(tmp, deeper, capsys)
    assert "does not fit the model: 9 missing from the file (model.model.layers.2." in error


def size_of(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_lora_trains_a_few_percent_of_the_full_fine_tune_and_learns(runs: dict[str, Any]) -> None:
    lora, full = runs["lora"], runs["tuned"]
    lora_ckpt, full_ckpt = lora.run_dir / "checkpoint_000000030", full.run_dir / "checkpoint_000000030"
    adapters = load_file(str(lora_ckpt / "model.safetensors"))
    weights = load_file(str(full_ckpt / "model.safetensors"))
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)  # the base is not saved
    trainable = sum(t.numel() for t in adapters.values())
    assert trainable < 0.05 * sum(t.numel() for t in weights.values())
    optimizer = (lora_ckpt / "optimizer.pt").stat().st_size / (full_ckpt / "optimizer.pt").stat().st_size
    checkpoint = size_of(lora_ckpt) / size_of(full_ckpt)
    assert optimizer < 0.05 and checkpoint < 0.10, (optimizer, checkpoint)
    # It learns the second corpus from the pretrained start (2.13 after one step when this was written).
    scratch = val_loss(runs["scratch"])
    print(f"val/loss after 30 steps: lora {val_loss(lora):.3f}, full {val_loss(full):.3f}, scratch {scratch:.3f}")
    print(f"lora / full: trainable {trainable} elements, optimizer {optimizer:.3f}, checkpoint {checkpoint:.3f}")
    assert val_loss(lora) < val_loss(runs["tuned_1"]) - 0.3, (val_loss(lora), val_loss(runs["tuned_1"]))


def test_a_merged_lora_export_loads_in_transformers_with_the_adapted_logits(runs: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    from trainforge.models.export import adapted_model, final_model
    from trainforge.models.pretrained import checkpoint_source

    lora: Trained = runs["lora"]
    out = runs["tmp"] / "lora-merged"
    main(["export", str(lora.run_dir), "--format", "hf", "--merge-lora", "--output", str(out)])
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    config = load_config(lora.config)
    checkpoint = lora.run_dir / "checkpoint_000000030"
    ours = adapted_model(run_model(config), config, checkpoint_source(checkpoint, "t"), "t", merge_lora=False).eval()
    base = run_model(config)
    load_pretrained(base, str(runs["exported"]))
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = ours(ids)
        assert torch.allclose(theirs(ids).logits, adapted, atol=1e-5)
        assert not torch.allclose(base.eval()(ids), adapted, atol=1e-3)  # the adapters changed something
        # What generate and the model registry rebuild from a LoRA run's model.safetensors (the adapters).
        rebuilt = final_model(config, checkpoint / "model.safetensors").eval()
        assert torch.allclose(rebuilt(ids), adapted, atol=1e-5)


@pytest.fixture(scope="module")
def lora_resumes(runs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """LoRA under DDP and FSDP on 2 ranks: straight, and crashed after the step-8 checkpoint then restarted."""
    tmp: Path = runs["tmp"]
    model = {"pretrained": str(runs["exported"]), "lora": {"r": 8, "dropout": 0.1}}
    plans: list[tuple[dict[str, Any], int | None]] = []
    configs = {}
    for strategy in ("ddp", "fsdp"):
        for name in ("straight", "crashed"):
            config = lm_run(
                tmp,
                tmp / "second",
                f"lora_{strategy}_{name}",
                12,
                model=model,
                parallel={"strategy": strategy},
                scaling={"num_workers": 2},
            )
            config["checkpoint"] = {"every_n_steps": 4, "keep_last": 5}
            configs[f"{strategy}_{name}"] = config
        plans += [(configs[f"{strategy}_straight"], None), (configs[f"{strategy}_crashed"], 9)]
        plans.append((configs[f"{strategy}_crashed"], None))
    spawn_ranks(sessions, 2, plans)
    return configs


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_crashed_and_restarted_is_bit_identical(lora_resumes: dict[str, dict[str, Any]], strategy: str) -> None:
    straight, resumed = lora_resumes[f"{strategy}_straight"], lora_resumes[f"{strategy}_crashed"]
    assert_bit_identical(final_weights(straight), final_weights(resumed))
    assert all(".lora_" in name for name in final_weights(resumed))


def test_a_lora_run_exports_adapters_alone_or_merged_only_when_asked(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    lora: Trained = runs["lora"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["export", str(lora.run_dir), "--format", "hf", "--output", str(runs["tmp"] / "unmerged")])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exited.value.code == 2 and "add --merge-lora" in errors[0] and len(errors) == 1
    out = runs["tmp"] / "lora-adapters"
    main(["export", str(lora.run_dir), "--format", "safetensors", "--output", str(out)])
    saved = load_file(str(out / "model.safetensors"))
    assert saved.keys() == load_file(str(lora.run_dir / "checkpoint_000000030" / "model.safetensors")).keys()


def test_lora_targets_that_match_nothing_are_one_line_before_ray_starts(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:

    tmp: Path = runs["tmp"]
    config = lm_run(tmp, tmp / "second", "bad_lora", 5, model={"lora": {"target_modules": ["qkv"]}})
    error = train_refused(tmp, config, capsys)
    assert "model.lora.target_modules ['qkv'] cannot be applied" in error and "q_proj" in error


def train_refused(tmp: Path, config: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> str:
    """``trainforge train`` on ``config``: exit 2 with one error line (returned) and no run directory."""
    import yaml

    name = config["run"]["name"]
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["train", str(path)])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exited.value.code == 2 and len(errors) == 1, errors
    assert not (tmp / name).exists()  # nothing written for the run
    return errors[0]
