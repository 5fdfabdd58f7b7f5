"""The book's two editions, built from one execution of each lesson.

- The **reader's edition** (`make book`, published): every exercise as its student version shows
  it (nbgrader's own ClearSolutions and ClearHiddenTests), with no output under a solution cell
  or a hidden test, so that no page, search index or downloadable source gives an answer away.
- The **instructor's edition** (`make book-instructor`): the lessons as written, solutions and
  hidden tests included.

Both show the outputs of the source notebooks, executed in their own folders: the edition's copy
of a lesson only changes what is shown. What the builder's own machine and account show is not
published, neither on a page nor in a notebook a reader downloads: a cell tagged
``remove-output`` (the kernel's report, Slurm's view of your jobs) shows no output, and in every
other output the kit's folder reads ``$KIT``, the home directory ``~`` and the host's name
``$HOST``. Executions are kept in jupyter-cache's store (the one
Jupyter Book uses), so a lesson whose code did not change is not run again, and building the
second edition runs nothing; the lessons that must run do so two at a time (execute_missing).
Jupyter Book then builds each edition from a folder of its own, with execution off and warnings
as errors. The reader's edition leaves out the instructor's notes (cells tagged "instructor").
"""
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import yaml
from jupyter_cache import get_cache
from jupyter_cache.base import CacheBundleIn
from jupyter_cache.executors.utils import single_nb_execution
from nbgrader.preprocessors import ClearHiddenTests, ClearSolutions
from traitlets.config import Config

from coursekit import KIT_ROOT, KitError, grading, launch

EDITIONS = ("reader", "instructor")
#: What Jupyter Book reads besides the lessons: the configuration, the table of contents, the
#: prose chapters and the batch files a chapter includes (book/cluster.md).
SOURCES = ("_toc.yml", "book", "batchfiles")


def lesson_notebooks(root):
    """The lessons' notebooks under ``root``, in the order of the table of contents."""
    toc = yaml.safe_load((Path(root) / "_toc.yml").read_text())
    files = [chapter["file"] for part in toc["parts"] for chapter in part["chapters"]]
    return [Path(root) / f"{name}.ipynb" for name in files if name.startswith("notebooks/")]


def execute_missing(notebooks, cache_dir, timeout, at_once=None):
    """Execute the lessons of ``notebooks`` that the cache has no execution of, two at a time on
    a machine without a GPU: a lesson's cells mostly keep one core busy, and on 2 cores one
    lesson after another took 9 of the 12 minutes of a fresh `make book`. Each lesson's
    processes then get their share of the cores' threads (OMP_NUM_THREADS), as the tests give
    them, instead of twice as many threads as cores spinning for each other. With a GPU, one at
    a time: two lessons' runs would share its memory. The last lessons run longest: they start
    first, so that the short ones fill in at the end."""
    missing = [notebook for notebook in reversed(notebooks)
               if not has_execution(notebook, cache_dir)]
    at_once = at_once or lanes()
    if at_once > 1:
        cores = len(os.sched_getaffinity(0))
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // at_once)))
    failed = threading.Event()  # no lesson starts after one failed

    def execute(notebook):
        if not failed.is_set():
            try:
                executed(notebook, cache_dir, timeout)
            except KitError:
                failed.set()
                raise

    with ThreadPoolExecutor(max_workers=at_once) as pool:
        for execution in [pool.submit(execute, notebook) for notebook in missing]:
            execution.result()  # a KitError naming the lesson that failed


def lanes():
    """How many lessons execute at once: two where there are 2 cores or more and no GPU."""
    import torch  # only here: the book's other steps have no need of it

    return 1 if torch.cuda.is_available() or len(os.sched_getaffinity(0)) < 2 else 2


def has_execution(notebook, cache_dir):
    try:
        get_cache(str(cache_dir)).match_cache_notebook(nbformat.read(notebook, as_version=4))
    except KeyError:
        return False
    return True


def executed(notebook, cache_dir, timeout):
    """``notebook`` with the outputs of an execution in its own folder (each cell at most
    ``timeout`` seconds), taken from the cache when its code cells are unchanged. A cell that
    raises is a KitError naming the lesson."""
    cache = get_cache(str(cache_dir))
    source = nbformat.read(notebook, as_version=4)
    try:
        return cache.merge_match_into_notebook(source)[1]
    except KeyError:  # not run with this code yet
        pass
    # single_nb_execution is jupyter-cache's (and so Jupyter Book's) nbclient run: it keeps the
    # widgets' state in the notebook's metadata, so that the book can draw them without a kernel
    runtime = launch.lab_runtime_dir()  # under /tmp: a socket's path is 107 bytes at most
    try:
        result = single_nb_execution(source, cwd=str(Path(notebook).parent), timeout=timeout,
                                     allow_errors=False, meta_override=True,
                                     config=private_kernel(runtime))
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    if result.err is not None:
        raise KitError(f"{Path(notebook).name} failed to execute:\n{result.exc_string}")
    keep_execution(source, notebook, cache_dir)
    return source


