"""A class through nbgrader's exchange, end to end, with real Unix users: the instructor guide's
class workflow (book/instructor.md, "A class through the exchange"), command by command, each
run as the user who runs it on a cluster.

The instructor and the trainees alice, bob and dave are members of the course's group; carol is
on the roster and hands nothing in. The exchange lies on "project space" as `coursekit exchange
create` makes it, and course.toml names it for both sides. Alice hands in every exercise solved,
on time; bob one exercise unsolved, after the due date, and a test cell of a solved one deleted,
which autograde puts back; dave renames a graded cell, which nbgrader refuses. The instructor
collects, autogrades in the grading sandbox, releases feedback, exports the grades and reads the
class summary and what each graded cell showed; trainees fetch their feedback. Then the instructor opens
the formgrader from JupyterLab in a real browser (headless Chromium) and comments on a
submission, and the comment reaches its feedback."""
import contextlib
import csv
import html
import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from datetime import datetime, timezone
from pathlib import Path

import nbformat
import pytest

import chromium
from chromium import screenshot, start_lab, wait_for
from conftest import debian_tool, lesson_notebook
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from test_gradebook import pearson
from test_grading import exercises, with_cells_from

from coursekit import KIT_ROOT, grading, trainee

pytestmark = pytest.mark.grading
#: A lesson whose graded cells are plain Python: each submission graded starts no model
LESSON = "00-gpus-and-hpc"
COURSE_ID = "gpt-course"
GROUP = "kit-course"
INSTRUCTOR = "kit-instructor"
#: The trainees who hand in, and what: every exercise solved, one left as released (the one
#: below), one graded cell renamed.
SOLVED, ONE_UNSOLVED, CELL_RENAMED = "kit-alice", "kit-bob", "kit-dave"
ABSENT = "kit-carol"  # on the roster, hands nothing in
TRAINEES = (SOLVED, ONE_UNSOLVED, CELL_RENAMED, ABSENT)
UNSOLVED = "most_gpus"  # bob's exercise left as released


def deleted_test():
    """The test cell bob deletes: the first of an exercise he solved."""
    source = nbformat.read(lesson_notebook(LESSON), as_version=4)
    solved = {test for exercise, tests in exercises(source).items() if exercise != UNSOLVED
              for test in tests}
    return next(grading.grade_id(cell) for cell in source.cells
                if grading.is_test_cell(cell) and grading.grade_id(cell) in solved)


def closed_ancestor(path):
    """The highest folder above ``path`` that other users cannot enter (None: they reach it)."""
    return next((folder for folder in reversed(Path(path).parents)
                 if not folder.stat().st_mode & stat.S_IXOTH), None)


#: Runs its arguments after `mount` lines that open the way to the kit's Python: in a mount
#: namespace of its own (unshare), the closed folder above the interpreter (here root's home,
#: where pyenv keeps it) becomes an empty folder that anyone may enter, holding only the
#: interpreter's installation. Nothing outside the command sees a change; on a cluster, the
#: course's Python is where everyone reaches it.
OPEN_THE_WAY_TO_PYTHON = """set -e
closed=$1 inside=$2 kept=$3; shift 3
mount --bind "$inside" "$kept"
mount -t tmpfs -o mode=0711 tmpfs "$closed"
mkdir -p "$inside"
mount --bind "$kept" "$inside"
exec "$@"
"""


@contextlib.contextmanager
def user_command(user, *command):
    """The command line that runs ``command`` as ``user`` with a login's environment: their HOME,
    the kit's Python first on PATH (as the course's module or conda environment puts it)."""
    home = Path(f"~{user}").expanduser()
    env = {"HOME": str(home), "USER": user, "LOGNAME": user, "LANG": "C.UTF-8",
           "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}
    run = ["runuser", "-u", user, "--", "env", "-i",
           *(f"{key}={value}" for key, value in env.items()), *command]
    interpreter = Path(sys.base_prefix)
    closed = closed_ancestor(interpreter / "bin")
    if not closed:
        yield run
        return
    inside = closed / interpreter.relative_to(closed).parts[0]
    with tempfile.TemporaryDirectory(prefix="kit-python-") as kept:
        yield ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               OPEN_THE_WAY_TO_PYTHON, "sh", str(closed), str(inside), kept, *run]


