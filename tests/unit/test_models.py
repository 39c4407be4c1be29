"""Built-in models, user factories and task metrics, on real (randomly initialised) modules."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_model, save_model
from torch import nn

from tests.helpers import user_models
from trainforge.config import ModelConfig
from trainforge.data.spec import DataSpec
from trainforge.errors import ModelError
from trainforge.models import BUILTIN_MODELS, CausalLMTask, ClassificationTask, build_model, build_task
from trainforge.models.tasks import IGNORE_INDEX

DIGITS = DataSpec(kind="image", input_shape=(1, 8, 8), num_classes=10)
CIFAR = DataSpec(kind="image", input_shape=(3, 32, 32), num_classes=10)
IMAGENET = DataSpec(kind="image", input_shape=(3, 224, 224), num_classes=1000)
TOKENS = DataSpec(kind="tokens", input_shape=(16,), vocab_size=97, seq_len=16)

# name -> (data spec, batch size); the big models get 2 small images or 2 short sequences
CASES: dict[str, tuple[DataSpec, int]] = {
    "mlp": (DIGITS, 4),
    "small_cnn": (DIGITS, 4),
    "resnet18": (CIFAR, 2),
    "resnet50": (CIFAR, 2),
    "resnet152": (CIFAR, 2),
    "vit_b_16": (CIFAR, 2),
    "gpt2_small": (TOKENS, 2),
    "gpt2_base": (TOKENS, 2),
    "bert_small": (TOKENS, 2),
    "bert_base": (TOKENS, 2),
    "llama_tiny": (TOKENS, 2),
    "llama_10m": (TOKENS, 2),
}
# too big to build for real in a unit test; their shapes are checked on the meta device below
META_ONLY = {"llama_125m", "llama_1b", "llama_7b", "llama_10b", "llama_70b"}


def batch(spec: DataSpec, size: int) -> torch.Tensor:
    if spec.kind == "tokens":
        assert spec.vocab_size is not None
        return torch.randint(0, spec.vocab_size, (size, *spec.input_shape))
    return torch.randn(size, *spec.input_shape)


def expected_shape(spec: DataSpec, size: int) -> tuple[int, ...]:
    if spec.kind == "tokens":
        return (size, *spec.input_shape, spec.vocab_size or 0)
    return (size, spec.num_classes or 0)


def build(name: str, spec: DataSpec, **kwargs: Any) -> nn.Module:
    return build_model(ModelConfig(name=name, kwargs=kwargs), spec)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def test_builtin_names() -> None:
    assert set(BUILTIN_MODELS) == set(CASES) | META_ONLY


@pytest.fixture(scope="module", params=list(CASES))
def builtin(request: pytest.FixtureRequest) -> tuple[str, nn.Module]:
    """One build per built-in, shared by the tests below; pytest groups them so one model lives at a time."""
    torch.manual_seed(0)
    name = request.param
    return name, build(name, CASES[name][0])


def test_builtin_forward_backward(builtin: tuple[str, nn.Module]) -> None:
    name, model = builtin
    spec, size = CASES[name]
    model.train()
    model.zero_grad(set_to_none=True)
    assert type(model).forward is not nn.Module.forward
    x = batch(spec, size)
    out = model(x)
    assert isinstance(out, torch.Tensor)
    assert out.shape == expected_shape(spec, size)
    assert out.dtype == torch.float32
    target = torch.randint(0, out.shape[-1], out.shape[:-1])
    task = build_task(ModelConfig(name=name), spec)
    task.loss(out, target).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads), "every parameter takes part in the forward"
    assert all(torch.isfinite(g).all() for g in grads if g is not None)
    assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0


def test_builtin_state_dict_round_trips_through_safetensors(builtin: tuple[str, nn.Module], tmp_path: Path) -> None:
    name, model = builtin
    spec, size = CASES[name]
    model.eval()
    save_model(model, str(tmp_path / "model.safetensors"))
    torch.manual_seed(1)
    fresh = build(name, spec).eval()
    missing, unexpected = load_model(fresh, str(tmp_path / "model.safetensors"))
    assert (missing, unexpected) == (set(), [])
    x = batch(spec, size)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_vit_b_16_on_224_images() -> None:
    model = build("vit_b_16", IMAGENET).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 224, 224)).shape == (1, 1000)


def test_vit_interpolates_for_other_input_sizes() -> None:
    model = build("vit_b_16", CIFAR, num_hidden_layers=1).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 10)


@pytest.mark.parametrize("side", [8, 28, 224])
def test_small_cnn_any_image_size(side: int) -> None:
    model = build("small_cnn", DataSpec(kind="image", input_shape=(3, side, side), num_classes=5))
    assert model(torch.randn(2, 3, side, side)).shape == (2, 5)
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def test_mlp_has_no_batch_norm_and_takes_hidden_sizes() -> None:
    model = build("mlp", DIGITS, hidden_sizes=[32])
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 32), (32, 10)]
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_mlp_reaches_97_percent_on_digits() -> None:
    """The quickstart's promise: mlp defaults on digits in [0, 1], AdamW 3e-3, cosine, 20 epochs."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float32).div(16.0).unsqueeze(1)
    labels = torch.as_tensor(digits.target)
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    val, train = perm[:359], perm[359:]
    model = build("mlp", DIGITS)
    task = build_task(ModelConfig(name="mlp"), DIGITS)
    epochs, batch_size = 20, 64
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * math.ceil(len(train) / batch_size))
    for _ in range(epochs):
        for idx in train[torch.randperm(len(train))].split(batch_size):
            optimizer.zero_grad()
            task.loss(model(images[idx]), labels[idx]).backward()
            optimizer.step()
            schedule.step()
    model.eval()
    with torch.no_grad():
        output = model(images[val])
        sums = {k: float(v) for k, v in task.stats(output, labels[val]).items()}
        sums["loss_sum"] = float(task.loss(output, labels[val])) * sums["count"]
    assert task.finalize(sums)["accuracy"] >= 0.97


