"""The offline tokenizer, the builtin corpus and the FineWeb-Edu path (on a local sample)."""
import hashlib
import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from coursekit import KIT_ROOT, KitError, data

pytestmark = pytest.mark.unit


def test_gpt2_tokenizer_works_offline():
    assert data.tokenizer_available_offline()
    encoding = data.gpt2_encoding()
    assert encoding.encode_ordinary("hello world") == [31373, 995]
    assert encoding.n_vocab == data.EOT_TOKEN + 1


def test_corrupt_tokenizer_file_is_not_offline_ready(tmp_path):
    for name in data.TOKENIZER_FILES:
        (tmp_path / name).write_text("not the vocabulary")
    assert not data.tokenizer_available_offline(tmp_path)


def test_builtin_corpus_is_big_enough_and_well_formed(builtin_data):
    meta = data.read_meta(builtin_data)
    assert meta["source"] == "builtin" and meta["tokenizer"].startswith("gpt2")
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    assert train["tokens"] + val["tokens"] >= 500_000
    assert 0.02 < val["tokens"] / (train["tokens"] + val["tokens"]) < 0.10
    for split in ("train", "val"):
        tokens = np.concatenate([np.load(builtin_data / name) for name in meta["splits"][split]["shards"]])
        assert tokens.dtype == np.uint16 and len(tokens) == meta["splits"][split]["tokens"]
        assert tokens[0] == data.EOT_TOKEN and tokens.max() <= data.EOT_TOKEN
    for name, digest in meta["manifest"].items():
        assert hashlib.sha256((builtin_data / name).read_bytes()).hexdigest() == digest


def split_tokens(directory, split):
    return np.concatenate([np.load(p) for p in sorted(directory.glob(f"{split}_*.npy"))])


def documents_of(tokens):
    """Each document's tokens, cut at the end-of-text token that starts it."""
    starts = np.flatnonzero(tokens == data.EOT_TOKEN)
    return [tokens[a + 1:b] for a, b in zip(starts, [*starts[1:], len(tokens)])]


def test_no_validation_passage_is_in_the_training_shards(builtin_data):
    train, val = split_tokens(builtin_data, "train"), split_tokens(builtin_data, "val")
    window = 64  # tokens, about 50 words: longer than any common phrase of the documentation
    seen = {hash(w.tobytes()) for w in np.lib.stride_tricks.sliding_window_view(train, window)}
    repeated = [w for w in np.lib.stride_tricks.sliding_window_view(val, window)
                if hash(w.tobytes()) in seen]
    assert repeated == []
    val_documents, train_documents = documents_of(val), documents_of(train)
    assert not {d.tobytes() for d in val_documents} & {d.tobytes() for d in train_documents}
    assert 0.02 < len(val_documents) / (len(val_documents) + len(train_documents)) < 0.10


def test_builtin_corpus_is_readable_python_documentation(builtin_data):
    from pydoc_data.topics import topics
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = "\n".join([*topics.values(), *(p.read_text(errors="replace")
                                             for p in stdlib.rglob("*.py")
                                             if "site-packages" not in p.parts)])
    decoded = data.gpt2_encoding().decode(split_tokens(builtin_data, "val").tolist())
    documents = decoded.split("<|endoftext|>")[1:]
    assert len(documents) > 100
    # the first line of every 20th document, word for word in a source file or reference topic
    first_lines = [d.splitlines()[0].strip() for d in documents[::20]]
    assert [line for line in first_lines if line not in sources] == []


def test_missing_data_names_the_command_that_prepares_it(tmp_path):
    with pytest.raises(KitError, match="coursekit data prepare --source builtin --out"):
        data.read_meta(tmp_path / "nowhere")


# --- FineWeb-Edu, offline: the same code pointed at a local file in FineWeb's schema -----------

@pytest.fixture(scope="module")
def fineweb_sample(tmp_path_factory):
    from pydoc_data.topics import topics
    path = tmp_path_factory.mktemp("fineweb") / "sample.jsonl"
    rows = [{"text": topics[name], "id": f"<urn:uuid:{i}>", "dump": "CC-MAIN-2024-10",
             "url": f"https://example.org/{name}", "file_path": "s3://sample", "language": "en",
             "language_score": 0.95, "token_count": 0, "score": 3.1, "int_score": 3}
            for i, name in enumerate(sorted(topics))]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path, [row["text"] for row in rows]


def test_fineweb_path_writes_val_then_train_shards(fineweb_sample, tmp_path):
    path, texts = fineweb_sample
    meta = data.prepare_fineweb(tmp_path, shards=3, shard_tokens=3000, sample_file=path,
                                workers=2, progress=False)
    assert meta["source"] == "fineweb-edu"
    assert meta["splits"]["val"] == {"shards": ["val_000000.npy"], "tokens": 3000}
    assert meta["splits"]["train"] == {"shards": ["train_000000.npy", "train_000001.npy"], "tokens": 6000}

    encoding = data.gpt2_encoding()
    documents = [[data.EOT_TOKEN, *encoding.encode_ordinary(t)] for t in texts]
    stream = np.concatenate(documents)
    assert np.array_equal(np.load(tmp_path / "val_000000.npy"), stream[:3000])
    # the document that straddles the end of the validation shard is not reused for training
    starts = np.cumsum([0] + [len(d) for d in documents])
    first_train = starts[np.searchsorted(starts, 3000)]
    train = np.concatenate([np.load(tmp_path / f"train_00000{i}.npy") for i in (0, 1)])
    assert np.array_equal(train, stream[first_train:first_train + 6000])


