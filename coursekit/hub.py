"""Hugging Face Hub names, at pinned revisions: a model or data set that changes on the Hub does
not change the course under it, and what a run downloaded can be checked against its commit.

The kit's own defaults are pinned below to a commit of their repository (the name of the folder
a Hugging Face cache keeps it in, under snapshots/). Any other name takes a revision after an
``@``: ``--model someone/model@<commit>``. A name without one, and not pinned here, loads the
repository's current main branch.
"""
from pathlib import Path

PINNED = {
    "openai-community/gpt2": "607a30d783dfa663caf39e06633721c8d4cfcd7e",  # GPT-2 124M
    "HuggingFaceFW/fineweb-edu": "87f09149ef4734204d70ed1d046ddc9ca3f2b8f9",  # with sample/10BT
}


def name_and_revision(reference):
    """(name, revision) of ``NAME`` or ``NAME@REVISION``; a local folder has no revision."""
    if Path(reference).exists():
        return reference, None
    name, _, revision = str(reference).partition("@")
    return name, revision or PINNED.get(name)
