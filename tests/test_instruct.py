"""The offline instruction set of lesson 05, read back from its files: validation prompts are new,
every answer is what Python itself says, meta.json counts what the files hold, and a bad --data
is one line."""
import ast
import hashlib
import json
from collections import Counter

import pytest

from coursekit import KitError, instruct

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(directory, {split: rows}) of the instruction set as `instruct prepare` writes it."""
    directory = tmp_path_factory.mktemp("instruct")
    instruct.prepare(directory)
    rows = {split: [json.loads(line)
                    for line in (directory / f"{split}.jsonl").read_text().splitlines()]
            for split in ("train", "val")}
    return directory, rows


def prompts(rows):
    return [(row["instruction"], row["input"]) for row in rows]


def test_no_validation_prompt_occurs_in_training(prepared):
    _, rows = prepared
    val = prompts(rows["val"])
    assert len(set(val)) == len(val)  # nor twice in validation
    assert set(val).isdisjoint(prompts(rows["train"]))


def test_every_answer_is_what_python_says(prepared):
    _, rows = prepared
    for row in rows["train"] + rows["val"]:
        value = ast.literal_eval(row["input"])
        expected = type(value).__name__ if row["task"] == "type" else str(len(value))
        assert row["output"] == expected, row


def test_meta_counts_what_the_files_hold(prepared):
    directory, rows = prepared
    meta = json.loads((directory / "meta.json").read_text())
    for split, examples in rows.items():
        assert meta["splits"][split]["examples"] == len(examples)
        assert meta["splits"][split]["tasks"] == dict(Counter(row["task"] for row in examples))
        digest = hashlib.sha256((directory / f"{split}.jsonl").read_bytes()).hexdigest()
        assert meta["manifest"][f"{split}.jsonl"] == digest


def test_the_set_is_the_same_every_time(prepared, tmp_path):
    directory, _ = prepared
    instruct.prepare(tmp_path)
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / name).read_bytes() == (directory / name).read_bytes()


def test_local_splits_load_as_written(prepared):
    directory, rows = prepared
    train, val = instruct.load_splits(str(directory))
    assert list(train) == rows["train"] and list(val) == rows["val"]


def test_a_bad_data_argument_is_one_line(tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(KitError) as half:
        instruct.local_files(str(tmp_path))
    assert str(half.value) == (f"--data {tmp_path} has no val.jsonl: run "
                               f"`python -m coursekit instruct prepare --out {tmp_path}`")
    with pytest.raises(KitError) as nowhere:
        instruct.local_files("./no/such/dir")
    assert str(nowhere.value) == ("--data ./no/such/dir: not a directory of train.jsonl/val.jsonl, "
                                  "nor a hub data set name such as yahma/alpaca-cleaned")
    assert instruct.local_files("yahma/alpaca-cleaned") is None  # a hub name: loaded from the hub
