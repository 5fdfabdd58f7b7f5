"""Lesson 10's plumbing: the jobs it runs, with a deadline, and what they leave behind.

Every job is the ddp stage (`solutions/train_gpt2_ddp.py`), possibly with one mistake,
on 2 processes for STEPS steps of the tiny preset on the CPU, with timeouts that turn a
hang into an error within seconds (ENV). The notebook imports what it uses by name.
"""
import difflib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from IPython.display import Markdown, display

from coursekit import KIT_ROOT, launch, runs, stages

RUNS = Path("runs")  # what this lesson writes
DATA = KIT_ROOT / "data" / "builtin"
DDP = stages.script_path("ddp")
STEPS = 4
FLAGS = ["--preset", "tiny", "--data", str(DATA), "--max-steps", str(STEPS),
         "--eval-interval", str(STEPS), "--eval-steps", "1", "--ckpt-interval",
         str(STEPS), "--sample-tokens", "0", "--device", "cpu"]
# One thread a process (as torchrun gives them); collectives that give up after 8 s
# instead of 600, and a watchdog that writes each rank's stacks after 4 s without a step
# instead of 300
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "KIT_DIST_TIMEOUT": "8",
       "KIT_WATCHDOG": "4"}


@dataclass
class Outcome:
    name: str
    # finished, failed (its own exit status), or hung (killed at the deadline)
    status: str
    seconds: float
    output: str     # stdout and stderr, as the job's log would hold them

    def tail(self, lines=4,
             saying=r"error: |step \d|watchdog: |(\[rank\d\]: )?[\w.]*Error: "):
        """The last ``lines`` lines of the log that say what happened: the kit's step
        lines and one-line errors, and the exceptions' own lines (not tracebacks or
        torchrun's banners)."""
        said = [line for line in self.output.splitlines()
                if re.match(saying, line)
                and "ChildFailedError" not in line]  # torchrun's own
        return "\n".join(line[:400] for line in said[-lines:])


def job(name, command, env=None, deadline=60, preexec_fn=None, while_running=None):
    """Run ``command`` as the job ``name`` with a deadline: its Outcome. A job still
    running at the deadline is killed, with every process it started, and counts as
    hung. Once it has started, ``while_running(process)`` may look at it from
    outside."""
    start = time.monotonic()
    process = subprocess.Popen([str(word) for word in command], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env or ENV,
                               start_new_session=True, preexec_fn=preexec_fn)
    if while_running:
        while_running(process)
    try:
        output, _ = process.communicate(timeout=deadline)
        status = "finished" if process.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        status = "hung"
    return Outcome(name, status, time.monotonic() - start, output)


def ddp_job(name, script=DDP, *extra, nproc=2, **kwargs):
    """The (possibly broken) ddp stage on ``nproc`` processes for STEPS steps into
    runs/<name>."""
    out = RUNS / name
    shutil.rmtree(out, ignore_errors=True)
    return job(name, [*launch.torchrun(nproc), script, *FLAGS, "--out", out, *extra],
               **kwargs)


def losses(name):
    return [record["loss"] for record in runs.read_metrics(RUNS / name)]


def trains_like(name, reference, tolerance=1e-4):
    """Whether run ``name`` took the same steps as run ``reference``, loss for loss."""
    ours, theirs = losses(name), losses(reference)
    return len(ours) == len(theirs) > 0 and all(abs(a - b) <= tolerance
                                                for a, b in zip(ours, theirs))


def broken(name, old, new):
    """The ddp stage with one mistake, written to runs/<name>.py: ``old`` replaced by
    ``new``. Shows the mistake as a diff. Returns the script's path."""
    source = DDP.read_text()
    if source.count(old) != 1:
        raise ValueError(f"{name}: the ddp stage no longer has exactly one {old!r}")
    script = RUNS / f"{name}.py"
    script.write_text(source.replace(old, new))
    return script


def show_mistake(script):
    """The diff between the ddp stage and a broken copy of it: what the case changed."""
    lines = difflib.unified_diff(DDP.read_text().splitlines(),
                                 script.read_text().splitlines(),
                                 "train_gpt2_ddp.py", script.name, n=1, lineterm="")
    display(Markdown("```diff\n" + "\n".join(lines) + "\n```"))


def trained_every_step(name, processes=2):
    """Whether run ``name`` took all STEPS steps on ``processes`` processes."""
    return (len(losses(name)) == STEPS and
            runs.read_json(RUNS / name / "config.json")["world_size"] == processes)
