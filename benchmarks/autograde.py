"""Seconds per submission of `nbgrader autograde`, per lesson: a full-marks submission (the source
notebook) and an untouched release, on this machine.

A fresh course directory in a temporary folder gets the student versions (`make assignments`
does the same); then, per lesson and kind, `--copies` identical submissions from as many students
are graded in one `nbgrader autograde <lesson>` run, as an instructor grades a class, and the
run's wall time is divided by the number of submissions. Autograde skips the cells tagged `demo`
(nbgrader_config.py). The class estimate is 80 submissions at the slower kind's rate. Writes
benchmarks/results/autograde.json.

    .venv/bin/python benchmarks/autograde.py [--copies 3] [--lessons 01-single-gpu-gpt ...]
"""
import argparse
import shutil
import tempfile
import time
from pathlib import Path

import nbformat
from throughput import machine

from coursekit import KIT_ROOT, diffs, grading, runs

RESULTS = KIT_ROOT / "benchmarks" / "results" / "autograde.json"
CLASS_SIZE = 80


def course_copy(root):
    """The kit's nbgrader course (config and lessons) in ``root``, student versions generated."""
    shutil.copy(KIT_ROOT / "nbgrader_config.py", root)
    shutil.copytree(KIT_ROOT / "notebooks", root / "notebooks",
                    ignore=shutil.ignore_patterns("runs", ".ipynb_checkpoints", *diffs.WORKING_COPIES))
    grading.generate(root)


def seconds_per_submission(root, lesson, kind, notebook, copies):
    """Grade ``copies`` submissions of ``notebook`` in one autograde run; wall seconds / copies."""
    shutil.rmtree(root / "submitted", ignore_errors=True)  # only this kind's students
    folder = grading.hand_in(root / "handed-in" / lesson / kind, lesson,
                             nbformat.read(notebook, as_version=4))
    submissions = {f"{kind}-{number}": folder for number in range(copies)}
    start = time.perf_counter()
    grading.autograde(root, lesson, submissions)
    return (time.perf_counter() - start) / copies


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=3, help="submissions per lesson and kind")
    parser.add_argument("--lessons", nargs="*", default=grading.lessons(KIT_ROOT),
                        help="lessons to grade (default: all); the others keep their results")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    result = {"benchmark": "nbgrader autograde, seconds per submission", "copies": args.copies,
              "class_size": CLASS_SIZE, "date": time.strftime("%Y-%m-%d"), "machine": machine(),
              "lessons": runs.read_json(args.out)["lessons"] if Path(args.out).exists() else {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        course_copy(root)
        for lesson in args.lessons:
            kinds = {"full_marks": KIT_ROOT / "notebooks" / lesson / f"{lesson}.ipynb",
                     "release": root / "release" / lesson / f"{lesson}.ipynb"}
            figures = {kind: seconds_per_submission(root, lesson, kind, notebook, args.copies)
                       for kind, notebook in kinds.items()}
            figures["class_minutes"] = CLASS_SIZE * max(figures.values()) / 60
            result["lessons"][lesson] = figures
            print(f"{lesson:22s} full marks {figures['full_marks']:5.1f} s, release "
                  f"{figures['release']:5.1f} s per submission; a class of {CLASS_SIZE}: "
                  f"{figures['class_minutes']:4.1f} min", flush=True)
    result["lessons"] = dict(sorted(result["lessons"].items()))
    runs.write_json_atomic(args.out, result)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
