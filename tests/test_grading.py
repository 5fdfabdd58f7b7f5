"""nbgrader: student versions hold no solutions or hidden tests; autograde skips the demo cells
and still grades right: the untouched student version scores zero on every graded cell, and in a
submission that solves every other exercise, the solved ones score full marks while the others,
left unsolved or answered by calling the kit's own function for the same thing, lose exactly
their points."""
import contextlib
import json
import shutil
import socket
import textwrap

import nbformat
import pytest

from conftest import debian_tool, lesson_notebook, ray_turn_for
from coursekit import KIT_ROOT, KitError, diffs, grading, trainee

pytestmark = pytest.mark.grading
LESSONS = grading.lessons(KIT_ROOT)

#: What a test tells the trainee whose answer calls the kit for what the exercise asks
#: (coursekit/exercise.py: own_work)
OWN_CODE = "asks for your own code"
#: Answers that call the kit (or Optuna) for what the exercise asks, write in what it must find,
#: or take the tempting wrong turn (a training step that never empties the gradients, the lowest
#: loss of a whole run where early stopping cannot see it): {lesson: {solution cell: (part of the
#: message its tests fail with, its source)}}. Each is graded in place of that exercise's
#: solution, must score 0 on its tests, and must be told why.
SHORTCUTS = {
    "00-gpus-and-hpc": {
        "most_gpus": (OWN_CODE, """
            from coursekit import scaling

            def most_gpus(t1, tp, p, min_efficiency):
                serial = scaling.karp_flatt(t1, tp, p)
                if serial <= 0:
                    return None
                return max(1, int((1 / min_efficiency - 1 + serial) / serial))"""),
    },
    "00b-deep-learning": {
        "train_step": ("gradients of the step before", """
            def train_step(model, optimizer, loss_fn, microbatches):
                total = 0.0
                for inputs, targets in microbatches:
                    loss = loss_fn(model(inputs), targets) / len(microbatches)
                    loss.backward()
                    total += loss.item()
                optimizer.step()
                return total"""),
        "early_stopping": ("is never seen", """
            def early_stopping(val_losses, patience):
                return min(range(len(val_losses)), key=val_losses.__getitem__)"""),
    },
    "01-single-gpu-gpt": {
        "tokens_per_step": (OWN_CODE, """
            from coursekit import scaling

            def tokens_per_step(micro_batch, grad_accum, seq_len):
                return scaling.tokens_per_step(micro_batch, grad_accum, seq_len)"""),
        "steps_per_epoch": (OWN_CODE, """
            from coursekit import scaling

            def steps_per_epoch(dataset_tokens, micro_batch, grad_accum, seq_len):
                return scaling.steps_per_epoch(dataset_tokens, micro_batch, grad_accum, seq_len)"""),
        "describe_checkpoint": ("count it once", """
            def describe_checkpoint(shapes):  # every tensor counted, the tied head twice
                vocab_size, n_embd = shapes["transformer.wte.weight"]
                n_layer = len({n.split(".")[2] for n in shapes if n.startswith("transformer.h.")})
                return (n_layer, n_embd, vocab_size, shapes["transformer.wpe.weight"][0],
                        sum(math.prod(shape) for shape in shapes.values()))"""),
        "plan_batch": ("paid once", """
            def plan_batch(peak_at_1, peak_at_2, budget, global_tokens, seq_len):
                samples = global_tokens // seq_len  # as if the whole peak came with each sample
                fitting = min(samples, budget // peak_at_1)
                if fitting < 1:
                    return None
                micro_batch = max(b for b in range(1, fitting + 1) if samples % b == 0)
                return micro_batch, samples // micro_batch"""),
    },
    "02-ddp": {  # an all-reduce after every microbatch: trains right, and sends twice as much
        "ddp_step": ("no_sync() skips all but the last", """
            def ddp_step(ddp_model, optimizer, microbatches, loss_fn):
                optimizer.zero_grad(set_to_none=True)
                loss_sum = torch.zeros(())
                for inputs, targets in microbatches:
                    loss = loss_fn(ddp_model(inputs), targets) / len(microbatches)
                    loss.backward()
                    loss_sum += loss.detach()
                optimizer.step()
                dist.all_reduce(loss_sum)
                return loss_sum.item() / dist.get_world_size()"""),
    },
    "04-model-parallelism": {
        "zero_bytes": (OWN_CODE, """
            from types import SimpleNamespace

            def bytes_per_rank(n_params, strategy, world_size):
                level = ["ddp", "zero1", "zero2", "fsdp"].index(strategy)
                return memory.data_parallel_bytes(SimpleNamespace(parameters=n_params), level,
                                                  world_size, "fp32")"""),
        "best_microbatches": ("no bubble to fill", """
            def best_microbatches(stages, batch, overhead, per_sample):  # the bubble alone
                return batch"""),
        "shard_model": ("every block its own unit", """
            def shard_model(model, mesh):  # one unit: trains right, gathers the whole model
                return fully_shard(model, mesh=mesh)"""),
    },
    "06-mlops": {
        "sha256_manifest": (OWN_CODE, """
            def sha256_manifest(directory):
                return runs.data_manifest(directory)["files"]"""),
    },
    "07-hpo": {
        "hyperband_brackets": (OWN_CODE, """
            def hyperband_brackets(min_resource, max_resource, eta):
                pruner = optuna.pruners.HyperbandPruner(min_resource, max_resource, eta)
                pruner._try_initialization(optuna.create_study(pruner=pruner))
                budgets = [max_resource / eta**s for s in range(pruner._n_brackets - 1, -1, -1)]
                return list(zip(pruner._trial_allocation_budgets, budgets))"""),
        # the lowest loss at the batch, where a NaN compares as neither lower nor higher
        "choose_recipe": ("diverged: never chosen", """
            def choose_recipe(recipes, results, batch):
                return min((name for name in recipes if recipes[name][0] == batch),
                           key=lambda name: results[name][1])"""),
    },
    "08-vision": {  # the slowest stage of all, and every core a worker
        "plan_loader": ("fewest workers", """
            def plan_loader(timings, loader_stages, cores):
                return max(timings, key=timings.get), cores - 1"""),
    },
    "09-ray-rag": {  # the model loaded for every batch, not once an actor
        "embedder": ("once an actor is enough", """
            class Embedder:
                def __init__(self, name_or_path, device):
                    self.name_or_path, self.device = name_or_path, device

                def __call__(self, batch):
                    model = rag.embedder(self.name_or_path, device=self.device)
                    return {"index": batch["index"],
                            "vector": rag.embed(model, list(batch["text"]))}"""),
        "token_f1": (OWN_CODE, """
            from coursekit.rag import token_f1 as kit_token_f1

            def token_f1(prediction, reference):
                return kit_token_f1(prediction, reference)"""),
    },
    "10-debugging": {  # a port written into the code, which another job may hold; the first
        # thread's innermost frame, the watchdog's where it wrote the dump
        "fixed_launch": ("another job on the node may hold it", """
            def fixed_launch(out):
                return [node_command(rank, 29500, out) for rank in (0, 1)]"""),
        "blocked_in": ("the innermost frame of the main thread", """
            def blocked_in(stacks):
                last_dump = stacks.split("--- no step ended")[-1]
                return re.findall(r'line \\d+ in (\\S+)', last_dump)[0]"""),
    },
}


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """A copy of the course root with the student versions generated, as `make assignments` does.
    Its lessons hold working copies, as they do once an instructor has run them in place."""
    debian_tool("bwrap", "bubblewrap")  # the grading kernel's sandbox (coursekit/sandbox.py)
    root = tmp_path_factory.mktemp("course")
    shutil.copy(KIT_ROOT / "nbgrader_config.py", root)
    shutil.copytree(KIT_ROOT / "notebooks", root / "notebooks",
                    ignore=shutil.ignore_patterns("runs", ".ipynb_checkpoints", *diffs.WORKING_COPIES))
    for lesson in grading.lessons(root):  # as an instructor who ran the lessons in place
        for step in diffs.lesson_steps(lesson):
            diffs.start_working_copy(lesson, diffs.working_copy_path(step, root), stage=step.target)
    grading.generate(root)
    return root


