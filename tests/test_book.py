"""The Jupyter Book: builds with warnings as errors, lessons executed, every page reachable."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from coursekit import KIT_ROOT, diffs

pytestmark = [pytest.mark.book, pytest.mark.slow]


def toc_files():
    toc = yaml.safe_load((KIT_ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc["parts"]:
        files += [chapter["file"] for chapter in part["chapters"]]
    return files


@pytest.fixture(scope="module")
def html(tmp_path_factory):
    """A cold build (no execution cache) into a temporary folder, exactly as `make book` runs it."""
    out = tmp_path_factory.mktemp("book")
    start = time.perf_counter()
    result = subprocess.run([str(Path(sys.executable).parent / "jupyter-book"), "build", str(KIT_ROOT), "-W", "-n",
                             "--keep-going", "--path-output", str(out)], capture_output=True, text=True,
                            timeout=1500)
    print(f"cold book build: {time.perf_counter() - start:.0f} s")
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return out / "_build" / "html"


def test_every_toc_entry_is_a_page_reachable_from_the_index(html):
    pages = {f"{name}.html" for name in toc_files()}
    assert all((html / page).is_file() for page in pages)
    reachable, todo = set(), ["book/intro.html"]
    while todo:
        page = todo.pop()
        if page in reachable or not (html / page).is_file():
            continue
        reachable.add(page)
        for link in re.findall(r'href="([^"#:]+\.html)', (html / page).read_text()):
            todo.append(os.path.normpath(os.path.join(os.path.dirname(page), link)))
    assert pages <= reachable


# what only an executed lesson shows: its printed results, and plots as images
EXECUTED_OUTPUTS = {
    "00-gpus-and-hpc": ["TFLOP/s"],
    "01-single-gpu-gpt": ["tokens per step", "temperature 0.5"],
    "02-ddp": ["max |all-reduced - whole batch| =", "strong scaling: speedup",
               "final validation loss"],
    "03-lightning": ["ddp_notebook:", "resumed run identical to the uninterrupted one: True"],
    "04-model-parallelism": ["fsdp on 4 processes: largest loss difference from ddp",
                             "| 2 | params |", "checkpointing:", "bubble predicted 0.33, measured",
                             "tp on 2 processes", "pp on 2 processes (1F1B)"],
    "05-llm-finetuning": ["B is zero at the start: True", "tokens count in the loss",
                          "W + (alpha/r) B A by hand vs the merged model",
                          "merged model vs base model + adapter: largest logit difference",
                          "FSDP on 2 processes: first loss"],
    "06-mlops": ["val_000000.npy changed", "weights_only=True refused it: WeightsUnpickler error",
                 "registered model kit-std version 1, alias champion", "exported Chrome trace"],
    "07-hpo": ["random search beats the grid 93%", "Optuna makes 5 brackets",
               "5 recipes of 3,072 tokens in", "and the same run directory: True"],
}


@pytest.mark.parametrize("lesson", EXECUTED_OUTPUTS)
def test_lessons_are_executed_with_outputs(html, lesson):
    page = (html / "notebooks" / lesson / f"{lesson}.html").read_text()
    for text in EXECUTED_OUTPUTS[lesson]:
        assert html_text(text) in page
    assert "<img" in page and "Traceback" not in page


@pytest.mark.parametrize("lesson", [step.lesson for step in diffs.LADDER])
def test_diff_lessons_show_every_hunk_highlighted(html, lesson):
    page = (html / "notebooks" / lesson / f"{lesson}.html").read_text()
    assert page.count('class="highlight-diff') == len(diffs.hunks(lesson))


def html_text(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def test_search_index_is_built(html):
    assert (html / "search.html").is_file() and (html / "searchindex.js").is_file()