@pytest.mark.parametrize("name", ["gpt2_small", "bert_small"])
def test_language_models_are_causal(name: str) -> None:
    small = {"n_layer": 2} if name.startswith("gpt2") else {"num_hidden_layers": 2}
    model = build(name, TOKENS, **small).eval()
    x = batch(TOKENS, 1)
    changed = x.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 97
    with torch.no_grad():
        before, after = model(x), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_hf_overrides_reach_the_config() -> None:
    model = build("gpt2_small", TOKENS, n_layer=1, n_positions=32)
    assert model.model.config.n_layer == 1
    assert model.model.config.n_positions == 32
    assert model.model.config.vocab_size == 97


# ---------------------------------------------------------------------------------------------
# Errors a user can cause with model.name / model.kwargs


@pytest.mark.parametrize(
    ("name", "spec", "kwargs", "expected"),
    [
        ("resnet19", CIFAR, {}, "unknown model.name 'resnet19'; did you mean 'resnet18'? built-ins are: bert_base"),
        ("mlp", DIGITS, {"hidden": [8]}, "model.kwargs ['hidden'] do not fit built-in 'mlp'; it accepts: hidden_sizes"),
        ("mlp", DIGITS, {"hidden_sizes": 5}, "built-in 'mlp' failed to build with model.kwargs {'hidden_sizes': 5}: "),
        ("gpt2_small", TOKENS, {"n_layers": 2}, "model.kwargs ['n_layers'] are not GPT2Config fields; 'gpt2_small'"),
        ("gpt2_small", TOKENS, {"vocab_size": 5}, "model.kwargs ['vocab_size'] for 'gpt2_small' are set by trainforge"),
        ("gpt2_small", TOKENS, {"n_positions": 8}, "model.kwargs.n_positions=8 for 'gpt2_small' is shorter than"),
        ("bert_small", TOKENS, {"max_position_embeddings": 8}, "max_position_embeddings=8 for 'bert_small' is shorter"),
        ("gpt2_small", TOKENS, {"n_embd": 100, "n_head": 3}, "built-in 'gpt2_small' failed to build"),
        ("resnet18", TOKENS, {}, "built-in 'resnet18' is an image classifier but data.kind is 'tokens'"),
        ("mlp", TOKENS, {}, "built-in 'mlp' is an image classifier but data.kind is 'tokens'"),
        ("gpt2_base", CIFAR, {}, "built-in 'gpt2_base' is a language model but data.kind is 'image'"),
        ("vit_b_16", DIGITS, {}, "vit_b_16 patch size [16, 16] is larger than the 8x8 images"),
        ("small_cnn", DataSpec(kind="image", input_shape=(64,), num_classes=3), {}, "needs images shaped [C, H, W]"),
        ("resnet18", DataSpec(kind="image", input_shape=(3, 8, 8)), {}, "needs data with num_classes >= 2, got None"),
        ("bert_small", DataSpec(kind="tokens", input_shape=(8,)), {}, "needs token data with vocab_size >= 2"),
    ],
)
def test_builtin_errors(name: str, spec: DataSpec, kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ModelError) as info:
        build(name, spec, **kwargs)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_vit_patch_size_override_fits_small_images() -> None:
    model = build("vit_b_16", DIGITS, patch_size=4, num_hidden_layers=1)
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)


