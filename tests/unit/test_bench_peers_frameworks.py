"""``bench peers``' peers (f) Lightning and (g) Accelerate, its ``--peers`` names, the ``lm``
workload and the start-up column: the pure parts, fast (the measurements themselves are in
docs/benchmarks.md, run by hand)."""

from __future__ import annotations

import pytest
import torch

from trainforge.bench import roster
from trainforge.bench.peers import GOALS, Measurement, accelerate_command, startup_table, summarise
from trainforge.bench.roster import PEERS, default_peers, missing_note, parse_peers, parse_workload
from trainforge.bench.workload import KINDS, SEQ_LEN, WARMUP_STEPS, Workload, loss_of, make_optimizer
from trainforge.errors import TrainforgeError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("abcde", ["a", "b", "c", "d", "e"]),
        ("gd", ["d", "g"]),  # the table's order, whatever the user's
        ("d,lightning,g", ["d", "f", "g"]),
        ("lightning", ["f"]),
        ("Trainforge, ray_train", ["c", "d"]),
        ("abcdefg", list(PEERS)),
    ],
)
def test_peers_are_letters_or_names(monkeypatch: pytest.MonkeyPatch, text: str, expected: list[str]) -> None:
    monkeypatch.setitem(roster.EXTRAS, "f", ("json", "lightning"))  # whether or not the bench extra is here
    monkeypatch.setitem(roster.EXTRAS, "g", ("csv", "accelerate"))
    assert parse_peers(text) == expected


@pytest.mark.parametrize("text", ["dx", "", "d,,e", "de,f", "deepspeed"])
def test_an_unknown_peer_is_one_line_naming_letters_and_names(text: str) -> None:
    with pytest.raises(TrainforgeError) as err:
        parse_peers(text)
    message = str(err.value)
    assert message.startswith(f"--peers {text!r}: letters from abcdefg or names pytorch, torchrun"), message
    assert "\n" not in message


def test_default_peers_are_those_whose_packages_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(roster.EXTRAS, "f", ("json", "lightning"))  # a module every Python has
    monkeypatch.setitem(roster.EXTRAS, "g", ("csv", "accelerate"))
    assert default_peers() == list(PEERS)
    assert missing_note(default_peers()) is None


def test_a_peer_without_its_package_is_left_out_with_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(roster.EXTRAS, "f", ("trainforge_no_such_module", "lightning"))
    monkeypatch.setitem(roster.EXTRAS, "g", ("csv", "accelerate"))
    assert default_peers() == ["a", "b", "c", "d", "e", "g"]
    note = missing_note(default_peers())
    assert (
        note
        == "not measured: (f) Lightning DDP (lightning), not installed here; pip install 'trainforge[bench]' adds them"
    )
    with pytest.raises(
        TrainforgeError, match=r"needs lightning, which is not installed: pip install 'trainforge\[bench\]'"
    ):
        parse_peers("d,f")


def test_workload_is_cnn_or_lm() -> None:
    assert parse_workload("lm") == "lm"
    with pytest.raises(TrainforgeError, match="--workload 'gpt': cnn or lm"):
        parse_workload("gpt")


def test_every_peer_has_a_goal_against_trainforge_at_or_above_the_frameworks() -> None:
    assert GOALS["d/f"] == GOALS["d/g"] == 1.00


def test_accelerate_starts_one_process_with_cpu_and_several_through_its_torchrun_launcher() -> None:
    one = accelerate_command(1)
    assert one[1:4] == ["-m", "accelerate.commands.launch", "--cpu"]
    assert one[one.index("--num_processes") + 1] == "1"
    assert one[-2:] == ["-m", "trainforge.bench._accelerate_worker"]
    two = accelerate_command(2)
    assert "--cpu" not in two and "--multi_gpu" in two
    assert two[two.index("--num_processes") + 1] == "2"
    assert 0 < int(two[two.index("--main_process_port") + 1]) < 65536


def test_lm_workload_trains_llama_tiny_on_tokens_with_adamw_in_every_peer() -> None:
    workload = Workload.sized_for(steps=20, batch_size=4, max_workers=2, kind="lm")
    assert workload.num_samples == (WARMUP_STEPS + 20) * 4 * 2
    config = workload.trainforge_config(2, name="x", output_dir="/tmp")
    assert config["model"]["name"] == "llama_tiny"
    assert config["data"]["kind"] == "tokens" and config["data"]["seq_len"] == SEQ_LEN
    assert config["optim"] == {"name": "adamw", "lr": 0.003, "weight_decay": 0.1}
    assert KINDS["lm"].unit == "tokens/s" and KINDS["lm"].per_sample == SEQ_LEN
    assert Workload.from_json(workload.to_json()) == workload


def test_hand_written_peers_decay_matrices_only_as_trainforge_does() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = make_optimizer(model, "lm")
    assert isinstance(optimizer, torch.optim.AdamW)
    decayed, plain = optimizer.param_groups
    assert [p.shape for p in decayed["params"]] == [torch.Size([3, 4])] and decayed["weight_decay"] == 0.1
    assert len(plain["params"]) == 3 and plain["weight_decay"] == 0.0
    sgd = make_optimizer(model, "cnn")
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9


def test_one_loss_for_images_and_token_positions() -> None:
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(7, (2, 5))
    expected = torch.nn.functional.cross_entropy(logits.reshape(10, 7), targets.reshape(10))
    assert torch.allclose(loss_of(logits, targets), expected)
    images = torch.randn(3, 10)
    labels = torch.randint(10, (3,))
    assert torch.allclose(loss_of(images, labels), torch.nn.functional.cross_entropy(images, labels))


def test_rows_quote_tokens_per_second_and_median_first_steps() -> None:
    measurements = [
        Measurement("a", 2, repeat, rate, 10.0, 0.5, first)
        for repeat, (rate, first) in enumerate([(10.0, 3.0), (30.0, 9.0), (20.0, 4.0)])
    ] + [Measurement("d", 2, repeat, rate, 10.0, 0.5, 6.0) for repeat, rate in enumerate([10.0, 10.0, 10.0])]
    (row,) = summarise(measurements, [2], "ad", per_sample=SEQ_LEN)
    assert row["a"] == 20.0 * SEQ_LEN and row["d"] == 10.0 * SEQ_LEN
    assert row["first_step_s"] == {"a": 4.0, "d": 6.0}
    table = startup_table([row], "ad")
    assert [column.header for column in table.columns] == ["workers", "(a) PyTorch\n1 process", "(d)\ntrainforge"]
    assert [list(column.cells) for column in table.columns] == [["2"], ["4.0"], ["6.0"]]