def test_the_release_has_no_working_copy(course):
    """Each trainee starts their own, even where running the lessons in the course root left
    some there."""
    for name in diffs.WORKING_COPIES:
        assert list((course / "notebooks").glob(f"*/{name}"))
        assert not list((course / "release").glob(f"*/{name}"))


def nbgrader_cells(notebook):
    return [cell for cell in notebook.cells if "nbgrader" in cell.metadata]


def exercises(notebook):
    """{solution cell id: ids of the graded cells after it, up to the next solution cell}."""
    found, current = {}, None
    for cell in nbgrader_cells(notebook):
        if cell.metadata.nbgrader.get("solution"):
            current = found.setdefault(cell.metadata.nbgrader.grade_id, [])
        if cell.metadata.nbgrader.get("grade"):
            current.append(cell.metadata.nbgrader.grade_id)
    return found


def with_shortcut(notebook, grade_id, source):
    """A copy of ``notebook`` whose solution cell ``grade_id`` holds ``source``."""
    copy = nbformat.from_dict(notebook)
    for cell in nbgrader_cells(copy):
        if cell.metadata.nbgrader.grade_id == grade_id:
            cell.source = textwrap.dedent(source).strip()
    return copy


def with_cells_from(notebook, donor, grade_ids):
    """A copy of ``notebook`` whose cells ``grade_ids`` are the ``donor`` notebook's."""
    replacement = {c.metadata.nbgrader.grade_id: c for c in nbgrader_cells(donor)}
    copy = nbformat.from_dict(notebook)
    copy.cells = [replacement[c.metadata.nbgrader.grade_id]
                  if c.metadata.get("nbgrader", {}).get("grade_id") in grade_ids else c
                  for c in copy.cells]
    return copy