def private_kernel(runtime):
    """nbclient's configuration for a kernel over IPC, as `make lab` runs its kernels
    (launch.lab_command): its connection file and Unix sockets in ``runtime``, a folder of the
    user's own (0700). Over TCP, its default, the kernel's ports on 127.0.0.1 would let any user
    of a shared login node subscribe to everything the lesson prints, solutions' outputs
    included (the messages are signed, so they could not run code in it)."""
    return Config({"KernelManager": {"transport": "ipc",
                                     "connection_file": os.path.join(runtime, "kernel.json")}})


def keep_execution(executed_notebook, notebook, cache_dir):
    """Keep an execution of ``notebook`` (made here, or by nbval in the tests) in the cache, where
    the books built with ``cache_dir`` find it as long as the lesson's code is unchanged."""
    get_cache(str(cache_dir)).cache_notebook_bundle(CacheBundleIn(executed_notebook, str(notebook)),
                                                    check_validity=False, overwrite=True)


def reader_version(notebook):
    """A copy of an executed lesson as the reader's edition shows it: no instructor's note,
    solution regions replaced by the student version's stubs, hidden tests removed, and the
    outputs of those cells dropped (an output can show an answer)."""
    copy, _ = grading.remove_instructor_notes().preprocess(nbformat.from_dict(notebook), {})
    revealing = {index for index, cell in enumerate(copy.cells) if reveals_answer(cell)}
    for step in (ClearSolutions(), ClearHiddenTests()):
        copy, _ = step.preprocess(copy, {})
    for index in revealing:
        if copy.cells[index].cell_type == "code":
            copy.cells[index].outputs = []
    return copy


#: Jupyter Book's tag for a cell whose output a page leaves out; the editions drop the output
#: from their sources too, so that the downloadable notebook does not carry it either.
PRIVATE_OUTPUT_TAG = "remove-output"


def published_outputs(notebook, root):
    """A copy of ``notebook`` without the outputs of cells tagged PRIVATE_OUTPUT_TAG, and with the
    kit's folder ``root``, the home directory and the host's name written as ``$KIT``, ``~`` and
    ``$HOST`` in the others."""
    copy = nbformat.from_dict(notebook)
    private = [(re.escape(str(Path(root).resolve())), "$KIT"), (re.escape(str(root)), "$KIT"),
               (rf"\b{re.escape(socket.gethostname())}\b", "$HOST")]  # the name as a whole word
    if Path.home() != Path("/"):
        private.append((re.escape(str(Path.home())), "~"))
    for cell in copy.cells:
        if cell.cell_type != "code":
            continue
        if PRIVATE_OUTPUT_TAG in cell.metadata.get("tags", []):
            cell.outputs = []
        for output in cell.outputs:
            if "text" in output:  # a stream
                output.text = without_private(output.text, private)
            for mime, shown in output.get("data", {}).items():
                if mime.startswith("text/"):  # not images: base64 can hold any short word
                    output.data[mime] = without_private(shown, private)
    return copy


def without_private(text, replacements):
    for pattern, shown in replacements:
        text = re.sub(pattern, shown, text)
    return text


def reveals_answer(cell):
    nbgrader = cell.metadata.get("nbgrader", {})
    return bool(nbgrader.get("solution")) or "BEGIN HIDDEN TESTS" in cell.source


def write_edition(edition, root, folder, cache_dir):
    """The sources Jupyter Book builds ``edition`` from, written into ``folder``."""
    if edition not in EDITIONS:
        raise KitError(f"edition {edition!r} is not one of {', '.join(EDITIONS)}")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name in SOURCES:
        copy = shutil.copytree if (root / name).is_dir() else shutil.copy
        copy(root / name, folder / name)
    config = yaml.safe_load((root / "_config.yml").read_text())
    timeout = config["execute"]["timeout"]
    config["execute"]["execute_notebooks"] = "off"  # executed here, in the lessons' own folders
    if edition == "instructor":
        config["title"] += " (instructor's edition)"
    (folder / "_config.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    execute_missing(lesson_notebooks(root), cache_dir, timeout)
    for notebook in lesson_notebooks(root):
        shown = published_outputs(executed(notebook, cache_dir, timeout), root)
        if edition == "reader":
            shown = reader_version(shown)
        target = folder / notebook.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(shown, target)


def build(edition, root=KIT_ROOT, out=None, cache_dir=None):
    """Build ``edition`` of the book of the kit at ``root`` with warnings as errors, into
    ``out``/_build/html (by default the kit's _build/html for the reader's edition and
    _build/instructor/_build/html for the instructor's); returns that HTML folder."""
    root = Path(root)
    out = Path(out) if out else root if edition == "reader" else root / "_build" / edition
    cache_dir = Path(cache_dir) if cache_dir else root / "_build" / ".jupyter_cache"
    sources = root / "_build" / f"{edition}-sources" if out == root else out / "sources"
    write_edition(edition, root, sources, cache_dir)
    jupyter_book = Path(sys.executable).parent / "jupyter-book"
    result = subprocess.run([str(jupyter_book), "build", str(sources), "-W", "-n", "--keep-going",
                             "--path-output", str(out)], capture_output=True, text=True)
    if result.returncode != 0:
        raise KitError(f"the {edition}'s edition did not build:\n"
                       f"{(result.stdout + result.stderr)[-6000:]}")
    return out / "_build" / "html"
