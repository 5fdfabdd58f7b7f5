"""diffs/*.patch are what `diffs build` makes from solutions/, turn each stage into the next byte for
byte, and `diffs status` reads a trainee's working copy hunk by hunk."""
import shutil
import subprocess
import sys

import pytest

from coursekit import KIT_ROOT, KitError, diffs, stages

pytestmark = pytest.mark.diffs
LESSON = "02-ddp"


@pytest.fixture
def course(tmp_path):
    """A copy of the kit's solutions/ and diffs/ with an empty lesson folder."""
    for folder in ("solutions", "diffs"):
        shutil.copytree(KIT_ROOT / folder, tmp_path / folder)
    (tmp_path / "notebooks" / LESSON).mkdir(parents=True)
    return tmp_path


def states(course, path=None):
    return [s.state for s in diffs.status(LESSON, path, root=course)]


def test_committed_patches_are_current_and_apply_byte_for_byte():
    assert diffs.check() == []


#: The most changed lines each diff may have: a lesson's concept and nothing else
BUDGETS = {"std-ddp": 80, "ddp-fsdp": 100, "fsdp-tp": 80, "fsdp-pp": 150}


@pytest.mark.parametrize("name, budget", BUDGETS.items())
def test_each_diff_of_the_ladder_stays_within_its_budget(name, budget):
    step = next(s for s in diffs.LADDER if s.name == name)
    added, removed = diffs.counts(diffs.patch_path(step).read_text())
    assert added + removed <= budget


def test_the_model_is_defined_once_and_no_stage_copies_it():
    """solutions/gpt.py holds the GPT; the stages import it and apply their parallelism to it."""
    definitions = {path.name: path.read_text().count("class CausalSelfAttention")
                   for path in (KIT_ROOT / "solutions").glob("*.py")}
    assert {name: n for name, n in definitions.items() if n} == {"gpt.py": 1}
    for stage in ("std", "ddp", "fsdp", "tp", "pp", "lit"):
        assert "from solutions.gpt import GPT, GPTConfig" in stages.script_path(stage).read_text()


def test_check_notices_a_stale_patch(course):
    ddp = course / "solutions" / "train_gpt2_ddp.py"
    ddp.write_text(ddp.read_text().replace("DDP averages gradients", "DDP means gradients"))
    problems = [p for p in diffs.check(course) if "std-ddp.patch" in p]
    assert len(problems) == 2  # differs from a fresh diff, and no longer produces the target
    assert "std-ddp.patch differs from the diff of its stage scripts" in problems[0]
    assert "does not give train_gpt2_ddp.py byte for byte" in problems[1]
    diffs.build(course)
    assert diffs.check(course) == []


def test_check_notices_a_hand_edited_patch(course):
    patch = course / "diffs" / "ddp-fsdp.patch"
    patch.write_text(patch.read_text().replace("+import functools", "+import itertools", 1))
    assert len(diffs.check(course)) == 2


def test_a_fresh_copy_has_nothing_applied(course):
    path = diffs.start_working_copy(LESSON, root=course)
    assert path.read_text() == (course / "solutions" / "train_gpt2_std.py").read_text()
    assert set(states(course)) == {"not yet applied"}


def test_starting_again_keeps_the_trainees_work(course):
    path = diffs.start_working_copy(LESSON, root=course)
    path.write_text(path.read_text() + "# my notes\n")
    diffs.start_working_copy(LESSON, root=course)
    assert path.read_text().endswith("# my notes\n")


def test_a_half_done_copy_shows_which_hunks_are_in(course):
    diffs.start_working_copy(LESSON, root=course)
    for number in (1, 3, 5):
        diffs.apply_hunk(LESSON, number, root=course)
    found = states(course)
    assert [i + 1 for i, state in enumerate(found) if state == "applied"] == [1, 3, 5]
    assert found.count("not yet applied") == len(found) - 3


def test_applying_every_hunk_gives_the_next_stage(course):
    path = diffs.start_working_copy(LESSON, root=course)
    for number in reversed(range(1, len(states(course)) + 1)):  # any order works
        diffs.apply_hunk(LESSON, number, root=course)
    assert path.read_text() == (course / "solutions" / "train_gpt2_ddp.py").read_text()
    assert set(states(course)) == {"applied"}


def test_a_finished_copy_with_trailing_spaces_counts_as_applied(course):
    path = diffs.working_copy_path(diffs.step_for_lesson(LESSON), course)
    target = (course / "solutions" / "train_gpt2_ddp.py").read_text()
    path.write_text(target.replace("\n", "  \n"))
    assert set(states(course)) == {"applied"}


