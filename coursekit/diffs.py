"""The diffs between consecutive stage scripts, and a trainee's working copy checked against them.

    diffs/<from>-<to>.patch                 unified diff of solutions/train_gpt2_<from>.py -> <to>.py
    notebooks/<lesson>/train_gpt2.py        the trainee's working copy, started from the <from> stage
                                            (train_gpt2_<to>.py for a lesson's second and third)

`build` writes the patches from `solutions/`; `check` fails if a committed patch is stale or does
not turn its source into its target byte for byte; `status` tells, hunk by hunk, whether a
working copy has the change (applied), still has the old lines (not yet applied), or has neither
(conflicting, with the lines that differ). No git repository or branch is needed.
"""
import difflib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from coursekit import KIT_ROOT, KitError
from coursekit.stages import script_path


@dataclass(frozen=True)
class Step:
    """One rung of the stage ladder: the lesson whose diff turns stage `source` into `target`."""
    source: str
    target: str
    lesson: str

    @property
    def name(self):
        return f"{self.source}-{self.target}"


#: Lightning is not on it: it replaces the loop, and lesson 03 compares the two side by side
LADDER = [Step("std", "ddp", "02-ddp"), Step("ddp", "fsdp", "04-model-parallelism"),
          Step("fsdp", "tp", "04-model-parallelism"), Step("fsdp", "pp", "04-model-parallelism")]
CONTEXT_LINES = 3
HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
DEFINITION = re.compile(r"^\s*(def|class) ")


def patch_path(step, root=KIT_ROOT):
    return Path(root) / "diffs" / f"{step.name}.patch"


#: A lesson's working copy of a stage script: the trainee's own, kept next to the notebook.
WORKING_COPY = "train_gpt2.py"


def working_copy_name(step):
    """train_gpt2.py for a lesson's first diff, train_gpt2_<target>.py for its others."""
    return WORKING_COPY if step_for_lesson(step.lesson) == step else f"train_gpt2_{step.target}.py"


def working_copy_path(step, root=KIT_ROOT):
    return Path(root) / "notebooks" / step.lesson / working_copy_name(step)


def lesson_steps(lesson):
    """The diffs a lesson teaches, in the ladder's order."""
    return [step for step in LADDER if step.lesson == lesson]


def step_for_lesson(lesson, stage=None):
    """The lesson's diff that leads to ``stage``; without one, the lesson's first diff."""
    steps = lesson_steps(lesson)
    if not steps:
        raise KitError(f"no diff belongs to lesson {lesson!r}; lessons with a diff: "
                       f"{', '.join(dict.fromkeys(s.lesson for s in LADDER))}")
    for step in steps:
        if stage in (None, step.target):
            return step
    raise KitError(f"--stage {stage}: lesson {lesson}'s diffs lead to "
                   f"{', '.join(s.target for s in steps)}")


#: Every working copy's file name (what a lesson's folder may hold of a trainee's scripts)
WORKING_COPIES = tuple(dict.fromkeys(working_copy_name(step) for step in LADDER))


# --- making and reading patches ------------------------------------------------------------------
def make_patch(source_text, target_text, source_name, target_name):
    """A unified diff (git style: a/ b/ names, the enclosing definition after @@) of two texts that
    end in newlines. Unlike difflib.unified_diff, frequent lines (blank ones) are not junk, so the
    diff is as small as it can be."""
    source, target = source_text.splitlines(keepends=True), target_text.splitlines(keepends=True)
    matcher = difflib.SequenceMatcher(None, source, target, autojunk=False)
    lines = [f"--- a/{source_name}\n", f"+++ b/{target_name}\n"]
    for group in matcher.get_grouped_opcodes(CONTEXT_LINES):
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        first_change = next(i for tag, i, _, _, _ in group if tag != "equal")
        lines.append(f"@@ -{span(i1, i2)} +{span(j1, j2)} @@"
                     f"{definition_above(source, first_change + 1)}\n")
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                lines += [" " + line for line in source[a1:a2]]
                continue
            lines += ["-" + line for line in source[a1:a2]]
            lines += ["+" + line for line in target[b1:b2]]
    return "".join(lines)


