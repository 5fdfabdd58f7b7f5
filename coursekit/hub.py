"""Hugging Face Hub names, at pinned revisions: a model or data set that changes on the Hub does
not change the course under it, and what a run downloaded can be checked against its commit.

Every repository the kit and its lessons name is pinned below to a commit (the name of the folder
a Hugging Face cache keeps it in, under snapshots/). Any other name takes a revision after an
``@``: ``--model someone/model@<commit>``. A name without one, and not pinned here, loads the
repository's current main branch.
"""
from pathlib import Path

PINNED = {
    "openai-community/gpt2": "607a30d783dfa663caf39e06633721c8d4cfcd7e",  # GPT-2 124M
    "HuggingFaceFW/fineweb-edu": "87f09149ef4734204d70ed1d046ddc9ca3f2b8f9",  # with sample/10BT
    "HuggingFaceTB/SmolLM2-135M": "93efa2f097d58c2a74874c7e644dbc9b0cee75a2",  # lesson 05's QLoRA
    "yahma/alpaca-cleaned": "12567cabf869d7c92e573c7c783905fc160e9639",  # the lora stage's --data
    "uoft-cs/cifar10": "0b2714987fa478483af9968de7c934580d0bb9a2",  # README: the resnet stage
}


def name_and_revision(reference):
    """(name, revision) of ``NAME`` or ``NAME@REVISION``; a local folder has no revision."""
    if Path(reference).exists():
        return reference, None
    name, _, revision = str(reference).partition("@")
    return name, revision or PINNED.get(name)