def as_user(user, *command, cwd, check=True):
    """Run ``command`` as ``user`` in ``cwd`` (user_command); the CompletedProcess."""
    with user_command(user, *command) as run:
        result = subprocess.run(run, cwd=cwd, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, f"{' '.join(command)} as {user}:\n" \
                                       f"{result.stdout[-2000:]}{result.stderr[-3000:]}"
    return result


def nbgrader(user, *args, cwd, check=True):
    return as_user(user, "python", "-m", "nbgrader", *args, cwd=cwd, check=check)


def accounts(base):
    """The course's group and users, homes private under ``base``; removed afterwards."""
    subprocess.run(["groupadd", GROUP], check=True)
    for user in (INSTRUCTOR, *TRAINEES):
        home = base / "home" / user
        subprocess.run(["useradd", "--create-home", "--home-dir", str(home), "--user-group",
                        "--groups", GROUP, "--shell", "/bin/bash", user], check=True)
        home.chmod(0o700)  # as a cluster's homes are; useradd here follows the umask, 022


def remove_accounts():
    for user in (INSTRUCTOR, *TRAINEES):
        subprocess.run(["pkill", "-KILL", "-u", user], capture_output=True)
        subprocess.run(["userdel", "--remove", user], capture_output=True)
    subprocess.run(["groupdel", GROUP], capture_output=True)


def course_settings(folder, exchange):
    (folder / "course.toml").write_text(f'id = "{COURSE_ID}"\nexchange = "{exchange}"\n')


def instructors_course(base, exchange):
    """The instructor's grading checkout: the kit's nbgrader set-up and the lesson, theirs."""
    course = base / "home" / INSTRUCTOR / "course"
    (course / "notebooks").mkdir(parents=True)
    shutil.copy(KIT_ROOT / "nbgrader_config.py", course)
    course_settings(course, exchange)
    shutil.copytree(KIT_ROOT / "notebooks" / LESSON, course / "notebooks" / LESSON,
                    ignore=shutil.ignore_patterns("runs", ".ipynb_checkpoints"))
    (course / "students.csv").write_text("id\n" + "\n".join(TRAINEES[:4]) + "\n")
    subprocess.run(["chown", "-R", f"{INSTRUCTOR}:{INSTRUCTOR}", course], check=True)
    return course


def trainees_kit(user, base, exchange):
    """What a trainee's clone of the trainee kit holds for the exchange: its nbgrader_config.py
    and the course.toml the instructor set."""
    kit = base / "home" / user / "kit"
    kit.mkdir()
    shutil.copy(trainee.TRAINEE_NBGRADER_CONFIG, kit / "nbgrader_config.py")
    course_settings(kit, exchange)
    subprocess.run(["chown", "-R", f"{user}:{user}", kit], check=True)
    return kit


def answers(release_path, base):
    """The folder of each trainee's work, <trainee>.ipynb, readable by that trainee alone: the
    release with the lesson's solutions written in (all, all but UNSOLVED, or all and a graded
    cell renamed)."""
    source = nbformat.read(lesson_notebook(LESSON), as_version=4)
    release = nbformat.read(release_path, as_version=4)
    solutions = list(exercises(source))
    renamed = with_cells_from(release, source, solutions)
    test_cell = next(cell for cell in renamed.cells
                     if cell.metadata.get("nbgrader", {}).get("grade"))
    test_cell.metadata.nbgrader.grade_id += "_renamed"
    one_unsolved = with_cells_from(release, source, set(solutions) - {UNSOLVED})
    one_unsolved.cells = [cell for cell in one_unsolved.cells
                          if grading.grade_id(cell) != deleted_test()]
    work = {SOLVED: with_cells_from(release, source, solutions), ONE_UNSOLVED: one_unsolved,
            CELL_RENAMED: renamed}
    folder = base / "answers"
    folder.mkdir(mode=0o755)
    for user, notebook in work.items():
        nbformat.write(notebook, folder / f"{user}.ipynb")
        (folder / f"{user}.ipynb").chmod(0o600)
        shutil.chown(folder / f"{user}.ipynb", user)
    return folder


def hand_in(user, base, exchange, answers_folder):
    """As ``user``: fetch the lesson, do the work (their answer, copied in), submit."""
    kit = trainees_kit(user, base, exchange)
    nbgrader(user, "fetch_assignment", LESSON, cwd=kit)
    as_user(user, "cp", str(answers_folder / f"{user}.ipynb"),
            str(kit / LESSON / f"{LESSON}.ipynb"), cwd=kit)
    nbgrader(user, "submit", LESSON, cwd=kit)
    return kit


def forge(forger, victim, exchange, kit):
    """As ``forger``: hand in their own folder under ``victim``'s name, later than the victim's
    own submission (the inbound folder takes anyone's writes); the name of what they wrote."""
    name = f"{victim}+{LESSON}+{datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S.%f} UTC+forged"
    as_user(forger, "cp", "-r", str(kit / LESSON), str(exchange / COURSE_ID / "inbound" / name),
            cwd=kit)
    return name


def hidden_test_lines():
    """The lines of the lesson's hidden tests that appear nowhere else in it."""
    hidden, elsewhere, inside = set(), set(), False
    for cell in nbformat.read(lesson_notebook(LESSON), as_version=4).cells:
        for line in (line.strip() for line in cell.source.splitlines()):
            if line in ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"):
                inside = line.startswith("### BEGIN")
            elif line:
                (hidden if inside else elsewhere).add(line)
    return hidden - elsewhere


#: Run as a trainee: every file under a folder that the trainee can read, with the hidden-test
#: lines it holds, as text (a notebook's cells and outputs, a page's text without its markup).
READABLE_WITH_HIDDEN_LINES = textwrap.dedent("""
    import html, json, os, re, sys
    hidden = set(json.load(open(sys.argv[2])))

    def text_of(path):
        text = open(path, errors="replace").read()
        if path.endswith(".ipynb"):
            cells = json.loads(text)["cells"]
            return "\\n".join("".join(cell["source"]) + json.dumps(cell.get("outputs", []))
                              for cell in cells)
        if path.endswith(".html"):
            return html.unescape(re.sub(r"<[^>]*>", "", text))
        return text

    found, readable = [], 0
    for folder, _, files in os.walk(sys.argv[1]):
        for name in files:
            path = os.path.join(folder, name)
            try:
                text = text_of(path)
            except OSError:
                continue
            readable += 1
            found += [(path, line) for line in hidden if line in text]
    print(json.dumps({"readable": readable, "found": found}))
""")


@pytest.fixture(scope="module")
def class_run():
    """The whole round trip, once; what the tests read afterwards. Accounts and files removed."""
    if os.geteuid() != 0:
        pytest.skip("the class's Unix users are made with useradd, which needs root")
    debian_tool("bwrap", "bubblewrap")  # the grading kernel's sandbox
    base = Path(tempfile.mkdtemp(prefix="kit-class-"))
    base.chmod(0o755)
    remove_accounts()  # any left by an interrupted run
    try:
        accounts(base)
        (base / "project").mkdir(mode=0o755)  # the project's space, where the instructor writes
        shutil.chown(base / "project", INSTRUCTOR)
        exchange = base / "project" / "course" / "exchange"
        course = instructors_course(base, exchange)
        as_user(INSTRUCTOR, "python", "-m", "coursekit", "exchange", "create", str(exchange),
                "--group", GROUP, cwd=course)
        as_user(INSTRUCTOR, "python", "-m", "coursekit", "assignments", "--root", ".", cwd=course)
        nbgrader(INSTRUCTOR, "db", "student", "import", "students.csv", cwd=course)
        nbgrader(INSTRUCTOR, "release_assignment", LESSON, cwd=course)
        nothing_graded = as_user(INSTRUCTOR, "python", "-m", "coursekit", "grades", LESSON,
                                 "--items", cwd=course, check=False)
        work = answers(course / "release" / LESSON / f"{LESSON}.ipynb", base)
        kits = {SOLVED: hand_in(SOLVED, base, exchange, work)}
        # the due date passes: later submissions are late
        nbgrader(INSTRUCTOR, "db", "assignment", "add", LESSON, "--duedate",
                 datetime.now(timezone.utc).isoformat(), cwd=course)
        kits |= {user: hand_in(user, base, exchange, work) for user in (ONE_UNSOLVED, CELL_RENAMED)}
        forged = forge(ONE_UNSOLVED, SOLVED, exchange, kits[ONE_UNSOLVED])
        collected = nbgrader(INSTRUCTOR, "collect", LESSON, cwd=course, check=False)
        autograded = as_user(INSTRUCTOR, "python", "-m", "coursekit", "autograde", LESSON,
                             cwd=course, check=False)
        nbgrader(INSTRUCTOR, "generate_feedback", LESSON, cwd=course)
        nbgrader(INSTRUCTOR, "release_feedback", LESSON, cwd=course)
        for user in (SOLVED, ONE_UNSOLVED):
            nbgrader(user, "fetch_feedback", LESSON, cwd=kits[user])
        nbgrader(INSTRUCTOR, "export", "--to", "grades.csv", cwd=course)
        summary = as_user(INSTRUCTOR, "python", "-m", "coursekit", "grades", LESSON, "--plot",
                          "grades-00.png", "--items", cwd=course)
        with tempfile.NamedTemporaryFile("w", suffix=".json") as hidden:  # outside base
            json.dump(sorted(hidden_test_lines()), hidden)
            hidden.flush()
            os.chmod(hidden.name, 0o644)
            seen_by_trainee = {user: json.loads(as_user(
                user, "python", "-c", READABLE_WITH_HIDDEN_LINES, str(base), hidden.name,
                cwd=kits[user]).stdout) for user in (SOLVED, ONE_UNSOLVED)}
        yield {"base": base, "course": course, "exchange": exchange, "kits": kits,
               "forged": forged, "collected": collected, "work": work, "autograded": autograded,
               "summary": summary.stdout, "nothing_graded": nothing_graded,
               "seen_by_trainee": seen_by_trainee,
               "grades": list(csv.DictReader((course / "grades.csv").open()))}
    finally:
        remove_accounts()
        shutil.rmtree(base, ignore_errors=True)


def points():
    """{graded cell: its points} of the lesson, and the cells of the exercise bob left."""
    notebook = nbformat.read(lesson_notebook(LESSON), as_version=4)
    cells = {cell.metadata.nbgrader.grade_id: cell.metadata.nbgrader.points
             for cell in notebook.cells if cell.metadata.get("nbgrader", {}).get("grade")}
    return cells, exercises(notebook)[UNSOLVED]


def test_grades_are_full_for_the_solved_work_and_lose_exactly_the_unsolved_exercise(class_run):
    cells, unsolved = points()
    total = sum(cells.values())
    rows = {row["student_id"]: row for row in class_run["grades"]}
    assert float(rows[SOLVED]["raw_score"]) == total
    assert float(rows[ONE_UNSOLVED]["raw_score"]) == total - sum(cells[c] for c in unsolved)
    assert float(rows[ABSENT]["raw_score"]) == 0  # nbgrader's export lists the roster
    assert stat.S_IMODE((class_run["course"] / "grades.csv").stat().st_mode) == 0o600


def test_the_summary_says_who_was_late_missing_or_not_graded_and_what_to_teach_again(class_run):
    lines = {line.split()[0]: line for line in class_run["summary"].splitlines()[3:]}
    assert "on time" in lines[SOLVED] and "late by" in lines[ONE_UNSOLVED]
    assert "missing" in lines[ABSENT] and "not graded" in lines[CELL_RENAMED]
    _, unsolved = points()
    [teach_again] = [line for line in class_run["summary"].splitlines()
                     if line.startswith("teach again first: ")]
    assert teach_again == "teach again first: " + ", ".join(f"{cell} (50%)" for cell in unsolved)
    plot = class_run["course"] / "grades-00.png"
    assert plot.read_bytes().startswith(b"\x89PNG") and plot.stat().st_size > 5000


def test_a_submission_under_another_trainees_name_is_refused_and_theirs_collected(class_run):
    """bob hands in, later than alice, a folder named as hers: collect collects everyone's own
    latest submission, alice's included, and fails naming bob's forgery."""
    collected = class_run["collected"]
    assert collected.returncode != 0
    assert f"{class_run['forged']} (owned by {ONE_UNSOLVED})" in collected.stdout + collected.stderr
    submitted = class_run["course"] / "submitted"
    assert {path.name for path in submitted.iterdir()} == {SOLVED, ONE_UNSOLVED, CELL_RENAMED}
    own = nbformat.read(class_run["work"] / f"{SOLVED}.ipynb", as_version=4)
    got = nbformat.read(submitted / SOLVED / LESSON / f"{LESSON}.ipynb", as_version=4)
    assert [cell.source for cell in got.cells] == [cell.source for cell in own.cells]


def test_a_renamed_graded_cell_is_named_in_one_line_and_the_others_are_graded(class_run):
    autograded = class_run["autograded"]
    assert autograded.returncode == 1
    errors = autograded.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(
        f"error: {CELL_RENAMED}'s {LESSON} was not graded: "), autograded.stderr
    graded = class_run["course"] / "autograded"
    assert {path.parent.name for path in graded.glob(f"*/{LESSON}")} == {SOLVED, ONE_UNSOLVED}


def test_a_deleted_test_cell_is_put_back_before_grading_and_named(class_run):
    """bob's answer to the exercise whose test cell he deleted is graded (his total lost only the
    unsolved exercise: test_grades_are_full_...), by the test cell autograde put back."""
    report = class_run["autograded"].stdout
    assert (f"{ONE_UNSOLVED}'s {LESSON} lacked test cells, put back from the release before "
            f"grading: {deleted_test()}\n") in report, report
    graded = nbformat.read(class_run["course"] / "autograded" / ONE_UNSOLVED / LESSON /
                           f"{LESSON}.ipynb", as_version=4)
    assert deleted_test() in [grading.grade_id(cell) for cell in graded.cells]


def test_the_item_analysis_of_a_class_with_no_graded_work_is_refused_in_one_line(class_run):
    refused = class_run["nothing_graded"]
    assert refused.returncode != 0 and refused.stderr.splitlines() == [
        f"error: {LESSON} has no graded submission in {class_run['course']}: run `python -m "
        f"coursekit autograde {LESSON}` once trainees have handed it in"], refused.stderr


def expected_error(trainee, cell_id, course):
    """The error a graded cell of ``trainee``'s autograded notebook ended with, as one line."""
    graded = nbformat.read(course / "autograded" / trainee / LESSON / f"{LESSON}.ipynb",
                           as_version=4)
    [cell] = [cell for cell in graded.cells
              if cell.metadata.get("nbgrader", {}).get("grade_id") == cell_id]
    [error] = [output for output in cell.outputs if output.output_type == "error"]
    return (f"{error.ename}: {error.evalue}" if error.evalue else error.ename).splitlines()[0]


def test_the_item_analysis_gives_each_cells_mean_zeros_discrimination_and_error(class_run):
    """Over alice's and bob's graded work: bob's unsolved cells at 50% with half the class at
    zero, the error his notebook shows; every other cell at 100%."""
    cells, unsolved = points()
    lines = class_run["summary"].splitlines()
    start = lines.index(f"{LESSON}: each graded cell over 2 graded submissions, lowest mean first")
    rows = {line.split()[0]: line for line in lines[start + 2:]}
    assert set(rows) == {cell for cell, points in cells.items() if points}
    totals = {SOLVED: sum(cells.values()), ONE_UNSOLVED: sum(cells.values()) -
              sum(cells[cell] for cell in unsolved)}
    for cell, maximum in cells.items():
        if not maximum:
            continue
        scores = {SOLVED: maximum, ONE_UNSOLVED: 0 if cell in unsolved else maximum}
        rest = [totals[trainee] - scores[trainee] for trainee in (SOLVED, ONE_UNSOLVED)]
        flat = len(set(scores.values())) == 1 or len(set(rest)) == 1
        discrimination = "-" if flat else f"{pearson(list(scores.values()), rest):+.2f}"
        error = (f"{expected_error(ONE_UNSOLVED, cell, class_run['course'])} (1)"
                 if cell in unsolved else "-")
        mean = "50%" if cell in unsolved else "100%"
        zeros = "50%" if cell in unsolved else "0%"
        assert rows[cell].split()[1:5] == [f"{maximum:g}", mean, zeros, discrimination], rows[cell]
        assert rows[cell].endswith(f"  {error}"), rows[cell]
    # the cells the class found hard come first
    assert [line.split()[0] for line in lines[start + 2:start + 2 + len(unsolved)]] == unsolved


def test_each_trainee_gets_their_own_feedback_and_cannot_reach_anothers_work(class_run):
    base, exchange = class_run["base"], class_run["exchange"]
    for user in (SOLVED, ONE_UNSOLVED):
        feedback = list((class_run["kits"][user] / LESSON / "feedback").rglob("*.html"))
        assert len(feedback) == 1, feedback
        others = (SOLVED, ONE_UNSOLVED)[user == SOLVED]
        # the other trainee's submission: not in the exchange's inbound (which no trainee may
        # list), nor in their home, nor in the instructor's course folder
        for folder in (exchange / COURSE_ID / "inbound", base / "home" / others,
                       class_run["course"], exchange / COURSE_ID / "feedback"):
            listing = as_user(user, "ls", str(folder), cwd=base, check=False)
            assert listing.returncode != 0 and "Permission denied" in listing.stderr, folder


def test_no_file_a_trainee_can_read_holds_a_hidden_test(class_run):
    assert len(hidden_test_lines()) > 5
    for user, seen in class_run["seen_by_trainee"].items():
        assert seen["readable"] > 3, seen  # their kit, their fetched lesson and its feedback
        assert seen["found"] == [], (user, seen["found"][:3])


def test_the_exchange_is_closed_to_users_outside_the_course(class_run):
    gate = class_run["exchange"].parent
    assert stat.S_IMODE(gate.stat().st_mode) == 0o2750
    assert stat.S_IMODE(class_run["exchange"].stat().st_mode) == 0o1777
    listing = as_user("nobody", "ls", str(class_run["exchange"]), cwd="/", check=False)
    assert listing.returncode != 0 and "Permission denied" in listing.stderr


# --- the formgrader, in a real browser -----------------------------------------------------------

COMMENT = "Well done: now try it with the times of a job on 8 GPUs."


@pytest.fixture(scope="module")
def browser():
    yield from chromium.headless()


@pytest.fixture(scope="module")
def formgrader(class_run):
    """JupyterLab as the instructor, in their course folder, on 127.0.0.1 behind a token (as
    `make lab` starts it): its URL and token."""
    token = secrets.token_hex(16)
    with user_command(INSTRUCTOR, "jupyter", "lab", "--no-browser", "--ip", "127.0.0.1",
                      f"--IdentityProvider.token={token}",
                      "--LabApp.expose_app_in_browser=True") as command:
        server, url = start_lab(command, token, class_run["course"].parent / "formgrader.log",
                                cwd=class_run["course"])
        try:
            yield url, token
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)