def span(start, end):
    """Unified-diff range: 1-based first line and count (for an empty range, the line before)."""
    length = end - start
    return f"{start + 1 if length else start},{length}"


def definition_above(lines, line_number):
    """' def name(...):' of the nearest def or class above a 1-based line number, or ''."""
    for line in reversed(lines[:line_number - 1]):
        if DEFINITION.match(line):
            return " " + line.strip()
    return ""


@dataclass
class Hunk:
    number: int
    header: str
    old: list  # the lines the hunk expects (context and removed), without newlines
    new: list  # the lines it leaves (context and added)
    old_start: int
    text: str  # the hunk as the patch shows it, header included


def parse_patch(text):
    """The hunks of a one-file unified diff."""
    hunks = []
    for line in text.splitlines():
        match = HUNK_HEADER.match(line)
        if match:
            hunks.append(Hunk(len(hunks) + 1, line, [], [], int(match.group(1)), line))
        elif hunks and line[:1] in (" ", "-", "+") and not line.startswith(("---", "+++")):
            hunks[-1].text += "\n" + line
            if line[0] in " -":
                hunks[-1].old.append(line[1:])
            if line[0] in " +":
                hunks[-1].new.append(line[1:])
    if not hunks:
        raise KitError("the patch holds no hunks")
    return hunks


def apply_patch(hunks, source_text):
    """Apply the hunks exactly where they say; fail if the source lines there differ."""
    source = source_text.split("\n")
    result, position = [], 0
    for hunk in hunks:
        start = hunk.old_start - 1 if hunk.old else hunk.old_start
        if source[start:start + len(hunk.old)] != hunk.old:
            raise KitError(f"hunk {hunk.number} ({hunk.header}) does not match its source")
        result += source[position:start] + hunk.new
        position = start + len(hunk.old)
    return "\n".join(result + source[position:])


def counts(patch_text):
    """(added, removed) lines of a patch."""
    lines = patch_text.splitlines()
    added = sum(1 for line in lines if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in lines if line.startswith("-") and not line.startswith("---"))
    return added, removed


# --- build and check -----------------------------------------------------------------------------
def expected_patch(step, root=KIT_ROOT):
    texts = []
    for stage in (step.source, step.target):
        path = script_path(stage, root)
        if not path.exists():
            raise KitError(f"{path} is missing: the {step.name} diff is made from it")
        texts.append(path.read_text())
    return make_patch(*texts, f"solutions/train_gpt2_{step.source}.py",
                      f"solutions/train_gpt2_{step.target}.py")


def build(root=KIT_ROOT):
    """Write every patch of the ladder; return {name: (added, removed)}."""
    sizes = {}
    for step in LADDER:
        text = expected_patch(step, root)
        path = patch_path(step, root)
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        sizes[step.name] = counts(text)
    return sizes


def check(root=KIT_ROOT):
    """Problems with the committed patches, one line each (an empty list when all is well)."""
    problems = []
    for step in LADDER:
        path = patch_path(step, root)
        if not path.exists():
            problems.append(f"{path} is missing: run `python -m coursekit diffs build`")
            continue
        committed = path.read_text()
        if committed != expected_patch(step, root):
            problems.append(f"{path} differs from the diff of its stage scripts: run "
                            "`python -m coursekit diffs build` and commit the result")
        try:
            patched = apply_patch(parse_patch(committed), script_path(step.source, root).read_text())
        except KitError as err:
            problems.append(f"{path}: {err}")
            continue
        if patched != script_path(step.target, root).read_text():
            problems.append(f"{path} applied to train_gpt2_{step.source}.py does not give "
                            f"train_gpt2_{step.target}.py byte for byte")
    return problems