def with_graded_cells_tagged_demo(notebook):
    """What a student might try: tag the test cells so that autograde skips them."""
    copy = nbformat.from_dict(notebook)
    for cell in nbgrader_cells(copy):
        if cell.metadata.nbgrader.get("grade"):
            cell.metadata["tags"] = [*cell.metadata.get("tags", []), grading.DEMO_TAG]
    return copy


#: The two submissions that each leave half the exercises unsolved (or answered by a shortcut):
#: every other one, so that each exercise is graded once with its neighbours' solutions missing
#: (a test that leans on the exercise before it loses points it should not) and once without its
#: own. Two submissions instead of one per exercise keep grading within the suite's time budget.
HALVES = {"without-even": 0, "without-odd": 1}


def left_out(exercise_ids, half):
    """The exercises (in notebook order) that the submission ``half`` leaves unsolved."""
    return [exercise for index, exercise in enumerate(exercise_ids) if index % 2 == HALVES[half]]


@pytest.fixture(scope="module")
def graded(course, tmp_path_factory, intrusion_targets):
    """Per lesson, graded once when a test first asks: (exercises, {student: scores}) for the two
    halves (HALVES): the source with every other exercise's solution put back as released or,
    where the kit computes the same thing, replaced by a call to the kit (SHORTCUTS). Between
    them, the halves solve every exercise once and leave every exercise as released once: the
    source itself is not graded again, and the release as a whole ("blank", each exercise as
    released in the same submission) is graded for the first lesson only, with the sanitising
    step's and the sandbox's submissions, which are the same for every lesson."""
    results = {}

    def grade(lesson):
        if lesson not in results:
            folder = tmp_path_factory.mktemp(f"submissions-{lesson}")
            source = nbformat.read(lesson_notebook(lesson), as_version=4)
            release = nbformat.read(course / "release" / lesson / f"{lesson}.ipynb", as_version=4)
            notebooks = {half: without(source, release, SHORTCUTS.get(lesson, {}),
                                       left_out(list(exercises(source)), half)) for half in HALVES}
            if lesson == LESSONS[0]:  # the release, the sanitising step and the sandbox
                notebooks["blank"] = release
                notebooks["blank-tests-tagged-demo"] = with_graded_cells_tagged_demo(release)
                notebooks["intruder"] = with_intrusion(source, lesson, *intrusion_targets)
            submissions = {student: grading.hand_in(folder / student, lesson, notebook)
                           for student, notebook in notebooks.items()}
            try:
                with grader_with_secrets(tmp_path_factory.mktemp("grader-home")), \
                        ray_turn_for(lesson, tmp_path_factory):
                    results[lesson] = exercises(source), grading.autograde(course, lesson,
                                                                           submissions)
            except KitError as failure:  # nbgrader failed: every test of the lesson reports it
                results[lesson] = failure
        if isinstance(results[lesson], KitError):
            raise results[lesson]
        return results[lesson]

    return grade


