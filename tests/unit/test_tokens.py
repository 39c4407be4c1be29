"""Token corpora: ``trainforge data prepare`` on generated text and on the standard library, the
verification, and the ``tokens`` source's windows. Real files and real tokenizers, no mocks."""

from __future__ import annotations

import itertools
import json
import pickle
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.console import without_startup
from trainforge.config import DataConfig, load_config
from trainforge.data import build_datasets
from trainforge.data import corpus as corpus_module
from trainforge.data.corpus import Prepared, PrepareOptions, prepare_corpus
from trainforge.data.documents import in_validation
from trainforge.data.shards import document_offsets, read_manifest, split_stream, verify_corpus
from trainforge.data.tokenizer import load_corpus_tokenizer
from trainforge.data.tokens import TokenWindows, prepare_or_verify
from trainforge.errors import ConfigError, DataError

WORDS = [
    "def",
    "class",
    "return",
    "import",
    "self",
    "value",
    "index",
    "for",
    "while",
    "with",
    "lambda",
    "yield",
    "None",
]


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "\n"


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A generated corpus: text files in nested folders (one non-ASCII), a JSONL file, and a
    binary and a Latin-1 file that the directory walk must skip. Returns (folder, documents)."""
    root = tmp_path_factory.mktemp("raw")
    rng = random.Random(0)
    documents = []
    for number in range(30):
        folder = root / f"part{number % 3}"
        folder.mkdir(exist_ok=True)
        text = "".join(sentence(rng, rng.randint(5, 40)) for _ in range(rng.randint(1, 8)))
        if number == 7:
            text += "naïve café ✓\n"
        (folder / f"doc{number:02d}.txt").write_text(text, encoding="utf-8")
        documents.append(text)
    lines = [sentence(rng, rng.randint(3, 20)) for _ in range(20)]
    (root / "records.jsonl").write_text(
        "".join(json.dumps({"text": line, "id": i}) + "\n" for i, line in enumerate(lines))
    )
    documents += lines
    (root / "part0" / "image.bin").write_bytes(bytes(range(256)) * 4)
    (root / "part1" / "latin1.txt").write_bytes("café".encode("latin-1"))
    return root, documents


def prepare(inputs: list[str | Path], output: Path, **options: object) -> Prepared:
    return prepare_corpus(PrepareOptions([str(i) for i in inputs], output, **options))  # type: ignore[arg-type]


def test_bytes_corpus_holds_every_document_once_with_the_tokenizers_count(
    raw: tuple[Path, list[str]], tmp_path: Path
) -> None:
    root, documents = raw
    prepared = prepare([root], tmp_path / "c", tokenizer="bytes", val_fraction=0.2, workers=1)
    manifest = verify_corpus(tmp_path / "c", full=True)
    assert prepared.skipped == 2  # image.bin and latin1.txt
    train, val = manifest.splits["train"], manifest.splits["val"]
    assert train.documents + val.documents == len(documents) and val.documents > 0
    assert train.tokens + val.tokens == sum(len(doc.encode()) + 1 for doc in documents)
    assert manifest.vocab_size == 257 and manifest.dtype == "uint16"
    # every document comes back from its split's stream between its offsets, followed by the end token
    found = []
    for split in ("train", "val"):
        stream = split_stream(tmp_path / "c", manifest, split)
        offsets = document_offsets(tmp_path / "c", manifest, split)
        for start, end in itertools.pairwise(offsets):
            ids = stream.read(int(start), int(end - start))
            assert ids[-1] == 256
            text = bytes(ids[:-1].astype(np.uint8)).decode()
            assert in_validation(text.encode(), 0.2) == (split == "val")
            found.append(text)
    assert sorted(found) == sorted(documents)


def test_bpe_corpus_token_count_equals_the_tokenizers_count(raw: tuple[Path, list[str]], tmp_path: Path) -> None:
    root, documents = raw
    prepare([root], tmp_path / "c", tokenizer="bpe:300", val_fraction=0.2, workers=1)
    manifest = verify_corpus(tmp_path / "c", full=True)
    tokenizer = load_corpus_tokenizer(tmp_path / "c", "bpe", "test")
    assert manifest.tokenizer.file == "tokenizer.json" and manifest.vocab_size == 300
    counts = [len(tokenizer.encode(doc)) for doc in documents]
    assert sum(manifest.splits[s].tokens for s in ("train", "val")) == sum(counts) + len(documents)
    assert sum(counts) < sum(len(doc.encode()) for doc in documents) / 2  # the merges were learned
    assert tokenizer.decode(tokenizer.encode(documents[7]).tolist()) == documents[7]
    # the same tokenizer file given as PATH gives the same tokens
    prepare([root], tmp_path / "again", tokenizer=str(tmp_path / "c" / "tokenizer.json"), val_fraction=0.2, workers=1)
    again = verify_corpus(tmp_path / "again", full=True)
    assert again.files["train_00000.bin"] == manifest.files["train_00000.bin"]


def test_processes_and_small_shards_write_the_same_tokens(
    raw: tuple[Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = raw
    one = prepare([root], tmp_path / "one", val_fraction=0.2, workers=1)
    monkeypatch.setattr(corpus_module, "PROCESSES_MIN_BYTES", 0)
    monkeypatch.setattr(corpus_module, "GROUP_BYTES", 2048)  # several groups, spread over the processes
    two = prepare([root], tmp_path / "two", val_fraction=0.2, workers=2, shard_tokens=1024)
    verify_corpus(tmp_path / "two", full=True)
    assert len(two.manifest.splits["train"].shards) > 2
    for split in ("train", "val"):
        a = split_stream(tmp_path / "one", one.manifest, split)
        b = split_stream(tmp_path / "two", two.manifest, split)
        assert np.array_equal(a.read(0, len(a)), b.read(0, len(b)))
        # a read across shard boundaries equals the same slice of the whole
        assert np.array_equal(b.read(1000, 1100), a.read(0, len(a))[1000:2100])
        assert np.array_equal(
            document_offsets(tmp_path / "one", one.manifest, split),
            document_offsets(tmp_path / "two", two.manifest, split),
        )


def test_a_corrupted_or_truncated_shard_fails_verification(raw: tuple[Path, list[str]], tmp_path: Path) -> None:
    root, _ = raw
    corpus = tmp_path / "c"
    prepare([root], corpus, workers=1)
    shard = corpus / "train_00000.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    verify_corpus(corpus, full=False)  # same size: only the digest tells
    with pytest.raises(DataError, match=r"train_00000.bin fails its SHA-256 check \(corrupted\)"):
        verify_corpus(corpus, full=True)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match=r"train_00000.bin is \d+ bytes, the manifest says \d+"):
        build_datasets(DataConfig(name="tokens", path=str(corpus), seq_len=8), seed=0)
    (corpus / "manifest.json").write_text('{"format": "trainforge-tokens/1"}')
    with pytest.raises(DataError, match=r"manifest\.json is not a token corpus manifest"):
        verify_corpus(corpus, full=False)


def rehashed(corpus: Path, name: str, data: bytes) -> None:
    """``name`` replaced by ``data`` and the manifest updated to match: what someone who prepared
    the corpus can do, so only checks of the content can tell."""
    import hashlib

    (corpus / name).write_bytes(data)
    manifest = json.loads((corpus / "manifest.json").read_text())
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (corpus / "manifest.json").write_text(json.dumps(manifest))


def npy(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


@pytest.mark.parametrize("case", ["pickled index", "offsets that decrease", "token id beyond the vocabulary"])
def test_verify_refuses_content_that_hashes_cannot_tell(corpus: Path, tmp_path: Path, case: str) -> None:
    import shutil

    copy = tmp_path / "c"
    shutil.copytree(corpus, copy)
    manifest = read_manifest(copy)
    entry = manifest.splits["train"]
    offsets = document_offsets(copy, manifest, "train")
    if case == "pickled index":
        rehashed(copy, entry.index, npy(np.array([object()] * len(offsets), dtype=object)))
        expected = rf"{entry.index} is not {len(offsets)} int64 document offsets \(.*allow_pickle"
    elif case == "offsets that decrease":
        offsets[1], offsets[2] = offsets[2], offsets[1]
        rehashed(copy, entry.index, npy(offsets))
        expected = rf"{entry.index} is not document offsets from 0 to {entry.tokens}, never decreasing"
    else:
        shard = copy / entry.shards[0]
        data = bytearray(shard.read_bytes())
        data[10:12] = (300).to_bytes(2, "little")  # the byte tokenizer's vocabulary is 257
        rehashed(copy, entry.shards[0], bytes(data))
        expected = r"train token 5 is id 300, at or above the vocabulary of 257"
    with pytest.raises(DataError, match=expected) as caught:
        verify_corpus(copy, full=True)
    assert "\n" not in str(caught.value)


def test_stdlib_subsample_token_count_equals_the_tokenizers_count(tmp_path: Path) -> None:
    prepared = prepare(["stdlib"], tmp_path / "c", tokenizer="bpe:512", val_fraction=0.1, max_files=25, workers=1)
    manifest = verify_corpus(tmp_path / "c", full=True)
    sources = [json.loads(line) for line in (tmp_path / "c" / "sources.jsonl").read_text().splitlines()]
    assert len(sources) == 25 and all(s["path"].endswith(".py") for s in sources)
    tokenizer = load_corpus_tokenizer(tmp_path / "c", "bpe", "test")
    texts = [Path(s["path"]).read_text(encoding="utf-8") for s in sources if "skipped" not in s]
    texts = [text for text in texts if text]
    assert sum(manifest.splits[s].documents for s in ("train", "val")) == len(texts)
    expected = sum(len(tokenizer.encode(text)) + 1 for text in texts)
    assert sum(manifest.splits[s].tokens for s in ("train", "val")) == expected
    assert prepared.manifest.inputs == ["stdlib"] and manifest.max_files == 25


# ---------------------------------------------------------------------------------------------
# the tokens source


@pytest.fixture(scope="module")
def corpus(raw: tuple[Path, list[str]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "c"
    prepare([raw[0]], path, val_fraction=0.2, workers=1, shard_tokens=1024)
    return path


def test_windows_are_shifted_pairs_and_sequential_windows_tile_the_stream(corpus: Path) -> None:
    cfg = DataConfig(name="tokens", path=str(corpus), seq_len=16, windows="sequential")
    train, val, spec = build_datasets(cfg, seed=0)
    manifest = read_manifest(corpus)
    stream = split_stream(corpus, manifest, "train").read(0, manifest.splits["train"].tokens)
    assert val is not None and spec.kind == "tokens" and spec.vocab_size == 257 and spec.input_shape == (16,)
    assert len(train) == (len(stream) - 1) // 16 and spec.train_size == len(train) and spec.val_size == len(val)
    for index in (0, 1, len(train) - 1):
        x, y = train[index]
        assert x.dtype == torch.int64 and x.shape == y.shape == (16,)
        assert torch.equal(x[1:], y[:-1])
        assert torch.equal(x, torch.from_numpy(stream[index * 16 : index * 16 + 16]))
        assert int(y[-1]) == stream[index * 16 + 16]


def test_random_windows_depend_on_seed_and_index_only(corpus: Path) -> None:
    cfg = DataConfig(name="tokens", path=str(corpus), seq_len=16, windows="random")
    a, val, _ = build_datasets(cfg, seed=3)
    b, _, _ = build_datasets(cfg, seed=3)
    c, _, _ = build_datasets(cfg, seed=4)
    assert isinstance(a, TokenWindows) and isinstance(val, TokenWindows) and not val.random
    starts = [a.start(i) for i in range(len(a))]
    assert len(set(starts)) > len(a) // 2 and any(s % 16 for s in starts)  # not the sequential grid
    assert starts == [b.start(i) for i in range(len(b))] != [c.start(i) for i in range(len(c))]
    copied = pickle.loads(pickle.dumps(a))  # what a loader worker gets: paths, not mapped pages
    for index in (0, 5, len(a) - 1):
        x, y = a[index]
        assert torch.equal(x[1:], y[:-1])
        assert all(torch.equal(p, q) for p, q in zip(a[index], copied[index], strict=True))


def test_tokens_source_errors(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data.seq_len \+ 1 = 100001"):
        build_datasets(DataConfig(name="tokens", path=str(corpus), seq_len=100_000), seed=0)
    with pytest.raises(DataError, match=r"holds no manifest\.json: not a prepared token corpus"):
        build_datasets(DataConfig(name="tokens", path=str(tmp_path)), seed=0)
    with pytest.raises(DataError, match=r"data\.name tokens needs data\.path"):
        build_datasets(DataConfig(name="tokens"), seed=0)
    train, _, _ = build_datasets(DataConfig(name="tokens", path=str(corpus), seq_len=8), seed=0)
    assert isinstance(train, TokenWindows)
    small = TokenWindows(train.stream, 8, 100, random=False, seed=0)  # a corpus whose ids exceed its vocabulary
    with pytest.raises(DataError, match="is >= its vocab_size 100"):
        for index in range(len(small)):
            small[index]


def test_data_prepare_key_prepares_once_and_refuses_another_preparation(
    raw: tuple[Path, list[str]], tmp_path: Path
) -> None:
    path = tmp_path / "auto"
    section = {"name": "tokens", "path": str(path), "prepare": {"inputs": [str(raw[0])], "val_fraction": 0.2}}
    cfg = load_config({"model": {"name": "llama_tiny"}, "data": section, "train": {"max_steps": 1}}).data
    first = prepare_or_verify(cfg)
    stamp = (path / "train_00000.bin").stat().st_mtime_ns
    assert first is not None and prepare_or_verify(cfg) == first  # the second run reuses it, verified
    assert (path / "train_00000.bin").stat().st_mtime_ns == stamp
    other = cfg.model_copy(update={"prepare": cfg.prepare.model_copy(update={"tokenizer": "bpe:300"})})  # type: ignore[union-attr]
    with pytest.raises(DataError, match=r"data.prepare.tokenizer 'bpe:300' \(the corpus: 'bytes'\)"):
        prepare_or_verify(other)
    assert prepare_or_verify(DataConfig(name="digits")) is None
    with pytest.raises(ConfigError, match=r"data\.prepare needs data\.name: tokens and data\.path"):
        load_config({"model": {"name": "mlp"}, "data": {"prepare": {"inputs": ["stdlib"]}}, "train": {"max_steps": 1}})


# ---------------------------------------------------------------------------------------------
# the command line: bad input is one line and exit code 2, with nothing left at --output


def run_cli(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from trainforge.cli import main

    monkeypatch.setattr(sys, "argv", ["trainforge", *args])
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.err if code else captured.out


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("empty", "INPUT {tmp}/empty: is an empty directory"),
        ("binary", "{tmp}/data.bin: a binary file (NUL byte at offset 3)"),
        ("no_text_field", '{tmp}/rows.jsonl line 2: no "text" string field'),
        ("not_json", "{tmp}/rows.jsonl line 1: not a JSON object"),
        ("missing", "INPUT {tmp}/nowhere.txt: no such file or directory"),
        ("bad_tokenizer", "--tokenizer 'bpe:12': the BPE vocabulary must be a whole number from 257"),
        ("no_such_tokenizer", "--tokenizer 'wordpiece': not bytes, bpe:VOCAB"),
        ("bad_fraction", "--val-fraction 1.0: must be >= 0 and < 1"),
        ("taken_output", "--output {tmp}/taken is a folder that is not empty and holds no prepared corpus"),
    ],
)
def test_prepare_bad_input_is_one_line_and_exit_2(
    case: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "data.bin").write_bytes(b"abc\x00def")
    (tmp_path / "ok.txt").write_text("print('hello')\n")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    rows = '{"text": "a"}\n{"body": "b"}\n' if case == "no_text_field" else "not json\n"
    (tmp_path / "rows.jsonl").write_text(rows)
    inputs = {
        "empty": ["empty"],
        "binary": ["ok.txt", "data.bin"],
        "no_text_field": ["rows.jsonl"],
        "not_json": ["rows.jsonl"],
        "missing": ["nowhere.txt"],
    }.get(case, ["ok.txt"])
    flags = {
        "bad_tokenizer": ["--tokenizer", "bpe:12"],
        "no_such_tokenizer": ["--tokenizer", "wordpiece"],
        "bad_fraction": ["--val-fraction", "1.0"],
    }.get(case, [])
    output = tmp_path / ("taken" if case == "taken_output" else "out")
    args = ["data", "prepare", *(str(tmp_path / i) for i in inputs), "--output", str(output), "--workers", "1", *flags]
    code, err = run_cli(args, monkeypatch, capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert expected.format(tmp=tmp_path) in err, err
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging folder left
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]


def test_cli_prepare_verify_and_force(
    raw: tuple[Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "c"
    args = ["data", "prepare", str(raw[0]), "--output", str(out), "--workers", "1", "--val-fraction", "0.2"]
    code, text = run_cli(args, monkeypatch, capsys)
    assert code == 0 and text.startswith(f"prepared {out} in ") and "2 files skipped" in text, text
    code, text = run_cli(["data", "verify", str(out)], monkeypatch, capsys)
    assert code == 0 and text.startswith(f"valid: {out} (") and "SHA-256 checked" in text, text
    code, text = run_cli(args, monkeypatch, capsys)
    assert code == 2 and "already holds a prepared corpus: give a new folder, or --force" in text, text
    code, text = run_cli([*args, "--force", "--tokenizer", "bpe:280"], monkeypatch, capsys)
    assert code == 0 and "vocabulary 280 (bpe:280)" in text, text
    (out / "val_index.npy").unlink()
    code, text = run_cli(["data", "verify", str(out), "--quick"], monkeypatch, capsys)
    assert code == 2 and f"error: corpus {out}: val_index.npy is missing" in text, text


def test_generate_errors_are_one_line(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainforge.config import to_yaml

    def run_dir(name: str, data: dict[str, object], weights: bool) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        config = load_config({"model": {"name": "llama_tiny"}, "data": data, "train": {"max_steps": 1}})
        (folder / "config.yaml").write_text(to_yaml(config))
        if weights:
            (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
        return folder

    tokens = {"name": "tokens", "path": str(corpus), "seq_len": 16}
    cases = [
        (tmp_path, "holds no config.yaml: not a trainforge run directory"),
        (run_dir("unfinished", tokens, False), "holds no model.safetensors: the run has not finished"),
        (run_dir("digits", {"name": "digits"}, True), "generate needs a run trained on data.name tokens"),
        (run_dir("moved", {**tokens, "path": str(tmp_path / "gone")}, True), "the run's data.path"),
        (run_dir("empty_weights", tokens, True), "does not load into llama_tiny with the corpus's vocabulary of 257"),
    ]
    for folder, expected in cases:
        code, err = run_cli(["generate", str(folder), "--prompt", "def "], monkeypatch, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err
    code, err = run_cli(["generate", str(tmp_path), "--temperature", "-1"], monkeypatch, capsys)
    assert code == 2 and "--temperature -1.0: a number from 0 (greedy) to 100" in err, err


def test_generate_prints_the_prompt_continued_by_the_runs_model(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_model

    from trainforge.config import to_yaml
    from trainforge.data.spec import DataSpec
    from trainforge.models import build_model

    config = load_config(
        {
            "model": {"name": "llama_tiny", "kwargs": {"num_hidden_layers": 1}},
            "data": {"name": "tokens", "path": str(corpus), "seq_len": 16},
            "train": {"max_steps": 1},
        }
    )
    (tmp_path / "config.yaml").write_text(to_yaml(config))
    torch.manual_seed(0)
    model = build_model(config.model, DataSpec(kind="tokens", input_shape=(16,), vocab_size=257, seq_len=16))
    save_model(model, str(tmp_path / "model.safetensors"))
    args = ["generate", str(tmp_path), "--prompt", "def ", "--max-tokens", "30"]
    outputs = []
    for extra in (["--seed", "1"], ["--seed", "1"], ["--temperature", "0"]):
        code, out = run_cli([*args, *extra], monkeypatch, capsys)
        assert code == 0 and out.startswith("def "), out
        outputs.append(out)
    assert outputs[0] == outputs[1]  # the seed decides the sample
    assert len(outputs[0].encode()) > len(b"def \n")  # an untrained model writes bytes, rarely the end token


def test_generate_prints_what_the_model_writes_as_data(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run directory is not trusted, and neither is what its model writes: a byte-level model
    can write a terminal escape or any control character; each is printed escaped (a line break
    kept: text is text)."""
    from safetensors.torch import save_model

    from trainforge.config import to_yaml
    from trainforge.data.spec import DataSpec
    from trainforge.models import build_model

    config = load_config(
        {
            "model": {"name": "llama_tiny", "kwargs": {"num_hidden_layers": 1}},
            "data": {"name": "tokens", "path": str(corpus), "seq_len": 16},
            "train": {"max_steps": 1},
        }
    )
    (tmp_path / "config.yaml").write_text(to_yaml(config))
    model = build_model(config.model, DataSpec(kind="tokens", input_shape=(16,), vocab_size=257, seq_len=16))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()  # every logit 0: greedy decoding writes byte 0 (NUL) again and again
    save_model(model, str(tmp_path / "model.safetensors"))
    code, out = run_cli(
        ["generate", str(tmp_path), "--prompt", "a\nb", "--max-tokens", "5", "--temperature", "0"], monkeypatch, capsys
    )
    assert code == 0 and out == "a\nb" + "\\x00" * 5 + "\n", repr(out)