# ---------------------------------------------------------------------------------------------
# model.factory


def factory(path: str, **kwargs: Any) -> nn.Module:
    return build_model(ModelConfig(factory=path, kwargs=kwargs), DIGITS)


def test_factory_builds_the_users_module() -> None:
    model = factory("tests.helpers.user_models:tiny_net", hidden=8)
    assert model[1].out_features == 8
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 10)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("tests.helpers.no_such_module:tiny_net", "cannot import module 'tests.helpers.no_such_module' (No module"),
        ("tests.helpers.user_models:tiny_nett", "'tests.helpers.user_models' has no attribute 'tiny_nett'; did you"),
        (
            "tests.helpers.user_models:NOT_CALLABLE",
            "'tests.helpers.user_models:NOT_CALLABLE' is not callable (got a value of type int)",
        ),
        (  # where in the user's file it raised
            "tests.helpers.user_models:failing",
            f"'tests.helpers.user_models:failing' raised ValueError at {user_models.__file__}:",
        ),
        ("tests.helpers.user_models:not_a_module", "returned builtins.dict, expected a torch.nn.Module"),
    ],
)
def test_factory_errors(path: str, expected: str) -> None:
    with pytest.raises(ModelError) as info:
        factory(path)
    assert expected in str(info.value)


def test_factory_module_with_a_missing_dependency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "needs_dep.py").write_text("import trainforge_missing_dep_xyz\n\ndef net():\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ModelError, match=r"cannot import module 'needs_dep' \(No module named 'trainforge_missing_dep_xyz'\)"
    ):
        factory("needs_dep:net")


def test_factory_module_that_fails_on_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bad_module.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelError, match="importing module 'bad_module' raised RuntimeError: no GPU here"):
        factory("bad_module:net")


def test_factory_kwargs_that_do_not_fit() -> None:
    with pytest.raises(ModelError, match=re.escape("raised TypeError when called with model.kwargs {'width': 3}: ")):
        factory("tests.helpers.user_models:tiny_net", width=3)


# ---------------------------------------------------------------------------------------------
# Tasks


def test_classification_metrics_by_hand() -> None:
    task = ClassificationTask()
    # log-probabilities, so the cross-entropy of each row is minus the target's entry
    output = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]).log()
    target = torch.tensor([0, 1])
    loss = task.loss(output, target)
    assert loss.item() == pytest.approx((math.log(2) + math.log(5)) / 2)
    stats = task.stats(output, target)
    assert {k: (v.item(), v.dtype, v.dim()) for k, v in stats.items()} == {
        "correct": (1.0, torch.float32, 0),
        "count": (2.0, torch.float32, 0),
    }
    sums = {"loss_sum": loss.item() * 2, "correct": 1.0, "count": 2.0}
    assert task.finalize(sums) == pytest.approx({"loss": math.log(10) / 2, "accuracy": 0.5})


def test_causal_lm_metrics_by_hand() -> None:
    task = CausalLMTask()
    output = torch.tensor([[[0.5, 0.5], [0.8, 0.2], [0.9, 0.1]]]).log()
    target = torch.tensor([[0, 1, -100]])  # the data already shifted; -100 is left out
    loss = task.loss(output, target)
    assert loss.item() == pytest.approx((math.log(2) + math.log(5)) / 2)
    stats = task.stats(output, target)
    assert (stats["correct"].item(), stats["count"].item()) == (1.0, 2.0)
    metrics = task.finalize({"loss_sum": loss.item() * 2, "correct": 1.0, "count": 2.0})
    assert metrics == pytest.approx({"loss": math.log(10) / 2, "accuracy": 0.5, "perplexity": math.sqrt(10)})


def test_correct_is_argmax_without_ties_and_a_tie_with_the_target_counts() -> None:
    torch.manual_seed(0)
    output = torch.randn(4, 16, 97)
    target = torch.randint(0, 97, (4, 16))
    target[0, :8] = output[0, :8].argmax(dim=-1)  # some right, the rest mostly wrong
    target[1, 3] = IGNORE_INDEX
    counted = target != IGNORE_INDEX
    by_argmax = ((output.argmax(dim=-1) == target) & counted).sum()
    stats = CausalLMTask().stats(output, target)
    assert stats["correct"].item() == by_argmax.item() >= 8
    assert stats["count"].item() == 4 * 16 - 1
    tied = torch.tensor([[1.0, 1.0, 0.0]])
    assert ClassificationTask().stats(tied, torch.tensor([1]))["correct"].item() == 1.0


