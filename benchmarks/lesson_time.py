"""How long a trainee needs for each lesson, section by section: an estimate from what a trainee
does, for each lesson's **Time.** and the instructor guide's plans.

Three parts, per section (a `## ` heading) of each lesson:
- reading: the prose's words at READING_WPM, and the code of the cells at CODE_LINES_PER_MIN;
- exercises: EXERCISE_BASE_MIN per graded exercise, plus the lines the trainee writes (the
  solution's lines) at WRITING_LINES_PER_MIN; the same for a stage conversion done as practice,
  ungraded (its Markdown cell tagged PRACTICE_TAG), with the patches' added lines;
- waiting: the cells' run time, measured by executing the lesson here (a laptop-class CPU, the
  tiny preset), in the lesson's folder as the book does.

The rates are assumptions, not measurements of trainees: calibrate them with the times of a pilot
group (the instructor guide says how) and run this again. Writes benchmarks/results/lesson_time.json.

    .venv/bin/python benchmarks/lesson_time.py [--lessons 02-ddp ...]
"""
import argparse
import re
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from throughput import machine

from coursekit import KIT_ROOT, diffs, grading, runs

RESULTS = KIT_ROOT / "benchmarks" / "results" / "lesson_time.json"
READING_WPM = 110  # technical prose with formulas, read to understand
CODE_LINES_PER_MIN = 15  # code read in a cell before running it
EXERCISE_BASE_MIN = 4  # reading the task and the visible tests, running them, one fix
#: The tag of the Markdown cell that sets a stage conversion as practice, with no graded cell
PRACTICE_TAG = "practice"
WRITING_LINES_PER_MIN = 2  # lines of a solution, thought out and typed


class TimedClient(NotebookClient):
    """nbclient, with the wall time of every code cell."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds = {}

    async def async_execute_cell(self, cell, cell_index, *args, **kwargs):
        start = time.perf_counter()
        result = await super().async_execute_cell(cell, cell_index, *args, **kwargs)
        self.seconds[cell_index] = time.perf_counter() - start
        return result


def run_seconds(lesson):
    """{cell index: seconds} of executing the lesson in its folder."""
    path = KIT_ROOT / "notebooks" / lesson / f"{lesson}.ipynb"
    client = TimedClient(nbformat.read(path, as_version=4), timeout=900,
                         resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return client.seconds


def conversion_lines(lesson):
    """Lines a trainee writes to convert the lesson's stage scripts: its patches' added lines."""
    return sum(diffs.counts(diffs.patch_path(step).read_text())[0]
               for step in diffs.lesson_steps(lesson))


def solution_lines(cell):
    """Lines a trainee writes for the exercise whose solution cell this is."""
    inside = re.search(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", cell.source, re.DOTALL)
    return len([line for line in inside.group(1).splitlines() if line.strip()]) if inside else 0


def sections(lesson, seconds):
    """[(heading, reading min, exercise min, waiting min)] in the lesson's order."""
    cells = nbformat.read(KIT_ROOT / "notebooks" / lesson / f"{lesson}.ipynb", as_version=4).cells
    found = [["(opening)", 0.0, 0.0, 0.0]]
    for index, cell in enumerate(cells):
        if grading.INSTRUCTOR_TAG in cell.metadata.get("tags", []):
            continue  # not the trainee's to read
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("## "):
                    found.append([line[3:].strip(), 0.0, 0.0, 0.0])
            found[-1][1] += len(cell.source.split()) / READING_WPM
            if PRACTICE_TAG in cell.metadata.get("tags", []):  # an ungraded conversion
                found[-1][2] += EXERCISE_BASE_MIN + conversion_lines(lesson) / WRITING_LINES_PER_MIN
            continue
        nbgrader = cell.metadata.get("nbgrader", {})
        if nbgrader.get("solution"):
            found[-1][2] += EXERCISE_BASE_MIN + solution_lines(cell) / WRITING_LINES_PER_MIN
        elif not nbgrader.get("grade"):
            found[-1][1] += len(cell.source.splitlines()) / CODE_LINES_PER_MIN
        found[-1][3] += seconds.get(index, 0.0) / 60
    return [tuple(section) for section in found]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lessons", nargs="*", default=grading.lessons(KIT_ROOT),
                        help="lessons to time (default: all); the others keep their results")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    result = {"benchmark": "minutes a trainee needs per lesson (estimate)",
              "rates": {"reading_wpm": READING_WPM, "code_lines_per_min": CODE_LINES_PER_MIN,
                        "exercise_base_min": EXERCISE_BASE_MIN,
                        "writing_lines_per_min": WRITING_LINES_PER_MIN},
              "date": time.strftime("%Y-%m-%d"), "machine": machine(),
              "lessons": runs.read_json(args.out)["lessons"] if Path(args.out).exists() else {}}
    for lesson in args.lessons:
        parts = sections(lesson, run_seconds(lesson))
        total = [sum(part[i] for part in parts) for i in (1, 2, 3)]
        result["lessons"][lesson] = {
            "minutes": round(sum(total)), "reading": round(total[0]), "exercises": round(total[1]),
            "waiting": round(total[2]),
            "sections": [{"heading": h, "minutes": round(r + e + w, 1)} for h, r, e, w in parts]}
        print(f"{lesson:22s} {sum(total):5.0f} min: reading {total[0]:4.0f}, exercises "
              f"{total[1]:4.0f}, waiting for cells {total[2]:4.1f}", flush=True)
        for heading, *minutes in parts:
            print(f"    {sum(minutes):5.1f}  {heading}")
    result["lessons"] = dict(sorted(result["lessons"].items()))
    runs.write_json_atomic(args.out, result)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
