"""Instruction-tuning data: a task set the kit makes offline, and the same loader for hub data sets.

    python -m coursekit instruct prepare --out data/instruct
    DIR/{train,val}.jsonl   one example per line: {"instruction", "input", "output", "task"}
    DIR/meta.json           source, counts per split and task, sha256 of each file

The records use the Alpaca schema (instruction, input, output), so a hub data set in that schema
(``tatsu-lab/alpaca``, ``yahma/alpaca-cleaned``, ...) loads through the same code by name.

The offline tasks are chosen so that the kit's tiny pretrained GPT (4 layers, 64 wide, trained for
minutes on Python's documentation) can visibly learn them with LoRA in a few minutes on a CPU, and
so that a task metric exists besides the loss: every answer is one short word, scored by exact
match. A base model that was never shown the format scores about zero. The answers are words the
documentation uses often: a frozen tiny model can be steered towards them, while a rare word's
output embedding is too weak for adapters alone to make it likely.

    type     "What is the Python type of this value?"    [3, 17, 4]        -> list
    length   "How many items does this list have?"       ['a', 'b', 'c']   -> 3

Validation examples are new values, never seen in training: the model has to read the syntax
(quotes, brackets, a decimal point), not remember the answers.
"""
import json
import os
import random
from pathlib import Path

from coursekit import KitError, data, hub

WORDS = ["apple", "river", "stone", "cloud", "green", "seven", "house", "light", "paper", "music",
         "water", "table", "north", "spring", "glass", "train", "field", "bread", "night", "smile"]
INSTRUCTIONS = {
    "type": "What is the Python type of this value?",
    "length": "How many items does this list have?",
}
SPLIT_SIZES = {"train": 2000, "val": 200}
SEED = 1234


def random_item(rng):
    """An int or a quoted word, the elements of the generated containers."""
    return str(rng.randint(0, 99)) if rng.random() < 0.5 else repr(rng.choice(WORDS))


def python_literal(rng):
    """(source text of a random value, the name of its type)."""
    kind = rng.choice(["int", "float", "str", "list", "tuple", "dict", "set", "bool", "NoneType"])
    items = [random_item(rng) for _ in range(rng.randint(2, 4))]
    text = {
        "int": lambda: str(rng.randint(-999, 9999)),
        "float": lambda: f"{rng.uniform(-100, 100):.{rng.randint(1, 3)}f}",
        "str": lambda: repr(" ".join(rng.sample(WORDS, rng.randint(1, 2)))),
        "list": lambda: f"[{', '.join(items)}]",
        "tuple": lambda: f"({', '.join(items)})",
        "dict": lambda: "{" + ", ".join(f"{repr(w)}: {rng.randint(0, 99)}"
                                        for w in rng.sample(WORDS, len(items))) + "}",
        "set": lambda: "{" + ", ".join(sorted(set(items), key=items.index)) + "}",
        "bool": lambda: rng.choice(["True", "False"]),
        "NoneType": lambda: "None",
    }[kind]()
    return text, kind


def type_example(rng):
    text, kind = python_literal(rng)
    return {"task": "type", "instruction": INSTRUCTIONS["type"], "input": text, "output": kind}


def length_example(rng):
    items = [random_item(rng) for _ in range(rng.randint(1, 6))]
    return {"task": "length", "instruction": INSTRUCTIONS["length"],
            "input": f"[{', '.join(items)}]", "output": str(len(items))}


def make_examples(sizes=SPLIT_SIZES, seed=SEED):
    """{split: [example, ...]}, half of each task, deterministic for a seed; no validation input
    also occurs in training (the score measures new combinations, not memory)."""
    rng = random.Random(seed)
    makers = [type_example, length_example]
    splits, seen = {}, set()
    for split, size in sizes.items():
        examples = []
        while len(examples) < size:
            example = makers[len(examples) % len(makers)](rng)
            key = (example["task"], example["input"])
            if split != "train" and key in seen:  # bool and None repeat: train only
                continue
            seen.add(key)
            examples.append(example)
        splits[split] = examples
    return splits


def prepare(out_dir, sizes=SPLIT_SIZES, seed=SEED):
    """Write the offline task set to ``out_dir``; return its meta.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = make_examples(sizes, seed)
    for split, examples in splits.items():
        write_text_atomic(out_dir / f"{split}.jsonl",
                          "".join(json.dumps(e) + "\n" for e in examples))
    meta = {
        "source": "kit-tasks",
        "schema": ["instruction", "input", "output", "task"],
        "tasks": INSTRUCTIONS,
        "seed": seed,
        "splits": {split: {"examples": len(examples),
                           "tasks": {t: sum(e["task"] == t for e in examples) for t in INSTRUCTIONS}}
                   for split, examples in splits.items()},
        "manifest": {f"{split}.jsonl": data.sha256_file(out_dir / f"{split}.jsonl") for split in splits},
    }
    write_text_atomic(out_dir / "meta.json", json.dumps(meta, indent=2) + "\n")
    return meta


def format_prompt(example):
    """The Alpaca template: what the model reads before it writes the answer (the lora stage
    trains on it; lesson 09 asks the fine-tuned model its questions in it)."""
    text = f"### Instruction:\n{example['instruction']}\n\n"
    if example.get("input"):
        text += f"### Input:\n{example['input']}\n\n"
    return text + "### Response:\n"


def write_text_atomic(path, text):
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)



def local_files(source):
    """{split: path} when ``source`` is a prepared directory, None when it names a hub data set;
    a KitError when it is a path but not a prepared directory."""
    local = Path(source)
    if local.is_dir():
        files = {split: str(local / f"{split}.jsonl") for split in ("train", "val")}
        missing = [f for f in files.values() if not Path(f).is_file()]
        if missing:
            raise KitError(f"--data {source} has no {Path(missing[0]).name}: run "
                           f"`python -m coursekit instruct prepare --out {source}`")
        return files
    if local.exists() or source.startswith((".", "/")) or source.count("/") > 1:
        raise KitError(f"--data {source}: not a directory of train.jsonl/val.jsonl, nor a hub "
                       "data set name such as yahma/alpaca-cleaned")
    return None


def load_splits(source, val_examples=200, seed=SEED):
    """(train, val) as Hugging Face ``datasets.Dataset`` objects with instruction/input/output.

    ``source`` is a directory written by :func:`prepare` (or any with train.jsonl and val.jsonl),
    or the name of a hub data set in the Alpaca schema; a hub set without a validation split gets
    ``val_examples`` held out of its training split. With ``HF_HUB_OFFLINE=1`` only the local
    cache is read, as on a compute node without internet."""
    import datasets
    files = local_files(source)
    if files:
        loaded = datasets.load_dataset("json", data_files=files)
        return loaded["train"], loaded["val"]
    try:
        name, revision = hub.name_and_revision(source)
        loaded = datasets.load_dataset(name, revision=revision)
    except Exception as err:  # the hub raises many kinds: not found, offline, gated
        raise KitError(f"cannot load data set {source!r} ({type(err).__name__}): check the name, "
                       "or download it on a node with internet (HF_HUB_OFFLINE=1 reads only the "
                       "cache)") from None
    missing = {"instruction", "output"} - set(loaded["train"].column_names)
    if missing:
        raise KitError(f"data set {source!r} lacks the column(s) {', '.join(sorted(missing))} "
                       "of the Alpaca schema (instruction, input, output)")
    if "validation" in loaded:
        return loaded["train"], loaded["validation"]
    held_out = loaded["train"].train_test_split(test_size=val_examples, seed=seed)
    return held_out["train"], held_out["test"]
