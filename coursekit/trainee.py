"""The trainees' edition of the kit: everything the lessons need, and no answer.

    python -m coursekit trainee-kit --out DIR        (`make trainee-kit` writes trainee-kit/)

The instructor's checkout holds each lesson's source notebook and its jupytext `.py` pair, both
with every exercise's solution and hidden tests, and the tests that grade them. The trainee kit
is the checkout's tracked files without those: each `notebooks/<lesson>/` is the student version
nbgrader generates (the lesson's other files, such as its demo scripts, come with it); `tests/`,
the book's sources (the reader's book is published) and the instructor's nbgrader configuration
stay out. Its nbgrader_config.py is the trainees' own: the class's exchange, from course.toml.

Before it writes anything it checks every file it would ship for the lines of the answers: the
lines inside a solution or hidden-test block that appear nowhere outside such blocks, in any
lesson (an answer's `loss.backward()` is shown in the open elsewhere), nor in the kit's own code
(which trainees have anyway, and which repeats a few, such as `try:`).
"""
import shutil
import subprocess
import tempfile
from pathlib import Path

import jupytext

from coursekit import KitError, grading

#: Tracked paths that stay with the instructor.
INSTRUCTOR_ONLY = ("tests/", "book/", ".ci/", "nbgrader_config.py")
#: The trainees' nbgrader configuration (the exchange of course.toml), the kit's nbgrader_config.py.
TRAINEE_NBGRADER_CONFIG = Path(__file__).with_name("jupyter") / "trainee_nbgrader_config.py"
BLOCKS = {"### BEGIN SOLUTION": True, "### BEGIN HIDDEN TESTS": True,
          "### END SOLUTION": False, "### END HIDDEN TESTS": False}


def tracked_files(root):
    """The checkout's files under version control (what a clone holds), relative to root."""
    result = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True)
    if result.returncode != 0:
        raise KitError(f"{root} is not a git checkout: the trainee kit is made from one")
    return [Path(name) for name in result.stdout.split("\0") if name]


def marked_and_unmarked_lines(notebook):
    """A source notebook's non-blank lines inside solution and hidden-test blocks, and outside."""
    marked, unmarked, inside = set(), set(), False
    for cell in jupytext.read(notebook).cells:
        for line in (line.strip() for line in cell.source.splitlines()):
            if line in BLOCKS:
                inside = BLOCKS[line]
            elif line:
                (marked if inside else unmarked).add(line)
    return marked, unmarked


def answer_lines(root, kit_code_lines):
    """{line: lesson} of every answer line of every lesson (the module docstring says which)."""
    lines = {lesson: marked_and_unmarked_lines(Path(root) / "notebooks" / lesson /
                                               f"{lesson}.ipynb")
             for lesson in grading.lessons(root)}
    shown = set().union(*(unmarked for _, unmarked in lines.values()))
    answers = {}
    for lesson, (marked, _) in lines.items():
        answers.update(dict.fromkeys(marked - shown - kit_code_lines, lesson))
    return answers


def lines_of(path):
    """The stripped lines of a text file; of a notebook, the lines of its cells."""
    try:
        if path.suffix == ".ipynb":
            text = "\n".join(cell.source for cell in jupytext.read(path).cells)
        else:
            text = path.read_text()
    except (UnicodeDecodeError, OSError):  # binary files hold no answer lines
        return set()
    return {line.strip() for line in text.splitlines()}


def build(out, root):
    """Write the trainee kit of the checkout `root` to `out` (which must not exist yet)."""
    root, out = Path(root), Path(out)
    if out.exists():
        raise KitError(f"{out} exists: the trainee kit is written to a new folder")
    lessons = grading.lessons(root)
    shipped = [path for path in tracked_files(root)
               if not str(path).startswith(INSTRUCTOR_ONLY)
               and not (path.parts[0] == "notebooks" and len(path.parts) > 2
                        and path.parts[1] in lessons)]
    kit_code = set().union(*(lines_of(root / path) for path in shipped))
    answers = answer_lines(root, kit_code)
    with tempfile.TemporaryDirectory() as course:
        shutil.copy(root / "nbgrader_config.py", course)
        shutil.copytree(root / "notebooks", Path(course) / "notebooks",
                        ignore=shutil.ignore_patterns("runs", ".ipynb_checkpoints"))
        release = grading.generate(course)
        released = [(release / lesson, Path("notebooks") / lesson) for lesson in lessons]
        leaks = [f"{folder / path.relative_to(folder)}: {line!r} ({answers[line]})"
                 for folder, _ in released for path in sorted(folder.rglob("*")) if path.is_file()
                 for line in sorted(lines_of(path) & answers.keys())]
        if leaks:
            raise KitError(f"the trainee kit would hold answers: {leaks[0]} and "
                           f"{len(leaks) - 1} more")
        for path in shipped:
            (out / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / path, out / path)
        for folder, target in released:
            shutil.copytree(folder, out / target)
    shutil.copy(TRAINEE_NBGRADER_CONFIG, out / "nbgrader_config.py")
    return out, len(answers)