@pytest.fixture(scope="module")
def parquet_sample(fineweb_sample):
    """The same rows as a Parquet file, the format FineWeb-Edu is published in."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    path, texts = fineweb_sample
    parquet = path.with_suffix(".parquet")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    return parquet, texts


def test_fineweb_parquet_sample_through_the_command_line(parquet_sample, tmp_path):
    path, texts = parquet_sample
    out = tmp_path / "fineweb"
    result = subprocess.run([sys.executable, "-m", "coursekit", "data", "prepare", "--source",
                             "fineweb-edu", "--out", str(out), "--sample-file", str(path),
                             "--shards", "3", "--shard-tokens", "2000", "--workers", "1"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "meta.json").read_text())["dataset"] == "local sample sample.parquet"
    # decoded back to bytes, the shards are the documents in file order, each after an EOT
    encoding = data.gpt2_encoding()
    stream = b"".join(b"<|endoftext|>" + text.encode() for text in texts)
    val = np.load(out / "val_000000.npy")
    assert len(val) == 2000 and stream.startswith(encoding.decode_bytes(val.tolist()))
    train = encoding.decode_bytes(split_tokens(out, "train").tolist())
    # training starts at the next document: none of the one cut off by the validation shard's end
    next_document = stream.index(b"<|endoftext|>", len(encoding.decode_bytes(val.tolist())))
    assert len(train) > 0 and stream[next_document:].startswith(train)


@pytest.mark.parametrize("name, content, message", [
    ("absent.parquet", None, "absent.parquet: no such file"),
    ("notes.csv", "text\nhello\n", "notes.csv: use a .jsonl, .json, .parquet file"),
    ("other.jsonl", '{"content": "hello"}\n', "other.jsonl: its rows have no 'text' field "
                                               "(found content; FineWeb's schema has text"),
])
def test_a_bad_sample_file_is_one_line(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_text(content)
    result = subprocess.run([sys.executable, "-m", "coursekit", "data", "prepare", "--source",
                             "fineweb-edu", "--out", str(tmp_path / "out"), "--sample-file",
                             str(tmp_path / name), "--workers", "1"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: --sample-file {tmp_path / name}") and \
        message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_fineweb_source_too_small_is_a_clear_error(fineweb_sample, tmp_path):
    path, _ = fineweb_sample
    with pytest.raises(KitError, match="ran out"):
        data.prepare_fineweb(tmp_path, shards=2, shard_tokens=10**8, sample_file=path,
                             workers=1, progress=False)


@pytest.mark.parametrize("args, message", [
    (["--source", "web"], "argument --source: invalid choice: 'web'"),
    (["--source", "fineweb-edu", "--shards", "0"], "argument --shards: expected a positive integer, got 0"),
    (["--source", "fineweb-edu", "--shards", "1"], "--shards 1 is too few"),
    (["--source", "builtin", "--shard-tokens", "many"], "expected a positive integer, got 'many'"),
])
def test_data_cli_errors_are_one_line(tmp_path, args, message):
    result = subprocess.run([sys.executable, "-m", "coursekit", "data", "prepare",
                             "--out", str(tmp_path / "d"), *args], capture_output=True, text=True)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_hub_names_load_at_a_pinned_or_given_revision(tmp_path):
    from coursekit import hub
    assert hub.name_and_revision("openai-community/gpt2") == \
        ("openai-community/gpt2", "607a30d783dfa663caf39e06633721c8d4cfcd7e")
    assert hub.name_and_revision("yahma/alpaca-cleaned@abc123") == ("yahma/alpaca-cleaned", "abc123")
    assert hub.name_and_revision("yahma/alpaca-cleaned") == \
        ("yahma/alpaca-cleaned", "12567cabf869d7c92e573c7c783905fc160e9639")
    assert hub.name_and_revision("someone/data") == ("someone/data", None)  # not the kit's
    assert hub.name_and_revision(str(tmp_path)) == (str(tmp_path), None)  # a local folder
    assert all(len(commit) == 40 and int(commit, 16) >= 0 for commit in hub.PINNED.values())


# Where the kit's texts name a hub repository: a download command, a loading call, a stage flag.
HUB_DOWNLOAD = re.compile(r"hf download ([\w.-]+/[\w.-]+)([^\n]*)")
HUB_LOADING_CALL = re.compile(r"(?:load_dataset|from_pretrained)\(\s*['\"]([\w.-]+/[\w.-]+)['\"]([^)]*)\)")
HUB_FLAG = re.compile(r"--(?:model|data) ([\w.-]+/[\w.@<>-]+)")


def kit_texts():
    """Every text a trainee or an instructor reads or runs: lessons, book, README, code."""
    listed = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.yaml", "*.yml"], cwd=KIT_ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return {name: (KIT_ROOT / name).read_text() for name in listed
            if not name.startswith("tests/")}


def test_every_hub_repository_the_kit_names_is_pinned_and_downloaded_at_its_pin():
    from coursekit import hub
    named, unpinned = set(), []
    for path, text in kit_texts().items():
        for pattern in (HUB_DOWNLOAD, HUB_LOADING_CALL):
            for match in pattern.finditer(text):
                name, rest = match.groups()
                named.add(name)
                if hub.PINNED.get(name, "unpinned") not in rest:
                    unpinned.append(f"{path}: {match.group(0)}")
        for match in HUB_FLAG.finditer(text):
            name, _, revision = match.group(1).partition("@")
            if not name.startswith(("data/", "runs/", "models/")) and not revision:
                named.add(name)
                if name not in hub.PINNED:
                    unpinned.append(f"{path}: {match.group(0)}")
    assert not unpinned, "hub names without the kit's pinned revision:\n" + "\n".join(unpinned)
    assert {"openai-community/gpt2", "HuggingFaceTB/SmolLM2-135M", "yahma/alpaca-cleaned",
            "uoft-cs/cifar10"} <= named  # the patterns still find what the kit's texts name