def test_perplexity_is_capped_and_empty_sums_are_nan() -> None:
    task = CausalLMTask()
    huge = task.finalize({"loss_sum": 1e6, "correct": 0.0, "count": 1.0})
    assert math.isfinite(huge["perplexity"])
    assert all(math.isnan(v) for v in task.finalize({"loss_sum": 0.0, "correct": 0.0, "count": 0.0}).values())


def test_stats_are_detached() -> None:
    output = torch.randn(4, 3, requires_grad=True)
    stats = ClassificationTask().stats(output, torch.tensor([0, 1, 2, 0]))
    assert not any(v.requires_grad for v in stats.values())


def test_shape_mismatch_is_a_model_error() -> None:
    with pytest.raises(ModelError, match=r"model output \(4, 3\) for targets \(4, 5\)"):
        ClassificationTask().loss(torch.randn(4, 3), torch.zeros(4, 5, dtype=torch.long))


def test_build_task_follows_data_kind_unless_set() -> None:
    assert build_task(ModelConfig(name="mlp"), DIGITS).name == "classification"
    assert build_task(ModelConfig(name="gpt2_small"), TOKENS).name == "causal_lm"
    assert build_task(ModelConfig(name="gpt2_small", task="classification"), TOKENS).name == "classification"
    with pytest.raises(ModelError, match=r"model\.task causal_lm needs token data"):
        build_task(ModelConfig(name="mlp", task="causal_lm"), DIGITS)


# ---------------------------------------------------------------------------------------------
# Llama sizes: parameter counts on the meta device, where even 10B parameters take no memory


@pytest.mark.parametrize(
    ("name", "vocab", "params"),
    [
        ("llama_tiny", 1000, 1_043_584),
        ("llama_10m", 32000, 10_160_256),
        ("llama_125m", 32000, 124_668_672),
        ("llama_1b", 32000, 1_104_218_112),
        ("llama_7b", 32000, 6_738_415_616),
        ("llama_10b", 32000, 10_237_096_960),
        ("llama_70b", 32000, 68_976_648_192),
        ("llama_70b", 128256, 70_553_706_496),  # Llama-3-70B as published
    ],
)
def test_llama_sizes_on_meta(name: str, vocab: int, params: int) -> None:
    spec = DataSpec(kind="tokens", input_shape=(2048,), vocab_size=vocab, seq_len=2048)
    with torch.device("meta"):
        model = build(name, spec)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == params
    config = model.model.config
    assert (config.tie_word_embeddings, config._attn_implementation) == (False, "sdpa")
    assert config.num_key_value_heads <= config.num_attention_heads
    assert config.max_position_embeddings >= 2048


def test_llama_is_causal_with_grouped_query_attention() -> None:
    model = build("llama_tiny", TOKENS, num_hidden_layers=2).eval()
    attention = model.model.model.layers[0].self_attn
    assert attention.k_proj.out_features == attention.q_proj.out_features // 2
    x = batch(TOKENS, 1)
    changed = x.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 97
    with torch.no_grad():
        before, after = model(x), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_llama_overrides_and_positions() -> None:
    model = build("llama_tiny", TOKENS, num_hidden_layers=1, rms_norm_eps=1e-5, tie_word_embeddings=True)
    config = model.model.config
    assert (config.num_hidden_layers, config.rms_norm_eps, config.vocab_size) == (1, 1e-5, 97)
    assert model.model.lm_head.weight is model.model.model.embed_tokens.weight
    long = DataSpec(kind="tokens", input_shape=(4096,), vocab_size=97, seq_len=4096)
    assert build("llama_tiny", long).model.config.max_position_embeddings == 4096
    too_short = "max_position_embeddings=8 for 'llama_tiny' is shorter than data.seq_len=16"
    with pytest.raises(ModelError, match=re.escape(too_short)):
        build("llama_tiny", TOKENS, max_position_embeddings=8)
    with pytest.raises(ModelError, match=r"\['n_layer'\] are not LlamaConfig fields"):
        build("llama_tiny", TOKENS, n_layer=2)
