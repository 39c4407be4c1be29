"""Files given as input are untrusted: the names they hold are printed as data (one line, no
control character reaches the console or a log), a safetensors header is refused by its length
before it is parsed, a model directory's link is not followed out of it, and weights that are not
finite are refused by name. Paths given as outputs: a link, a file where a folder belongs, or the
reverse is one line and exit 2, never a traceback and never written through (docs/security.md)."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trainforge.cli import main
from trainforge.errors import CheckpointError, ModelError, printable, shown
from trainforge.files import SAFETENSORS_MAX_HEADER, SAFETENSORS_MAX_TENSORS, human_size
from trainforge.models.pretrained import check_pretrained, load_pretrained, resolve
from trainforge.redact import redacting


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """``trainforge ARGS`` in this process: exit 2 and exactly one line on stderr, returned."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert err.count("\n") == 1 and err.startswith("error:"), err
    return err


CONTROLS = "\n\r\x1b\x85\x7f\x00\u202e\u2028"


@pytest.mark.parametrize(
    "name", ["evil\n\x1b[31mred\x1b[0m.weight", "txt.\u202eexe.weight", "a\rb\x85c\x7f\u2028d\x00.bias"]
)
def test_a_tensor_name_from_a_pretrained_file_is_printed_as_data(tmp_path: Path, name: str) -> None:
    """The check before the start (the model on the meta device) and the worker's load: the name
    escaped in the one-line error, whether the file's names match none or some of the model's."""
    path = tmp_path / "hostile.safetensors"
    save_file({name: torch.zeros(2)}, str(path))
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    with pytest.raises(ModelError, match="none of its tensors matches") as raised:
        check_pretrained(model, str(path))
    save_file({name: torch.zeros(2), "weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, str(path))
    with pytest.raises(ModelError, match="does not fit the model") as unexpected:
        load_pretrained(torch.nn.Linear(2, 2), str(path))
    for message in (str(raised.value), str(unexpected.value)):
        assert not any(c in message for c in CONTROLS), repr(message)
        assert printable(name) in message  # escaped, as Python writes it: \n, \x1b, \u202e


def test_the_cli_prints_every_error_on_one_line_without_control_characters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The choke point: a name from the disk (a shell's glob gave it) in any error message."""
    hostile = tmp_path / "run\n\x1b[2Jerror: forged\u202e"
    err = refused(capsys, "export", str(hostile), "--format", "safetensors", "--output", str(tmp_path / "out"))
    assert not any(c in err.removesuffix("\n") for c in CONTROLS), repr(err)
    assert "run\\n\\x1b[2Jerror: forged\\u202e: no such directory" in err


def test_a_name_is_escaped_in_every_log_line(tmp_path: Path) -> None:
    """Trainforge's own log lines stay one line; another library's keep their line breaks; no
    terminal escape or bidi override reaches either."""
    stream = io.StringIO()
    handler = redacting(logging.StreamHandler(stream))
    for logger_name in ("trainforge.test_untrusted", "elsewhere"):
        logger = logging.getLogger(logger_name)
        logger.addHandler(handler)
        try:
            logger.warning("skipping %s", "evil\n\x1b]0;title\x07\u202eend")
        finally:
            logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines == ["skipping evil\\n\\x1b]0;title\\x07\\u202eend", "skipping evil", "\\x1b]0;title\\x07\\u202eend"]


def test_shown_quotes_cuts_and_escapes() -> None:
    assert shown("encoder.weight") == "'encoder.weight'"
    assert shown("a\nb\x1b") == "'a\\nb\\x1b'"
    long = shown("x" * 1000)
    assert len(long) < 220 and long.endswith("...'")
    assert printable("caf\u00e9 \u4e2d") == "caf\u00e9 \u4e2d"  # printable text stays as it is


def big_header(path: Path, length: int, entries: int) -> None:
    """A safetensors file whose header is ``length`` bytes listing ``entries`` empty tensors (padded
    with spaces), with no data: what a hostile file costs to write, not to parse."""
    body = ",".join(f'"t{i}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}' for i in range(entries))
    raw = ("{" + body + "}").encode()
    assert len(raw) <= length
    path.write_bytes(struct.pack("<Q", length) + raw + b" " * (length - len(raw)))


def test_a_huge_header_is_refused_by_its_length_before_it_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    big_header(path, SAFETENSORS_MAX_HEADER + 8, 1000)
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    with pytest.raises(ModelError, match=f"more than the {human_size(SAFETENSORS_MAX_HEADER)} trainforge reads"):
        check_pretrained(model, str(path))
    many = tmp_path / "many.safetensors"
    big_header(many, SAFETENSORS_MAX_HEADER // 2, SAFETENSORS_MAX_TENSORS + 1)
    with pytest.raises(ModelError, match=f"more than {SAFETENSORS_MAX_TENSORS} tensors"):
        load_pretrained(torch.nn.Linear(2, 2), str(many))
    short = tmp_path / "short.safetensors"
    short.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")  # a length beyond the file's end
    with pytest.raises(ModelError, match="ends before its header does"):
        load_pretrained(torch.nn.Linear(2, 2), str(short))


def test_a_model_directory_link_is_followed_only_inside_it(tmp_path: Path) -> None:
    secret = tmp_path / "elsewhere" / "secret.safetensors"
    secret.parent.mkdir()
    save_file({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, str(secret))
    for layout in ("hf", "run"):
        model_dir = tmp_path / layout
        model_dir.mkdir()
        if layout == "hf":
            (model_dir / "config.json").write_text("{}")
        (model_dir / "model.safetensors").symlink_to(secret)
        with pytest.raises(ModelError, match=r"is a symbolic link to .* outside the model directory"):
            resolve(str(model_dir))
    indexed = tmp_path / "indexed"
    indexed.mkdir()
    (indexed / "config.json").write_text("{}")
    (indexed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"weight": "shard.safetensors"}}))
    (indexed / "shard.safetensors").symlink_to(secret)
    with pytest.raises(ModelError, match=r"'shard\.safetensors' is a symbolic link"):
        resolve(str(indexed))
    # A link inside the directory, and a Hugging Face cache snapshot's link into its blobs/, are followed.
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "config.json").write_text("{}")
    save_file({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, str(inside / "real.safetensors"))
    (inside / "model.safetensors").symlink_to("real.safetensors")
    assert resolve(str(inside)).files == (inside / "model.safetensors",)
    cache = tmp_path / "models--org--name"
    (cache / "blobs").mkdir(parents=True)
    snapshot = cache / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    save_file({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, str(cache / "blobs" / "0123abcd"))
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").symlink_to("../../blobs/0123abcd")
    model = torch.nn.Linear(2, 2)
    load_pretrained(model, str(snapshot))
    assert torch.equal(model.weight, torch.ones(2, 2))


@pytest.mark.parametrize(
    ("value", "dtype"), [(math.nan, torch.float32), (-math.inf, torch.float32), (1e10, torch.float16)]
)
def test_weights_that_are_not_finite_are_refused_by_name(tmp_path: Path, value: float, dtype: torch.dtype) -> None:
    path = tmp_path / "weights.safetensors"
    weight = torch.zeros(2, 2)
    weight[1, 0] = value
    save_file({"weight": weight, "bias": torch.zeros(2)}, str(path))
    model = torch.nn.Linear(2, 2).to(dtype)
    with pytest.raises(ModelError, match=r"tensor 'weight' holds values that are not finite as float"):
        load_pretrained(model, str(path))
    save_file({"weight": torch.full((2, 2), 3e38), "bias": torch.zeros(2)}, str(path))
    load_pretrained(torch.nn.Linear(2, 2), str(path))  # finite in float32, however large: loaded


def output_cases(tmp_path: Path) -> dict[str, Path]:
    """An output path of each kind a verb must refuse."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "to-folder").symlink_to(tmp_path / "empty")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "a-file").write_text("kept\n")
    return {
        "to-folder": tmp_path / "to-folder",
        "dangling": tmp_path / "dangling",
        "a-file": tmp_path / "a-file",
        "under-a-file": tmp_path / "a-file" / "out",
    }


@pytest.mark.parametrize("case", ["to-folder", "dangling", "a-file", "under-a-file"])
def test_export_output_that_is_a_link_or_a_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    output = output_cases(tmp_path)[case]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    err = refused(capsys, "export", str(run_dir), "--format", "safetensors", "--output", str(output))
    assert f"--output {output}" in err
    expected = {"to-folder": "symbolic link", "dangling": "symbolic link (dangling)", "a-file": "not a folder"}
    assert expected.get(case, f"{tmp_path / 'a-file'} is a file, not a folder") in err
    assert not any((tmp_path / "empty").iterdir()) and (tmp_path / "a-file").read_text() == "kept\n"


@pytest.mark.parametrize("case", ["to-folder", "dangling"])
def test_other_verbs_refuse_an_output_link(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    output = output_cases(tmp_path)[case]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    err = refused(capsys, "evaluate", str(run_dir), "--output", str(output))
    assert f"--output {output}: a symbolic link" in err
    err = refused(capsys, "certs", "create", str(output))
    assert "a symbolic link" in err and not any((tmp_path / "empty").iterdir())
    err = refused(capsys, "data", "prepare", str(run_dir), "--output", str(output))
    assert "a symbolic link" in err
    (run_dir / "report").symlink_to(output)  # a run directory is data: its report folder is no way out
    (run_dir / "metrics.jsonl").write_text("")
    err = refused(capsys, "report", str(run_dir))
    assert "symbolic link" in err and not any((tmp_path / "empty").iterdir())


def test_a_checkpoint_weights_file_with_a_huge_header_is_refused_unparsed(tmp_path: Path) -> None:
    """Verification's last check (that what verifies loads) and the reader: bounded the same way."""
    from trainforge.checkpoint.state import check_loadable, read_tensors

    big_header(tmp_path / "model.safetensors", SAFETENSORS_MAX_HEADER + 8, 10)
    problem = check_loadable(tmp_path, ["model.safetensors"])
    assert problem is not None and f"more than the {human_size(SAFETENSORS_MAX_HEADER)} trainforge reads" in problem
    with pytest.raises(CheckpointError, match="SAFETENSORS_MAX_HEADER"):
        read_tensors(tmp_path / "model.safetensors")


def test_data_verify_prints_what_a_manifest_names_as_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    (tmp_path / "b.txt").write_text("another document\n" * 50)
    corpus = tmp_path / "corpus"
    main(["data", "prepare", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--output", str(corpus)])
    manifest = json.loads((corpus / "manifest.json").read_text())
    manifest["tokenizer"]["spec"] = "bytes\n\x1b[2Jvalid: forged\u202e"
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    main(["data", "verify", str(corpus), "--quick"])
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "\x1b" not in out and "\u202e" not in out, repr(out)
    assert "bytes\\n\\x1b[2Jvalid: forged\\u202e" in out


def test_every_console_prints_text_as_data() -> None:
    """Tables and lines of every console (``ckpt inspect``'s view of a checkpoint's record, ``evaluate``,
    the run's progress): no control character but a line break reaches the terminal."""
    from rich.table import Table

    from trainforge.consoles import make_console

    stream = io.StringIO()
    console = make_console(file=stream)
    table = Table()
    table.add_column("metric\x1b[2J")
    table.add_row("val/\u202eloss")
    console.print(table)
    console.print("plan: ddp\x1b]0;owned\x07 x\rforged", "second\nline")
    out = stream.getvalue()
    assert not any(c in out for c in "\x1b\x07\r\u202e"), repr(out)
    assert "metric\\x1b[2J" in out and "val/\\u202eloss" in out and "ddp\\x1b]0;owned\\x07 x\\rforged" in out
    assert "second\nline" in out


def test_ckpt_inspect_reads_a_weights_header_within_the_same_limit(tmp_path: Path) -> None:
    from tests.helpers.checkpoints import MODEL_FILE, write_checkpoint
    from trainforge.checkpoint.inspect import inspect_checkpoint

    directory = tmp_path / "run" / "checkpoint_000000007"
    model = torch.nn.Linear(2, 2)
    write_checkpoint(directory, model, torch.optim.SGD(model.parameters(), lr=0.1), 7)
    big_header(directory / MODEL_FILE, SAFETENSORS_MAX_HEADER + 8, 10)
    problems = inspect_checkpoint(str(directory))["problems"]
    assert any(f"more than the {human_size(SAFETENSORS_MAX_HEADER)} trainforge reads" in p for p in problems), problems


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs sysfs")
def test_an_output_in_a_folder_that_takes_no_new_files_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """/sys/kernel: write permission says yes to root, the file system says no to a new file. The
    check tries what the write will do (a file made and removed), so the verb fails before its work."""
    err = refused(capsys, "bench", "memory", "--output", "/sys/kernel/trainforge-out.json")
    assert err.startswith("error: --output /sys/kernel/trainforge-out.json: folder /sys/kernel "), err
    for args in (("certs", "create"), ("bench", "checkpoint", "--dir")):
        err = refused(capsys, *args, "/sys/kernel/trainforge-out")
        assert "/sys/kernel/trainforge-out: folder /sys/kernel " in err, err


@pytest.mark.parametrize("case", ["to-folder", "dangling", "a-file"])
def test_bench_data_dir_is_checked_as_an_output(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    """``bench data --dir`` is where the data set is generated: a link, or a file, is one line before any work."""
    output = output_cases(tmp_path)[case]
    err = refused(capsys, "bench", "data", "--dir", str(output), "--size-gb", "0.001")
    assert f"--dir {output}: " in err and ("symbolic link" in err or "not a folder" in err), err
    for path in ("/proc/self/trainforge-out", "/sys/kernel/trainforge-out"):
        if Path(path).parent.is_dir():
            assert f"--dir {path}: " in refused(capsys, "bench", "data", "--dir", path, "--size-gb", "0.001")
    assert not any((tmp_path / "empty").iterdir()) and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("kind", ["fifo", "folder", "link"])
def test_a_run_directorys_report_folder_holding_what_is_not_a_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """A run directory is data: a FIFO in its report/ named report.html hung ``report`` for ever, a
    folder there was a traceback; anything but a regular file in report/ is one line, nothing written."""
    run_dir = tmp_path / "run"
    (run_dir / "report").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("")
    page = run_dir / "report" / "report.html"
    {"fifo": lambda: os.mkfifo(page), "folder": page.mkdir, "link": lambda: page.symlink_to(tmp_path / "x")}[kind]()
    err = refused(capsys, "report", str(run_dir))
    what = {"fifo": "a FIFO", "folder": "a directory", "link": "a symbolic link"}[kind]
    assert f"report holds {what} ('report.html')" in err, err
    assert sorted(p.name for p in (run_dir / "report").iterdir()) == ["report.html"]


def test_column_names_read_from_the_data_are_printed_as_data() -> None:
    """A parquet file's column names are the data's: each escaped and cut (``errors.shown``), at
    most a few listed, so the error stays one short line whatever the file holds."""
    from trainforge.data.stream import Decode
    from trainforge.errors import DataError

    evil = "col\n\x1b[2Jerror: forged\u202e" + "x" * 5000
    batch: dict[str, object] = {evil: [1], **{f"c{i}": [1] for i in range(1000)}}
    with pytest.raises(DataError) as raised:
        Decode("input", "target", (1,))(batch)
    message = str(raised.value)
    assert not any(c in message for c in CONTROLS) and len(message) < 1000 and "and 993 more" in message, message
    with pytest.raises(DataError) as raised:
        Decode("input", "target", (1,))({evil: [1]})
    message = str(raised.value)
    assert not any(c in message for c in CONTROLS) and len(message) < 1000, message[:300]
    assert "(columns: 'col\\n\\x1b[2Jerror: forged\\u202exxx" in message


def test_class_folder_names_are_printed_as_data(tmp_path: Path) -> None:
    """imagefolder's class names are folder names of the data: escaped, cut and a few listed."""
    from trainforge.config import DataConfig
    from trainforge.data.images import build_imagefolder
    from trainforge.errors import DataError

    for name in ["a\n\x1b[2Jerror: forged\u202e" + "x" * 200, *(f"class{i:03}" for i in range(300))]:
        (tmp_path / "train" / name).mkdir(parents=True)
    cfg = DataConfig.model_validate({"name": "imagefolder", "path": str(tmp_path)})
    with pytest.raises(DataError) as raised:
        build_imagefolder(cfg, 0)  # type: ignore[arg-type]
    message = str(raised.value)
    assert not any(c in message for c in CONTROLS) and len(message) < 1500, message[:300]
    assert "'a\\n\\x1b[2Jerror: forged\\u202e" in message and "and 293 more" in message