#: A cell that a trainee adds to a solved notebook: it tries to change the gradebook and the kit,
#: to read another trainee's submission, the lesson's hidden tests and the kit's history, to
#: reach a listener on 127.0.0.1 and to leave a link to a grader's file where autograde writes
#: and sets modes afterwards; it prints how each attempt ended (the sandbox must make every one
#: fail, or, for the link, come to nothing: test_a_submission_reaches_...).
INTRUSION = """
import json
import os
import socket
from pathlib import Path

from coursekit import KIT_ROOT

course = Path.cwd().parents[2]  # graded in course/autograded/<student>/<lesson>/
attempts = {
    "write the gradebook": lambda: open(course / "gradebook.db", "r+b").write(b"0" * 100),
    "list the submissions": lambda: [p.name for p in (course / "submitted").iterdir()],
    "read another's": lambda: (course / "submitted" / "blank" / LESSON / f"{LESSON}.ipynb").read_text(),
    "read the hidden tests": lambda: (KIT_ROOT / "notebooks" / LESSON / f"{LESSON}.ipynb").read_text(),
    "change the kit": lambda: open(KIT_ROOT / "coursekit" / "exercise.py", "a").write("#"),
    "read the grader's .netrc": lambda: (Path.home() / ".netrc").read_text(),
    "find the grader's tokens": lambda: [name for name in os.environ if "TOKEN" in name],
    "read the kit's history": lambda: (KIT_ROOT / ".git" / "HEAD").read_text(),
    "reach a listener": lambda: socket.create_connection(("127.0.0.1", PORT), timeout=5),
    "link to a grader's file": lambda: os.symlink(VICTIM, "notes.txt"),
}
outcomes = {}
for name, attempt in attempts.items():
    try:
        outcomes[name] = f"got {attempt()!r:.40}"
    except OSError:
        outcomes[name] = "refused"
print("INTRUSION", json.dumps(outcomes))
"""