# --- a trainee's working copy --------------------------------------------------------------------
def start_working_copy(lesson, path=None, root=KIT_ROOT, stage=None):
    """Copy the lesson's source stage to its working copy (by default
    notebooks/<lesson>/train_gpt2.py), unless the trainee already has one."""
    step = step_for_lesson(lesson, stage)
    path = Path(path) if path else working_copy_path(step, root)
    if not path.exists():
        shutil.copyfile(script_path(step.source, root), path)
    return path


def find_block(lines, block):
    """Index where `block` occurs as consecutive lines of `lines` (trailing spaces ignored), or -1."""
    block = [line.rstrip() for line in block]
    lines = [line.rstrip() for line in lines]
    for start in range(len(lines) - len(block) + 1):
        if lines[start:start + len(block)] == block:
            return start
    return -1


def hunks(lesson, root=KIT_ROOT, stage=None):
    """The hunks of a lesson's patch, to read one at a time."""
    return parse_patch(patch_path(step_for_lesson(lesson, stage), root).read_text())


@dataclass
class HunkStatus:
    hunk: Hunk
    state: str  # "applied", "not yet applied" or "conflicting"
    differences: list  # for a conflicting hunk: "- found" / "+ expected" lines


def status(lesson, path=None, root=KIT_ROOT, stage=None):
    """Every hunk of the lesson's patch, as found in the working copy."""
    step = step_for_lesson(lesson, stage)
    path = Path(path) if path else working_copy_path(step, root)
    if not path.exists():
        raise KitError(f"{path} does not exist: start it with `python -m coursekit diffs start "
                       f"--lesson {lesson} --stage {step.target}`")
    lines = path.read_text().splitlines()
    target = script_path(step.target, root).read_text().splitlines()
    result = []
    for hunk in hunks(lesson, root, stage):
        if find_block(lines, hunk.new) >= 0:
            result.append(HunkStatus(hunk, "applied", []))
        elif find_block(lines, hunk.old) >= 0:
            result.append(HunkStatus(hunk, "not yet applied", []))
        else:
            result.append(HunkStatus(hunk, "conflicting", differences(lines, target, hunk)))
    return result


def differences(lines, target, hunk):
    """The working copy's lines that differ from the target where this hunk lands."""
    target_start = find_block(target, hunk.new)
    target_end = target_start + len(hunk.new)
    out = []
    matcher = difflib.SequenceMatcher(None, [line.rstrip() for line in lines],
                                      [line.rstrip() for line in target], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal" and j1 <= target_end and j2 >= target_start:
            out += [f"- {line}" for line in lines[i1:i2]] + [f"+ {line}" for line in target[j1:j2]]
    return out


def apply_hunk(lesson, number, path=None, root=KIT_ROOT, stage=None):
    """Apply one not-yet-applied hunk to the working copy (for a trainee who is stuck)."""
    step = step_for_lesson(lesson, stage)
    path = Path(path) if path else working_copy_path(step, root)
    found = {s.hunk.number: s for s in status(lesson, path, root, stage)}
    if number not in found:
        raise KitError(f"--hunk {number}: the {step.name} patch has hunks 1 to {len(found)}")
    hunk_status = found[number]
    if hunk_status.state != "not yet applied":
        raise KitError(f"hunk {number} is {hunk_status.state}: only a hunk whose old lines are "
                       "still there can be applied")
    lines = path.read_text().splitlines()
    start = find_block(lines, hunk_status.hunk.old)
    lines[start:start + len(hunk_status.hunk.old)] = hunk_status.hunk.new
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def report(lesson, statuses):
    """The status as a trainee reads it."""
    out = []
    for s in statuses:
        out.append(f"hunk {s.hunk.number:2d}  {s.state:16s} {s.hunk.header}")
        out += [f"      {line}" for line in s.differences]
    tally = {state: sum(1 for s in statuses if s.state == state)
             for state in ("applied", "not yet applied", "conflicting")}
    out.append(f"{lesson}: {tally['applied']} of {len(statuses)} hunks applied, "
               f"{tally['not yet applied']} not yet applied, {tally['conflicting']} conflicting")
    return "\n".join(out)
