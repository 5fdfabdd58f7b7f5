"""Each process's own record of its steps, and a watchdog that writes the stacks of its threads
when no step ends in time: what a hung or slow job is diagnosed with (lesson 10).

    watch = watchdog.StepWatch(run_dir, rank, model)   # before the training loop
    ...
    watch.step_done(step + 1, t0)                      # once the step's time is measured

RUN_DIR/ranks/<rank>.jsonl, one line per step:
    step_s   the step's time on this rank. The gradient all-reduce makes every rank wait for the
             slowest, so it is about the same on every rank.
    ready_s  the time from the step's start to the end of this rank's last forward pass: its own
             work (data and forward) before it waits for the others in backward, where DDP's
             all-reduce runs. A straggler is the rank whose ready_s stands out.
RUN_DIR/ranks/<rank>.stacks: when no step ends within KIT_WATCHDOG seconds (the first step, which
compiles, within FIRST_STEP_S), the Python stack of every thread of this process, as faulthandler
writes it, and one line on stderr that says so. Each rank writes its own, so a hung job leaves
every rank's stacks: the rank stuck elsewhere than in a collective is the one the others wait for.
KIT_WATCHDOG=0 turns it off.
"""
import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from coursekit import KitError

WATCHDOG_VARIABLE = "KIT_WATCHDOG"
#: Seconds with no step ended before the stacks are written: more than a step and an evaluation
#: take, and less than a collective waits (KIT_DIST_TIMEOUT, 600 s)
DEFAULT_WATCHDOG_S = 300
#: The first step's own allowance, in seconds (or KIT_WATCHDOG's, if longer). It compiles the model
#: (--compile, on by default on GPUs): a minute or two for GPT-2 on a CUDA GPU, many more on ROCm,
#: where Triton builds each kernel for the GPU, or on a single CPU core, and also the first
#: collective's set-up (NCCL's communicators). Stacks written then would say "hung" about a job
#: that is compiling. A first step that truly hangs in a collective still ends at the collective's
#: timeout, with the one line that names it.
FIRST_STEP_S = 1800


def watchdog_seconds():
    """KIT_WATCHDOG seconds (0: no watchdog)."""
    text = os.environ.get(WATCHDOG_VARIABLE, str(DEFAULT_WATCHDOG_S))
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1
    if not seconds >= 0:
        raise KitError(f"{WATCHDOG_VARIABLE}={text!r}: expected a number of seconds >= 0 "
                       "(0: no watchdog)")
    return seconds


class StepWatch:
    """This rank's step records and watchdog (see the module's docstring). ``model`` is the
    module whose forward passes end the rank's own work: the bare model, not its DDP wrapper."""

    def __init__(self, run_dir, rank, model):
        self.folder = Path(run_dir) / "ranks"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rank, self.last_step = rank, None
        self.forward_end = self.last_progress = time.perf_counter()
        model.register_forward_hook(self.forward_ended)
        self.limit = watchdog_seconds()
        if self.limit:
            threading.Thread(target=self.watch, name="kit-watchdog", daemon=True).start()

    # Run as it is, never traced: a compiled model runs its hooks inside its compiled region,
    # where time.perf_counter() would break the graph, and the graph after the break would
    # compile again for every mode the model runs in (training, evaluation).
    @torch.compiler.disable
    def forward_ended(self, module, inputs, output):
        self.forward_end = time.perf_counter()

    def step_done(self, step, started):
        """Record ``step``, which started at ``started`` (time.perf_counter())."""
        now = time.perf_counter()
        record = {"step": step, "step_s": now - started,
                  "ready_s": self.forward_end - started if self.forward_end > started else None}
        with open(self.folder / f"{self.rank}.jsonl", "a") as log:
            log.write(json.dumps(record) + "\n")
        self.last_step, self.last_progress = step, now

    def watch(self):
        """Write the stacks once per stall: when no step has ended for ``limit`` seconds."""
        reported = None
        while True:
            time.sleep(min(1.0, self.limit / 4))
            stalled_since, allowed = self.last_progress, self.allowed_s()
            if stalled_since == reported or time.perf_counter() - stalled_since < allowed:
                continue
            reported = stalled_since
            path = self.folder / f"{self.rank}.stacks"
            after = f"step {self.last_step}" if self.last_step else "the start"
            with open(path, "a") as stacks:
                stacks.write(f"--- no step ended within {allowed:g} s after {after} ---\n")
                stacks.flush()
                faulthandler.dump_traceback(stacks, all_threads=True)
            print(f"watchdog: rank {self.rank} ended no step within {allowed:g} s after "
                  f"{after} ({WATCHDOG_VARIABLE}); the stacks of its threads are in {path}",
                  file=sys.stderr, flush=True)

    def allowed_s(self):
        """Seconds the step under way may take: KIT_WATCHDOG's, or FIRST_STEP_S for this
        process's first step (a resumed run's too: it compiles again)."""
        return self.limit if self.last_step is not None else max(self.limit, FIRST_STEP_S)