def test_a_corpus_another_run_prepared_meanwhile_is_used(
    raw: tuple[Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "shared"
    section = {"name": "tokens", "path": str(path), "prepare": {"inputs": [str(raw[0])], "val_fraction": 0.2}}
    cfg = load_config({"model": {"name": "llama_tiny"}, "data": section, "train": {"max_steps": 1}}).data
    write_corpus = corpus_module.write_corpus
    other: list[Prepared] = []

    def finished_second(*args: object, **kwargs: object) -> object:
        result = write_corpus(*args, **kwargs)  # type: ignore[arg-type]
        monkeypatch.setattr(corpus_module, "write_corpus", write_corpus)
        other.append(prepare([raw[0]], path, val_fraction=0.2, workers=1))  # renamed into place first
        return result

    monkeypatch.setattr(corpus_module, "write_corpus", finished_second)
    manifest = prepare_or_verify(cfg)
    assert manifest == other[0].manifest == read_manifest(path)
    assert [p.name for p in tmp_path.iterdir()] == ["shared"]  # the loser's staging folder is gone


def test_a_relative_corpus_path_is_refused_before_ray_starts(raw: tuple[Path, list[str]]) -> None:
    section = {"name": "tokens", "path": "corpora/mine", "prepare": {"inputs": [str(raw[0])]}}
    cfg = load_config({"model": {"name": "llama_tiny"}, "data": section, "train": {"max_steps": 1}}).data
    with pytest.raises(DataError, match=r"data\.path corpora/mine is relative, but Ray's workers do not run in this"):
        prepare_or_verify(cfg)
    assert not Path("corpora").exists()


def test_train_names_the_data_prepare_key_before_ray_starts(
    raw: tuple[Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    config = {
        "run": {"output_dir": str(tmp_path / "runs")},
        "model": {"name": "llama_tiny"},
        "data": {"name": "tokens", "path": str(tmp_path / "c"), "prepare": {"inputs": [str(raw[0])]}},
        "train": {"max_steps": 1},
    }
    path = tmp_path / "lm.yaml"
    path.write_text(yaml.safe_dump(config))
    code, err = run_cli(["train", str(path), "--set", "data.prepare.tokenizer=bpe:1"], monkeypatch, capsys)
    assert code == 2 and len(without_startup(err)) == 1, err  # after train's first line and start-up phases
    assert "data.prepare.tokenizer 'bpe:1': the BPE vocabulary must be a whole number from 257" in err
    code, err = run_cli(["train", str(path), "--set", "data.prepare.inputs=[nowhere]"], monkeypatch, capsys)
    assert code == 2 and "data.prepare.inputs nowhere: no such file or directory" in err, err
    assert not (tmp_path / "c").exists() and not (tmp_path / "runs").exists()