@contextlib.contextmanager
def grader_with_secrets(home):
    """Grading as someone whose home holds a .netrc and whose environment holds a token, as a
    real grader's may (INTRUSION looks for both)."""
    (home / ".netrc").write_text("machine example.org login grader password not-for-trainees\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        patch.setenv("COURSE_API_TOKEN", "not-for-trainees")
        yield


def with_intrusion(notebook, lesson, victim, listener):
    """A copy of ``notebook`` whose first cell is INTRUSION (a cell of the trainee's own)."""
    copy = nbformat.from_dict(notebook)
    names = (f"LESSON = {lesson!r}\nVICTIM = {str(victim)!r}\n"
             f"PORT = {listener.getsockname()[1]}\n")
    copy.cells.insert(0, nbformat.v4.new_code_cell(names + INTRUSION))
    return copy


@pytest.fixture(scope="module")
def intrusion_targets(tmp_path_factory):
    """A grader's file (0600) that INTRUSION links to, and a listener on 127.0.0.1 it tries to
    reach (a connection would succeed whether or not anyone accepts it)."""
    victim = tmp_path_factory.mktemp("grader-files") / "private.txt"
    victim.write_text("the grader's")
    victim.chmod(0o600)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield victim, listener


def without(source, release, shortcuts, exercise_ids):
    """The source with the exercises ``exercise_ids`` undone: a shortcut where ``shortcuts`` has
    one for the exercise, else its cells as released."""
    notebook = with_cells_from(source, release, set(exercise_ids) - set(shortcuts))
    for exercise in set(exercise_ids) & set(shortcuts):
        _, shortcut = shortcuts[exercise]
        notebook = with_shortcut(notebook, exercise, shortcut)
    return notebook


def errors(notebook, grade_ids):
    """The errors that the cells ``grade_ids`` of an autograded notebook ended with."""
    return "\n".join(f"{output.ename}: {output.evalue}" for cell in nbgrader_cells(notebook)
                     if cell.metadata.nbgrader.grade_id in grade_ids
                     for output in cell.get("outputs", []) if output.output_type == "error")


@pytest.mark.parametrize("lesson", LESSONS)
def test_release_holds_no_solutions_or_hidden_tests(course, lesson):
    released = {p.name for p in (course / "release" / lesson).iterdir()}
    assert f"{lesson}.ipynb" in released  # with the lesson's assets, if it has any
    assert f"{lesson}.py" not in released  # the jupytext pair holds the solutions
    released = nbformat.read(course / "release" / lesson / f"{lesson}.ipynb", as_version=4)
    assert "jupytext" not in released.metadata  # paired, it would open with the .py's solutions
    cells = released.cells
    released_lines = {line.strip() for cell in cells for line in cell.source.splitlines()}
    marked, unmarked = trainee.marked_and_unmarked_lines(lesson_notebook(lesson))
    assert marked and "### BEGIN HIDDEN TESTS" not in released_lines
    # a marked line may also appear unmarked (a closing bracket, `pass`): only the others count
    assert sorted((marked - unmarked) & released_lines) == []
    assert "raise NotImplementedError()" in released_lines
    source = nbformat.read(lesson_notebook(lesson), as_version=4)
    notes = [c.source for c in source.cells if grading.INSTRUCTOR_TAG in c.metadata.get("tags", [])]
    assert notes and not any(note in cell.source for note in notes for cell in cells)


@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_marks_its_demonstrations_for_autograde_to_skip(lesson):
    """Each lesson tags the cells no exercise needs; a graded or solution cell is never one."""
    cells = nbformat.read(lesson_notebook(lesson), as_version=4).cells
    demos = [c for c in cells if grading.DEMO_TAG in c.metadata.get("tags", [])]
    assert demos and all(c.cell_type == "code" and "nbgrader" not in c.metadata for c in demos)


def test_untouched_student_version_scores_zero(graded):
    _, scores = graded(LESSONS[0])
    assert len(scores["blank"]) >= 3 and all(score == 0 for score, _ in scores["blank"].values())


@pytest.mark.parametrize("lesson", LESSONS)
def test_solved_exercises_score_full_marks_and_unsolved_or_shortcut_ones_none_and_say_why(
        course, graded, lesson):
    exercise_cells, scores = graded(lesson)
    assert len(exercise_cells) >= 3
    assert set(SHORTCUTS.get(lesson, {})) <= set(exercise_cells)
    graded_cells = {cell for tests in exercise_cells.values() for cell in tests}
    assert all(graded_cells == set(scores[half]) for half in HALVES)  # each cell, an exercise's
    for half in HALVES:
        unsolved = left_out(list(exercise_cells), half)
        their_tests = {cell for exercise in unsolved for cell in exercise_cells[exercise]}
        assert unsolved and all(exercise_cells[exercise] for exercise in unsolved)
        autograded = nbformat.read(course / "autograded" / half / lesson / f"{lesson}.ipynb",
                                   as_version=4)
        got = scores[half]
        expected = {cell: (0 if cell in their_tests else maximum) for cell, (_, maximum) in got.items()}
        wrong = {cell for cell, (score, _) in got.items() if score != expected[cell]}
        assert not wrong, f"{half}: {wrong} scored {[got[cell] for cell in wrong]}, " \
                          f"their errors: {errors(autograded, wrong)!r}"
        for exercise in set(unsolved) & set(SHORTCUTS.get(lesson, {})):
            refusal, _ = SHORTCUTS[lesson][exercise]
            told = errors(autograded, exercise_cells[exercise])
            assert refusal in told, f"{lesson} {exercise}: the trainee is told {told!r}"


def test_grades_and_trainees_work_are_readable_by_the_instructor_alone(course, graded):
    graded(LESSONS[0])
    private = [course / "gradebook.db", *(course / "submitted").rglob("*"),
               *(course / "autograded").rglob("*")]
    assert len(private) > 5 and [p for p in private if p.stat().st_mode & 0o077] == []
    released = course / "release" / LESSONS[0] / f"{LESSONS[0]}.ipynb"
    assert released.stat().st_mode & 0o044 == 0o044  # trainees copy the release


def test_a_submission_reaches_no_gradebook_no_other_work_and_no_grader_file(course, graded,
                                                                             intrusion_targets):
    """Graded in the sandbox, a trainee's own cell could neither write nor read what is not
    theirs, and their solved notebook still got full marks in the gradebook."""
    _, scores = graded(LESSONS[0])
    assert scores["intruder"] and all(score == maximum for score, maximum in
                                      scores["intruder"].values())
    graded_notebook = nbformat.read(course / "autograded" / "intruder" / LESSONS[0] /
                                    f"{LESSONS[0]}.ipynb", as_version=4)
    printed = "".join(output.get("text", "") for output in graded_notebook.cells[0].outputs)
    outcomes = json.loads(printed.split("INTRUSION ", 1)[1])
    assert outcomes == {"write the gradebook": "refused", "list the submissions": "refused",
                        "read another's": "refused", "read the hidden tests": "refused",
                        "change the kit": "refused", "read the grader's .netrc": "refused",
                        "find the grader's tokens": "got []", "read the kit's history": "refused",
                        "reach a listener": "refused", "link to a grader's file": "got None"}, \
        outcomes
    # the link was made in the sandbox's copy of the folder: autograde, which then wrote the
    # graded notebook there and set every file's mode, found no link to follow
    autograded = course / "autograded" / "intruder" / LESSONS[0]
    assert not [path for path in autograded.rglob("*") if path.is_symlink()]
    victim, _ = intrusion_targets
    assert victim.read_text() == "the grader's" and victim.stat().st_mode & 0o777 == 0o600


def test_a_test_cell_tagged_demo_is_still_run(graded):
    """A student who tags the release's test cells `demo` still scores zero."""
    _, scores = graded(LESSONS[0])
    tagged = scores["blank-tests-tagged-demo"]
    assert len(tagged) >= 3 and all(score == 0 for score, _ in tagged.values())


def test_own_work_refuses_the_kit_function_under_any_name_then_restores_it():
    from coursekit import exercise, scaling
    from coursekit.scaling import speedup as kept_reference

    with exercise.own_work(scaling.speedup):
        with pytest.raises(AssertionError, match="your own code"):
            kept_reference(80, 20)
    assert kept_reference(80, 20) == scaling.speedup(80, 20) == 4.0


def test_the_trainee_kit_holds_student_versions_and_no_answer(tmp_path_factory):
    """What trainees clone: every answer line of every lesson is grepped for in every file."""
    out, answer_count = trainee.build(tmp_path_factory.mktemp("trainee") / "kit", KIT_ROOT)
    shipped = [path for path in out.rglob("*") if path.is_file()]
    assert (out / "solutions" / "train_gpt2_ddp.py").exists()  # the lessons run the stages
    assert not (out / "tests").exists()
    # the trainees' nbgrader configuration: the class's exchange, none of the grading settings
    assert (out / "nbgrader_config.py").read_bytes() == trainee.TRAINEE_NBGRADER_CONFIG.read_bytes()
    assert (out / "course.toml").read_bytes() == (KIT_ROOT / "course.toml").read_bytes()
    kit_code = set().union(*(trainee.lines_of(path) for path in shipped
                             if path.suffix != ".ipynb" and "notebooks" not in path.parts))
    answers = trainee.answer_lines(KIT_ROOT, kit_code)
    assert len(answers) == answer_count > 100
    found = {(str(path.relative_to(out)), line) for path in shipped
             for line in trainee.lines_of(path) & answers.keys()}
    assert found == set()
    for lesson in LESSONS:
        folder = out / "notebooks" / lesson
        assert not (folder / f"{lesson}.py").exists()  # the jupytext pair holds the solutions
        assert "raise NotImplementedError()" in trainee.lines_of(folder / f"{lesson}.ipynb")
        text = (folder / f"{lesson}.ipynb").read_text()
        assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