def test_a_wrongly_applied_hunk_is_conflicting_with_the_lines_that_differ(course):
    path = diffs.start_working_copy(LESSON, root=course)
    hunks = diffs.status(LESSON, root=course)
    number = next(s.hunk.number for s in hunks
                  if any("distributed.setup(args.device)" in line for line in s.hunk.new))
    diffs.apply_hunk(LESSON, number, root=course)
    right = "    rank, world_size, device = distributed.setup(args.device)"
    wrong = "    rank, world_size, device = distributed.setup()"
    path.write_text(path.read_text().replace(right, wrong))
    result = {s.hunk.number: s for s in diffs.status(LESSON, root=course)}
    assert result[number].state == "conflicting"
    assert result[number].differences == ["- " + wrong, "+ " + right]
    assert [s.state for n, s in result.items() if n != number] == \
           ["not yet applied"] * (len(result) - 1)
    with pytest.raises(KitError, match=f"hunk {number} is conflicting"):
        diffs.apply_hunk(LESSON, number, root=course)


def test_status_from_the_command_line(tmp_path):
    copy = tmp_path / "train_gpt2.py"  # a working copy beside a fetched assignment's notebook
    started = subprocess.run([sys.executable, "-m", "coursekit", "diffs", "start", "--lesson",
                              LESSON, "--file", str(copy)], capture_output=True, text=True)
    assert started.returncode == 0 and copy.read_text() == stages.script_path("std").read_text()
    command = [sys.executable, "-m", "coursekit", "diffs", "status", "--lesson", LESSON,
               "--file", str(copy)]
    fresh = subprocess.run(command, capture_output=True, text=True)
    assert fresh.returncode == 1  # not finished yet
    total = len(diffs.parse_patch(diffs.patch_path(diffs.LADDER[0]).read_text()))
    assert f"02-ddp: 0 of {total} hunks applied, {total} not yet applied, 0 conflicting" in fresh.stdout
    applied = subprocess.run(command[:4] + ["apply", "--lesson", LESSON, "--file", str(copy),
                                            "--hunk", "2"], capture_output=True, text=True)
    assert applied.returncode == 1 and "hunk  2  applied" in applied.stdout
    shutil.copyfile(KIT_ROOT / "solutions" / "train_gpt2_ddp.py", copy)
    assert subprocess.run(command, capture_output=True, text=True).returncode == 0


@pytest.mark.parametrize("args, message", [
    (["status"], "error: diffs status needs --lesson (one of 02-ddp, 04-model-parallelism)"),
    (["status", "--lesson", "09-nothing"], "error: no diff belongs to lesson '09-nothing'"),
    (["apply", "--lesson", "02-ddp"], "error: diffs apply needs --hunk N"),
    (["status", "--lesson", "02-ddp", "--file", "/nonexistent/train_gpt2.py"],
     "error: /nonexistent/train_gpt2.py does not exist"),
])
def test_bad_requests_get_one_line(args, message):
    result = subprocess.run([sys.executable, "-m", "coursekit", "diffs", *args],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1


def test_a_lessons_second_diff_has_its_own_working_copy(course):
    """Lesson 04 has three diffs from two stages: --stage tp starts train_gpt2_tp.py from fsdp."""
    (course / "notebooks" / "04-model-parallelism").mkdir(parents=True)
    lesson = "04-model-parallelism"
    first = diffs.start_working_copy(lesson, root=course)
    tp = diffs.start_working_copy(lesson, root=course, stage="tp")
    assert (first.name, tp.name) == ("train_gpt2.py", "train_gpt2_tp.py")
    assert tp.read_text() == (course / "solutions" / "train_gpt2_fsdp.py").read_text()
    for hunk in diffs.hunks(lesson, course, stage="tp"):
        diffs.apply_hunk(lesson, hunk.number, root=course, stage="tp")
    assert tp.read_text() == (course / "solutions" / "train_gpt2_tp.py").read_text()
    assert {s.state for s in diffs.status(lesson, root=course, stage="tp")} == {"applied"}
    assert {s.state for s in diffs.status(lesson, root=course)} == {"not yet applied"}
    with pytest.raises(KitError, match="--stage lit: lesson 04-model-parallelism's diffs lead to "
                                       "fsdp, tp, pp"):
        diffs.step_for_lesson(lesson, "lit")