@pytest.mark.browser  # Chromium drives the formgrader in JupyterLab
def test_the_formgrader_shows_the_scores_and_a_comment_reaches_the_feedback(browser, formgrader,
                                                                             class_run):
    """The instructor's review, from JupyterLab: the formgrader lists the two graded submissions
    with their scores; a comment typed on alice's first answer is saved, and the feedback
    generated afterwards shows it to her."""
    url, token = formgrader
    cells, unsolved = points()
    total = sum(cells.values())
    browser.get(f"{url}/lab?token={token}")  # JupyterLab logs the browser in (a cookie)
    wait_for(browser, lambda d: d.execute_script("return !!window.jupyterapp"), 120,
             "JupyterLab did not start in the browser")
    browser.get(f"{url}/formgrader/gradebook/{LESSON}/{LESSON}")

    def submissions(driver):  # {trainee: (score shown, link)} once both rows are there
        rows = driver.find_elements(By.CSS_SELECTOR, "tbody tr")
        found = {row.find_element(By.CSS_SELECTOR, "a.name-shown").get_attribute("textContent"):
                 (row.find_element(By.CSS_SELECTOR, ".score").text,
                  row.find_element(By.CSS_SELECTOR, "a.name-shown").get_attribute("href"))
                 for row in rows if row.find_elements(By.CSS_SELECTOR, "a.name-shown")}
        return found if len(found) >= 2 else None

    found = wait_for(browser, submissions, 60, "the formgrader did not list the submissions")
    assert {name: score for name, (score, _) in found.items()} == {
        SOLVED: f"{total} / {total}",
        ONE_UNSOLVED: f"{total - sum(cells[c] for c in unsolved)} / {total}"}
    browser.get(found[SOLVED][1])
    box = wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "textarea.comment"), 60,
                   "alice's submission showed no comment box")[0]
    # the box saves once the page has bound it to its comment (nbgrader's formgrade.js): what is
    # typed there before is lost
    wait_for(browser, lambda d: d.execute_script(
        "return typeof formgrader !== 'undefined' && !!formgrader.comments"
        " && formgrader.comments.loaded"), 60, "alice's comments did not load")
    box.click()
    box.send_keys(COMMENT)
    box.send_keys(Keys.TAB)  # leaving the box saves it
    submission_id = found[SOLVED][1].rstrip("/").rsplit("/", 1)[-1]
    saved = f"""fetch("{url}/formgrader/api/comments?submission_id={submission_id}")
                .then(r => r.json()).then(arguments[0])"""
    wait_for(browser, lambda d: any(c["manual_comment"] == COMMENT
                                    for c in d.execute_async_script(saved)),
             30, "the comment was not saved")
    screenshot(browser.find_element(By.TAG_NAME, "body"), "formgrader-comment")
    nbgrader(INSTRUCTOR, "generate_feedback", LESSON, "--force", cwd=class_run["course"])
    feedback = class_run["course"] / "feedback" / SOLVED / LESSON / f"{LESSON}.html"
    assert COMMENT in html.unescape(re.sub(r"<[^>]*>", "", feedback.read_text()))
