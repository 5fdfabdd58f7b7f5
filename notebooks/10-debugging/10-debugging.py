# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10 · When distributed training breaks: diagnose, fix, and prove it
#
# **Questions.** This lesson answers
# - My job hangs, crashes or trains badly on many GPUs: where do I start?
# - Which evidence tells a hang at the start from one in a collective, or a slow rank from a slow
#   network?
# - How do I prove that a fix works?
#
# **Objectives.** After this lesson you can
# - tell a job that hangs at its start (the rendezvous) from one that hangs in a collective, with
#   timeouts, the launcher's log and each rank's stack;
# - read the error DDP gives for an unused parameter, find the parameter, and fix it rather than
#   pay for `find_unused_parameters`;
# - notice that every rank reads the same data, by comparing with the std stage;
# - read an out-of-memory error, predict what fits with `coursekit.memory`, and fix it without
#   changing the training;
# - trace a loss that becomes NaN to its step and its cause, with the gradient norm and anomaly
#   detection;
# - find a straggler from each rank's step times;
# - read why a Slurm job never starts or dies at once.
#
# **Prerequisites.** Lesson 02 (DDP, torchrun, the process group), lesson 04 (what a rank holds in
# memory), the cluster chapter (batch files, `squeue`, `sacct`).
#
# **Time.** About 85 minutes: reading, the exercises, and waiting for the cells on a laptop's CPU.
# The time is an estimate; the instructor guide says how it is made.
#
# Every job below is the ddp stage (`solutions/train_gpt2_ddp.py`) on 2 processes with one small
# mistake, the kind that reaches a cluster. Each case runs the broken job for real, shows what
# the job shows you (the symptom), then what a tool shows (the diagnosis), the fix, and a
# check that the fixed job finishes and trains as the reference does. The cells give every job a
# deadline, so that a hang here costs seconds: on a cluster it costs the job's whole time limit.
# [The first-aid page](../../book/first-aid.md) lists every symptom with its first command.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# Say here: the first-aid page as the place to start.
# :::

# %%
import psutil
import torch

from coursekit import KIT_ROOT, launch, memory, presets, runs, stages

# %% [markdown]
# The set-up: the standard library's modules the lesson uses; the lesson's jobs and their
# settings, from `debug_jobs.py` beside this notebook (the plumbing that runs each job with
# a deadline); a fresh folder for what the lesson writes; and the tiny model's sizes
# (lesson 04).

# %%
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

# each job: the ddp stage, STEPS steps of FLAGS, with the timeouts of ENV
from debug_jobs import (DATA, DDP, ENV, FLAGS, RUNS, STEPS, Outcome, broken, ddp_job,
                        job, losses, show_mistake, trained_every_step, trains_like)

shutil.rmtree(RUNS, ignore_errors=True)
RUNS.mkdir()
# the model's sizes (lesson 04)
TINY = memory.Model.from_preset(presets.get_preset("tiny"))

# %% tags=["demo"]
reference = ddp_job("reference")
print(f"reference: {reference.status} in {reference.seconds:.0f} s; "
      f"losses {losses('reference')}")
# the fixed job of every case that removes its mistake
assert reference.status == "finished"

# %% [markdown]
# ## 1. A job that hangs before its first step: the rendezvous
#
# On two nodes, `srun` starts one `torchrun` per node, and each must find the first node's
# **rendezvous** at `--master-addr:--master-port`: the first node listens there, the others
# connect, and only when all have arrived does training start. A batch file that lets each node
# choose its own port (here `launch.free_port()`, run once per node instead of once for the job)
# sends the second node to a port where nobody listens. Two `torchrun`s on this machine, as node 0
# and node 1, show it; `--rdzv-conf timeout=15` makes them give up after 15 s instead of
# torchrun's default of 15 minutes, and `LOGLEVEL=INFO` makes them say what they wait for.

# %%
def node_command(node_rank, master_port, out):
    """torchrun on node ``node_rank`` of 2, one process each, meeting at
    127.0.0.1:master_port."""
    return [*launch.torchrun(1, nodes=2, master_port=master_port), "--node-rank",
            node_rank, "--rdzv-conf", "timeout=15", DDP, *FLAGS, "--out", out]


def run_nodes(commands, deadline=120):
    """Start the nodes' commands together; their Outcomes once all have ended. The
    deadline is far above the 7-14 s two nodes take here, busy or not, and the
    rendezvous's 15 s: only a hang reaches it."""
    env = {**ENV, "LOGLEVEL": "INFO"}
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(subprocess.Popen(
            [str(word) for word in command], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True))
            for command in commands]
        begin, outcomes = time.monotonic(), []
        for rank, process in enumerate(started):
            try:
                left = max(1, deadline - (time.monotonic() - begin))
                output, _ = process.communicate(timeout=left)
                status = "finished" if process.returncode == 0 else "failed"
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                output, status = process.communicate()[0], "hung"
            outcomes.append(Outcome(f"node {rank}", status, time.monotonic() - begin,
                                    output))
    return outcomes


def broken_launch(out):
    """Each node picks a port of its own: the mistake."""
    return [node_command(rank, launch.free_port(), out) for rank in (0, 1)]


# %% tags=["demo"]
nodes = run_nodes(broken_launch(RUNS / "rendezvous-broken"))
for node in nodes:
    print(f"--- {node.name}: {node.status} after {node.seconds:.0f} s\n{node.tail(1)}")
assert ([node.status for node in nodes] == ["failed", "failed"]
        and "1/2 clients" in nodes[0].output)

# %% [markdown]
# **Symptom.** Nothing: no step line, no error, until the rendezvous times out (with torchrun's
# default, after 15 minutes; with none at all, at the job's time limit).
#
# **Diagnosis.** Each node's own log. Node 0 waited for a second client that never came
# (`1/2 clients joined`); node 1 could not connect to the address it was given. The two addresses
# differ: `(127.0.0.1, <port>)` in node 1's line is not the port node 0 listens on. On a cluster
# the same two lines read "node 0 waits" and "node 1 cannot reach `MASTER_ADDR`": a wrong address,
# a port that differs, or a firewall between the nodes.
#
# **Exercise 1: the launch.** Write `fixed_launch(out)`: the two nodes' commands, built with
# `node_command`, that meet. The check runs them: both must finish, having trained every step on
# 2 processes. The port is one free when the job starts: the check calls `fixed_launch` again
# while another process holds the first one, as another user's job might.

# %% nbgrader={"grade": false, "grade_id": "fixed_launch", "locked": false, "schema_version": 3, "solution": true, "task": false}
def fixed_launch(out):
    """Both nodes' torchrun commands (node_command), meeting at one rendezvous."""
    ### BEGIN SOLUTION
    # chosen once, for the job, as a batch file exports MASTER_PORT
    port = launch.free_port()
    return [node_command(rank, port, out) for rank in (0, 1)]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "fixed_launch_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
commands = fixed_launch(RUNS / "rendezvous-fixed")
assert len(commands) == 2
### BEGIN HIDDEN TESTS
import socket  # noqa: E402  a port written into the code: another job may hold it


def master_ports(commands):
    return {str(word) for command in commands for word in command
            if str(word).startswith("--master-port=")}


ports = master_ports(commands)
assert len(ports) == 1, ports  # one rendezvous for both nodes
with socket.socket() as taken:
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        taken.bind(("", int(next(iter(ports)).split("=")[1])))
        taken.listen()
    except OSError:  # another process holds it already: taken all the same
        pass
    assert master_ports(fixed_launch(RUNS / "rendezvous-fixed")).isdisjoint(ports), (
        "a port written into the code: another job on the node may hold it")
nodes = run_nodes(commands)
assert [node.status for node in nodes] == ["finished", "finished"], [
    (node.name, node.status, f"{node.seconds:.0f} s", node.tail(3)) for node in nodes]
assert trained_every_step("rendezvous-fixed")
### END HIDDEN TESTS

# %% [markdown]
# ## 2. A job that hangs in a collective: one rank takes another branch
#
# A collective (an all-reduce, a broadcast, a barrier) returns only when *every* rank has called
# it, in the same order. Code that only some ranks run must not contain one. Here rank 0 writes
# the metrics line and then waits in a barrier "until the line is on disk"; the other rank never
# calls that barrier.

# %% tags=["demo"]
script = broken("barrier-on-rank-0",
                "            runs.append_metrics(run_dir, record)\n",
                "            runs.append_metrics(run_dir, record)\n"
                "            torch.distributed.barrier()"
                "  # until rank 0's line is on disk\n")
# installed with the kit's requirements
PY_SPY = Path(sys.executable).with_name("py-spy")
spied = {}


def py_spy_every_rank(launcher):
    """Once the ranks have gone 4 s without a step (the watchdog has written rank 0's
    stacks), `py-spy dump` each rank's process: its Python stack, read from outside, as
    on a node."""
    hung_sign = RUNS / "barrier-on-rank-0" / "ranks" / "0.stacks"
    deadline = time.monotonic() + 30
    while not hung_sign.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    for process in psutil.Process(launcher.pid).children(recursive=True):
        if script.name in " ".join(process.cmdline()):
            dump = subprocess.run([PY_SPY, "dump", "--pid", str(process.pid)],
                                  capture_output=True, text=True)
            frames = [line.strip() for line in dump.stdout.splitlines()
                      if script.name in line and not line.startswith("Process")]
            spied[process.environ()["RANK"]] = frames or [dump.stderr.strip()[:300]]


hung = ddp_job("barrier-on-rank-0", script, while_running=py_spy_every_rank)
print(f"{hung.status} after {hung.seconds:.0f} s\n{hung.tail(4)}")
for rank, frames in sorted(spied.items()):
    print(f"py-spy dump, rank {rank}:", *frames, sep="\n  ")
assert hung.status == "failed" and "barrier at barrier-on-rank-0.py" in hung.output

# %% [markdown]
# **Symptom.** One step line, then nothing; with the kit, each rank's collective gives up after
# `KIT_DIST_TIMEOUT` seconds and names itself. Without a timeout (NCCL's default is 10 minutes,
# some codes set hours) the job sits at 100% of its GPUs until the time limit.
#
# **Diagnosis.** Where is each rank? `py-spy dump --pid PID` prints a running Python process's
# stack from outside it (with `--native`, the C++ frames too): above, once the job had hung, for
# each rank's process (on a node: `pgrep -f train_gpt2`). Inside the job, each rank's watchdog
# wrote the stacks of its threads to `ranks/<rank>.stacks` before the timeout (here after
# `KIT_WATCHDOG`=4 s with no step). The main thread's frames in the script:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *A hang is a deadlock in my code.* More often it is a rank that is somewhere else:
#   at the rendezvous, in another collective, or still loading data. The ranks' stacks
#   say which.
# - Say here: your site's time limits, and what a hang without a timeout costs in
#   GPU-hours.
# :::

# %% tags=["demo"]
def script_frames(stacks, script_name):
    """The frames of the main thread that are in the training script (the last dump)."""
    last = stacks.split("--- no step ended")[-1]
    # faulthandler lists the current thread first, then the others
    main = last.split("\n\n")[-1]
    return [line.strip() for line in main.splitlines() if script_name in line]


for rank in (0, 1):
    stacks = (RUNS / "barrier-on-rank-0" / "ranks" / f"{rank}.stacks").read_text()
    print(f"rank {rank}:", *script_frames(stacks, script.name), sep="\n  ")

# %% [markdown]
# **Exercise 2: where each rank waits.** Write `waiting_at(frames)`: the line of code a rank is
# running, from its frames as `script_frames` gives them (the most recent call first). Take the
# file and the line number that the first frame names, and return that line of the file, without
# the blanks around it. A stack names places; the code at them says what each rank is doing.
# The check runs it on a small script that dumps its own stack; the cell after it, on the two
# ranks of the hung job.

# %% nbgrader={"grade": false, "grade_id": "waiting_at", "locked": false, "schema_version": 3, "solution": true, "task": false}
def waiting_at(frames):
    ### BEGIN SOLUTION
    found = re.match(r'File "(.+)", line (\d+)', frames[0])
    return Path(found[1]).read_text().splitlines()[int(found[2]) - 1].strip()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "waiting_at_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# a stand-in for a rank: a script that dumps its own stack where it waits
STAND_IN = RUNS / "stand_in.py"
STAND_IN.write_text("import faulthandler\nimport sys\n\n\ndef all_reduce():\n"
                    "    faulthandler.dump_traceback(sys.stdout)  # waits here\n\n\n"
                    "def step():\n    all_reduce()\n\n\nstep()\n")
dump = subprocess.run([sys.executable, STAND_IN], capture_output=True, text=True).stdout
stand_in_frames = [line.strip() for line in dump.splitlines() if STAND_IN.name in line]
waits_here = "faulthandler.dump_traceback(sys.stdout)  # waits here"
assert waiting_at(stand_in_frames) == waits_here
### BEGIN HIDDEN TESTS
assert waiting_at(stand_in_frames[1:]) == "all_reduce()"
gpt = KIT_ROOT / "solutions" / "gpt.py"
lines = gpt.read_text().splitlines()
number = next(i for i, line in enumerate(lines, 1) if line.startswith("    def "))
frames = [f'File "{gpt}", line {number} in f', f'File "{gpt}", line 1 in <module>']
assert waiting_at(frames) == lines[number - 1].strip()
### END HIDDEN TESTS

# %% tags=["demo"]
waits = {rank: waiting_at(script_frames((RUNS / "barrier-on-rank-0" / "ranks" /
                                         f"{rank}.stacks").read_text(), script.name))
         for rank in (0, 1)}
for rank, line in waits.items():
    print(f"rank {rank} waits at: {line}")
assert waits[0].startswith("torch.distributed.barrier()") and "barrier" not in waits[1]

# %% [markdown]
# A line of your code says where a rank is; the function it is blocked in says which collective
# holds it. That is the innermost frame of the rank's main thread: PyTorch's own function, below
# your line. A stacks file holds every thread of the rank, the thread that wrote the dump first,
# and one dump each time the watchdog fired; the last one is the rank's state when it stopped.
#
# **Exercise 3: which collective.** Write `blocked_in(stacks)`: from the text of a rank's stacks
# file, the name of the function that its main thread was in at the last dump. The main thread
# is the one whose outermost frame is the script's `<module>`, wherever the dump lists it; each
# thread's frames are listed most recent call first, one `File "...", line N in NAME` each. The
# check runs it on a stand-in that dumps its threads twice, as the watchdog does.

# %% nbgrader={"grade": false, "grade_id": "blocked_in", "locked": false, "schema_version": 3, "solution": true, "task": false}
def blocked_in(stacks):
    ### BEGIN SOLUTION
    last_dump = stacks.split("--- no step ended")[-1]
    for thread in last_dump.split("\n\n"):
        functions = re.findall(r'File ".*", line \d+ in (\S+)', thread)
        if functions and functions[-1] == "<module>":
            return functions[0]
    return None
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "blocked_in_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# A stand-in for a rank: its main thread waits in `broadcast`, then in
# `all_reduce`; each time, a watchdog thread dumps every thread's stack, as the
# kit's does
TWO_WAITS = RUNS / "two_waits.py"
TWO_WAITS.write_text("""\
import faulthandler
import sys
import threading

waiting, dumped = threading.Lock(), threading.Lock()
waiting.acquire()
dumped.acquire()


def watchdog():
    for _ in range(2):
        waiting.acquire()
        print("--- no step ended within 4 s after step 1 ---", flush=True)
        faulthandler.dump_traceback(sys.stdout, all_threads=True)
        print(flush=True)
        dumped.release()


def broadcast():  # waits in C, as a collective does, until the watchdog has dumped
    waiting.release()
    dumped.acquire()


def all_reduce():
    waiting.release()
    dumped.acquire()


threading.Thread(target=watchdog).start()
broadcast()
all_reduce()
""")
two_waits = subprocess.run([sys.executable, TWO_WAITS], capture_output=True, text=True,
                           timeout=60).stdout
MAIN_LAST = ("the innermost frame of the main thread (outermost: <module>), "
             "at the last dump")
assert blocked_in(two_waits) == "all_reduce", MAIN_LAST
### BEGIN HIDDEN TESTS
# the main thread dumps itself: it is the current thread, listed first
ITSELF = RUNS / "dumps_itself.py"
ITSELF.write_text("import faulthandler\nimport sys\nimport threading\n\n\n"
                  "def barrier():\n"
                  "    faulthandler.dump_traceback(sys.stdout, all_threads=True)\n\n\n"
                  "stop = threading.Event()\n"
                  "threading.Thread(target=stop.wait, name='loader').start()\n"
                  "barrier()\nstop.set()\n")
itself = subprocess.run([sys.executable, ITSELF], capture_output=True, text=True,
                        timeout=60).stdout
assert blocked_in(itself) == "barrier", MAIN_LAST
first_dump = two_waits.split("--- no step ended")[1]
assert blocked_in("--- no step ended" + first_dump) == "broadcast", MAIN_LAST
assert blocked_in(two_waits.replace("in all_reduce", "in reduce_scatter")) == \
    "reduce_scatter", MAIN_LAST
### END HIDDEN TESTS

# %% tags=["demo"]
blocked = {rank: blocked_in((RUNS / "barrier-on-rank-0" / "ranks" / f"{rank}.stacks")
                            .read_text()) for rank in (0, 1)}
for rank, function in blocked.items():
    print(f"rank {rank} is blocked in {function}()")
assert blocked[0] == "barrier" and blocked[1] != "barrier"

# %% [markdown]
# Rank 0 is in the barrier; rank 1 is already in the next step's forward pass (DDP's
# `_pre_forward`), where DDP's first steps synchronise too. Two ranks in two different
# collectives: the mismatch. **The fix.** No
# collective in a branch that only some ranks take (here: no barrier; a file write needs none).
#
# On GPUs, PyTorch's **flight recorder** keeps each rank's last collectives (which, on what
# sizes, whether they completed) in a ring buffer. Three variables work together, and none does
# the job alone:
#
# - `TORCH_NCCL_TRACE_BUFFER_SIZE=2000`: how many entries the buffer keeps (0 records nothing);
#   recording alone writes nothing to disk.
# - `TORCH_NCCL_DUMP_ON_TIMEOUT=1`: when a collective times out (or the watchdog sees an
#   error), each rank writes its record.
# - `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`: where, as a file prefix; each rank writes one file, the
#   prefix followed by its rank. The default, `/tmp/nccl_trace_rank_`, lies where every user of
#   the node can write, and the records are pickles that the reader loads: point it into a folder
#   of yours, such as the run's (`$RUN_DIR/nccl_trace_rank_`).
#
# Then `torchfrtrace --prefix nccl_trace_rank_ $RUN_DIR` (or
# `python -m torch.distributed.flight_recorder.fr_trace`) compares the ranks' records and names
# the rank missing from a collective. Recent versions of PyTorch also read the first and the last
# variable as `TORCH_FR_BUFFER_SIZE` and `TORCH_FR_DUMP_TEMP_FILE`. See
# [PyTorch's ProcessGroupNCCL variables](https://docs.pytorch.org/docs/stable/torch_nccl_environment_variables.html)
# and its [flight recorder tutorial](https://docs.pytorch.org/tutorials/prototype/flight_recorder_tutorial.html).
#
# When the ranks call collectives of different sizes, gloo does not hang but aborts:
# `Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?`.
# `TORCH_DISTRIBUTED_DEBUG=DETAIL` checks every collective's type and shapes across ranks before
# running it, on GPUs; with DDP on gloo, the CPU build this course tests with (torch 2.13) crashes
# in DDP's constructor under it, so this lesson does not use it.

# %% [markdown]
# ## 3. An unused parameter under DDP
#
# DDP all-reduces each gradient as soon as backward has produced it, bucket by bucket, and
# expects every parameter to get one. A module that the loss does not use (a head kept "for
# later", a branch of the model that a flag switches off) never does.

# %% tags=["demo"]
script = broken("unused-head", "    ddp_model = DDP(model)\n",
                "    model.value_head = torch.nn.Linear(config.n_embd, 1).to(device)"
                "  # for RL later\n"
                "    ddp_model = DDP(model)\n")
show_mistake(script)
unused = ddp_job("unused-head", script,
                 env={**ENV, "TORCH_DISTRIBUTED_DEBUG": "INFO"})
print(unused.status, "\n"
      + unused.tail(3, saying=r"\[rank0\]: (RuntimeError|Parameter)"))
assert (unused.status == "failed"
        and "value_head.bias, value_head.weight" in unused.output)

# %% [markdown]
# **Symptom.** The second step fails on every rank: `Expected to have finished reduction in the
# prior iteration before starting a new one`. **Diagnosis.** The error ends with the parameters'
# indices in `model.parameters()`; with `TORCH_DISTRIBUTED_DEBUG=INFO` it names them, here the
# head's weight and bias. **The fix.** Remove what the loss does not use, or freeze it
# (`requires_grad_(False)`) before wrapping the model in DDP. `find_unused_parameters=True` also
# makes the error go away: DDP then walks the autograd graph after every forward pass to find the
# parameters that will get no gradient. What that walk costs:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *`find_unused_parameters=True` is the fix for DDP's error.* It hides the parameter
# that gets no gradient and costs a walk of the graph every step; remove or freeze the
# parameter.
# :::

# %% tags=["demo"]
script = broken("find-unused", "    ddp_model = DDP(model)\n",
                "    model.value_head = torch.nn.Linear(config.n_embd, 1).to(device)"
                "  # for RL later\n"
                "    ddp_model = DDP(model, find_unused_parameters=True)\n")
found = ddp_job("find-unused", script)


def median_step_ms(name):
    return statistics.median(record["ms"]
                             for record in runs.read_metrics(RUNS / name)[1:])


print(f"find_unused_parameters: {found.status}, trains like the reference: "
      f"{trains_like('find-unused', 'reference')}; median step "
      f"{median_step_ms('find-unused'):.0f} ms against "
      f"{median_step_ms('reference'):.0f} ms")
assert found.status == "finished" and trains_like("find-unused", "reference")

# %% [markdown]
# It trains the same. What the walk costs grows with the graph: on the tiny model, over three
# steps, the difference between the two medians is mostly what else the machine was doing; on
# a large model it is a traversal of the whole graph in every step, which PyTorch's documentation
# warns about. Keep it for models whose unused part changes from step to step; a part that never
# gets a gradient is removed or frozen.
#
# ## 4. Every rank reads the same data
#
# The ddp stage's loader gives each rank its own share of every minibatch (`rank`, `world_size`).
# Leave them out and the loader is the std stage's: every rank reads the same samples.

# %% tags=["demo"]
script = broken("same-data",
                'TokenShardLoader(args.data, "train", B, T, rank, world_size)',
                'TokenShardLoader(args.data, "train", B, T)')
same = ddp_job("same-data", script)
print(f"{same.status}; losses {[round(x, 4) for x in losses('same-data')]}")
print(f"reference:    {[round(x, 4) for x in losses('reference')]}")
assert same.status == "finished" and not trains_like("same-data", "reference")

# %% [markdown]
# **Symptom.** None that stops the job: the loss goes down, only more slowly than it should, and a
# run N times too long is the cost. **Diagnosis.** Compare with the std stage, which must give the
# same losses at the same global batch (lesson 02). Averaging N copies of one microbatch's
# gradient gives that microbatch's gradient, so the broken job trains exactly as the std stage
# does on *one* rank's share of the batch:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *The loss goes down, so the data split is right.* Every rank reading the same samples
# also trains: compare with the std stage at the same global batch.
# :::

# %% tags=["demo"]
micro = presets.get_preset("tiny").micro_batch * presets.get_preset("tiny").seq_len
std = job("std-one-share", [sys.executable, stages.script_path("std"), *FLAGS, "--out",
                            RUNS / "std-one-share", "--batch-tokens", micro])
print(f"std at one rank's share of the batch ({micro} tokens): "
      f"same losses as the broken job: "
      f"{trains_like('same-data', 'std-one-share')}; as the reference: "
      f"{trains_like('same-data', 'reference')}")
assert trains_like("same-data", "std-one-share")

# %% [markdown]
# **The fix.** Give the loader the rank and the world size (or a `DistributedSampler` to a
# `DataLoader`). The check that proves it is lesson 02's: the fixed job's losses are the std
# stage's at the same global batch.
#
# ## 5. Out of memory
#
# Memory runs out in two ways, and they look different.
#
# - **Inside the process.** An allocation fails and Python raises an error, with a traceback, on
#   the rank that asked. On a GPU: `torch.OutOfMemoryError: CUDA out of memory. Tried to allocate
#   3.07 GiB`, and `torch.cuda.memory_summary()` tells how much the allocator held and what for.
# - **From outside.** A job's `--mem` is enforced by Slurm through a cgroup on the resident
#   memory of all the job's processes on a node. When they reach it, the kernel kills one with
#   SIGKILL, which no program can catch: no Python error, no traceback. The log just ends
#   (torchrun reports a child lost to signal 9), Slurm adds
#   `slurmstepd: error: Detected 1 oom-kill event(s) in StepId=... cgroup`, and
#   `sacct -j JOBID -o State,MaxRSS` shows the state `OUT_OF_MEMORY` (see the
#   [NeSI](https://docs.nesi.org.nz/General/FAQs/What_does_oom_kill_mean/) and
#   [OSC](https://www.osc.edu/documentation/knowledge_base/out_of_memory_oom_or_excessive_memory_usage)
#   pages on oom-kill). The first-aid page lists both symptoms.
#
# This CPU has no GPU memory to run out of, so the lesson sets a stand-in: a limit on each
# process's address space (`RLIMIT_AS`, 3 GB). An allocation past it fails inside the process, as
# on a GPU: PyTorch's CPU allocator raises a `RuntimeError` (`DefaultCPUAllocator: can't allocate
# memory`) where CUDA's raises `torch.OutOfMemoryError`. It is not what `--mem` does, and no tool
# for a GPU job: the CUDA driver reserves large ranges of virtual addresses, far more than any
# memory, and CUDA cannot start under such a limit. Here a micro-batch of 32 needs the gradients
# of 32 x 128 x 50,304 logits at once.

# %% tags=["demo"]
LIMIT = 3 * 10**9
# 2 ranks x 32 samples
BIG = ["--micro-batch", "32", "--batch-tokens", str(2 * 32 * 128)]


def limit_memory():
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


oom = ddp_job("oom", DDP, *BIG, "--max-steps", "1", preexec_fn=limit_memory)
print(oom.status, "\n" + oom.tail(1))
assert oom.status == "failed" and "out of memory allocating" in oom.output

# %% [markdown]
# **Symptom.** The kit's one line: how much could not be allocated, on which rank and where, and
# the fixes that keep the training the same. **Diagnosis.** `coursekit.memory` predicts what a
# rank holds at its peak (lesson 04): parameters, gradients, optimiser state, activations and, at
# the start of backward, the gradients of the logits, which GPT-2's vocabulary makes the largest
# part:

# %% tags=["demo"]
for micro_batch in (32, 8, 2):
    parts = memory.per_rank_bytes(TINY, "ddp", 2, "fp32", micro_batch, 128)
    print(f"micro-batch {micro_batch:2}: " + ", ".join(f"{part} {value / 1e9:.2f} GB"
                                                     for part, value in parts.items()))

# %% [markdown]
# **The fix.** What keeps the training the same: a smaller micro-batch with the same
# `--batch-tokens`, which the stage makes up with gradient accumulation (lesson 01). Others:
# activation checkpointing (fsdp, tp, pp: `--activation-checkpointing`) trades memory for a
# second forward pass; FSDP shards parameters, gradients and optimiser state (lesson 04).
#
# The largest micro-batch whose predicted peak fits a budget is lesson 04's exercise 2 turned
# around:

# %% tags=["demo"]
def largest_micro_batch(budget_bytes, micro_batches=(32, 16, 8, 4, 2, 1)):
    """The largest of ``micro_batches`` whose predicted peak on one of 2 ddp ranks is
    at most ``budget_bytes``, or None."""
    fitting = [m for m in micro_batches
               if memory.per_rank_bytes(TINY, "ddp", 2, "fp32", m, 128)["total"]
               <= budget_bytes]
    return max(fitting, default=None)

# %% [markdown]
# The fixed job, under the same limit, at the micro-batch that fits a budget of 0.5 GB (the limit
# less what a process holds besides training: more than a gigabyte of libraries and buffers
# here, and room to spare, as a job on a busy node needs), against the same job without the
# limit at micro-batch 32, one step each. The same loss and the same gradient norm mean the same
# gradient, so the same training:

# %% tags=["demo"]
fits = largest_micro_batch(5 * 10**8)
fixed = ddp_job("oom-fixed", DDP, *BIG[2:], "--micro-batch", str(fits), "--max-steps",
                "1", preexec_fn=limit_memory)
unlimited = ddp_job("unlimited", DDP, *BIG, "--max-steps", "1")
first = {name: runs.read_metrics(RUNS / name)[0] for name in ("oom-fixed", "unlimited")}
same_gradient = all(abs(first["oom-fixed"][key] - first["unlimited"][key]) < 1e-4
                    for key in ("loss", "grad_norm"))
print(f"micro-batch {fits} under {LIMIT / 1e9:.0f} GB: {fixed.status}; "
      f"micro-batch 32 without "
      f"the limit: {unlimited.status}; "
      f"the same loss and gradient norm: {same_gradient}")
assert fixed.status == "finished" and same_gradient

# %% [markdown]
# ## 6. A loss that becomes NaN
#
# A learning rate far too high for the first steps (no warm-up) throws the weights so far that
# the logits overflow. The kit stops the run at the first step whose loss or gradient norm is not
# a number, before a checkpoint could keep the broken weights:

# %% tags=["demo"]
nan = ddp_job("nan", DDP, "--lr", "1000", "--warmup-steps", "0", "--ckpt-interval", "1")
print(nan.status, "\n" + nan.tail(1))
print("grad_norm per step:", [r["grad_norm"] for r in runs.read_metrics(RUNS / "nan")])
assert nan.status == "failed" and "the weights are lost from this step on" in nan.output

# %% [markdown]
# **Diagnosis.** The gradient norms the run logged: where they leave their usual range is where it
# went wrong, often hundreds of steps before the NaN. Anomaly detection names the operation whose
# backward first produced a NaN: slow (it checks every operation), so run it on the step before,
# resumed from the last good checkpoint. Here, the std stage's model after one such step, in this
# process:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *A NaN appears at the step where the loss shows it.* The gradient norm left its range
# earlier.
# :::

# %% tags=["demo"]
std_stage = stages.load("std")
torch.manual_seed(1337)
preset = presets.get_preset("tiny")
model = std_stage.GPT(std_stage.GPTConfig(vocab_size=preset.vocab_size,
                                          block_size=preset.seq_len,
                                          n_layer=preset.n_layer, n_head=preset.n_head,
                                          n_embd=preset.n_embd))
optimizer = torch.optim.AdamW(model.parameters(), lr=1000.0)
batches = std_stage.TokenShardLoader(DATA, "train", preset.micro_batch, preset.seq_len)
with warnings.catch_warnings(record=True) as warned, torch.autograd.detect_anomaly():
    for step in (1, 2, 3):
        x, y = batches.next_batch()
        try:
            std_stage.cross_entropy(model(x), y).backward()
        except RuntimeError as anomaly:
            print(f"step {step}: {str(anomaly).splitlines()[0]}")
            break
        optimizer.step()
        optimizer.zero_grad()
# the warning holds the forward call that made the operation: its last lines in the
# model
forward_trace = next(str(w.message) for w in warned
                     if "Error detected in" in str(w.message))
forward_trace = forward_trace.splitlines()
in_model = [i for i, line in enumerate(forward_trace) if "solutions/gpt.py" in line]
print("made in forward by:",
      *(forward_trace[i].strip() + ": " + forward_trace[i + 1].strip()
        for i in in_model[-2:]), sep="\n  ")

# %% [markdown]
# **The fix.** A learning rate the model can take (the preset's), reached by a warm-up. In fp16
# there are two more causes. Activations above fp16's largest number, 65,504, become inf, and
# then NaN. And a loss scale set too high makes the scaled gradients inf; GradScaler skips those
# steps and lowers the scale. Without loss scaling the small gradients do not overflow: they
# *underflow* to zero, and the model stops learning without a NaN in sight (the stages scale the
# loss in fp16, lesson 04).
#
# **Exercise 4: where it went wrong.** Write `diverged_at(records, factor=10)`: the first step
# whose `grad_norm` is not finite, or more than `factor` times the median `grad_norm` of all the
# steps before it; None if there is none. The first step has no steps before it and is never
# the answer unless its norm is not finite.

# %% nbgrader={"grade": false, "grade_id": "diverged_at", "locked": false, "schema_version": 3, "solution": true, "task": false}
def diverged_at(records, factor=10):
    ### BEGIN SOLUTION
    norms = []
    for record in records:
        norm = record["grad_norm"]
        if (not math.isfinite(norm)
                or (norms and norm > factor * statistics.median(norms))):
            return record["step"]
        norms.append(norm)
    return None
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "diverged_at_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def trace(*norms):
    return [{"step": step, "grad_norm": norm}
            for step, norm in enumerate(norms, start=1)]


assert diverged_at(trace(1.0, 0.9, 0.8)) is None
assert diverged_at(trace(1.0, 0.9, math.inf)) == 3
### BEGIN HIDDEN TESTS
assert diverged_at(trace(math.nan)) == 1
# 25 > 10 x median(1, 2, 3)
assert diverged_at(trace(1.0, 2.0, 3.0, 25.0, math.nan)) == 4
assert diverged_at(trace(1.0, 2.0, 3.0, 19.0), factor=10) is None
assert diverged_at(trace(1.0, 2.0, 3.0, 19.0), factor=5) == 4
assert diverged_at(trace(5.0, 0.5, 0.4, 6.0)) == 4  # 6 > 10 x median(5, 0.5, 0.4) = 5
assert diverged_at([]) is None
assert (diverged_at(runs.read_metrics(RUNS / "nan")) == 2
        if (RUNS / "nan").exists() else True)
### END HIDDEN TESTS

# %% [markdown]
# ## 7. A straggler
#
# One slow rank (a node whose file system is slow, a core another job also uses, a GPU that
# throttles) slows every rank, since each waits for it in the all-reduce. Here rank 1 takes 0.3 s
# more than rank 0 to read each batch:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *The step time shows which rank is slow.* Every rank waits for the slowest in the
#   all-reduce, so all have the same step time; the time to *reach* the all-reduce
#   differs.
# - Say here: who to ask when a node is slow (`sinfo -R` for drained nodes, the site's
#   status page).
# :::

# %% tags=["demo"]
script = broken("straggler",
                "        return x[self.rank], y[self.rank]  # this rank's share\n",
                "        time.sleep(0.3 * self.rank)  # rank 1 reads from a slow disk\n"
                "        return x[self.rank], y[self.rank]  # this rank's share\n")
slow = ddp_job("straggler", script, "--max-steps", "6")
ranks_folder = RUNS / "straggler" / "ranks"
steps_by_rank = {rank: [json.loads(line) for line in
                        (ranks_folder / f"{rank}.jsonl").read_text().splitlines()]
                 for rank in (0, 1)}
for rank, steps in steps_by_rank.items():
    print(f"rank {rank}: step_s {[round(r['step_s'], 2) for r in steps]}\n"
          f"        ready_s {[round(r['ready_s'], 2) for r in steps]}")
assert slow.status == "finished"  # only slower


def rank_1_minus_rank_0(key):
    """Step by step, after the first two (one-off work): rank 1's less rank 0's."""
    pairs = zip(steps_by_rank[0], steps_by_rank[1])
    return [one[key] - zero[key] for zero, one in pairs][2:]


assert abs(statistics.median(rank_1_minus_rank_0("step_s"))) < 0.1
assert abs(statistics.median(rank_1_minus_rank_0("ready_s")) - 0.3) < 0.12

# %% [markdown]
# **Symptom.** Slow steps, and a low MFU on every rank. **Diagnosis.** Each rank's record of its
# own steps, `ranks/<rank>.jsonl`: after the first steps, `step_s` is about the same on both
# ranks (they wait for each other), but `ready_s`, the time a rank takes to reach the gradient
# all-reduce, is about 0.3 s longer on rank 1 (the cell checks both on the median of the later
# steps) at every step but the second (there DDP rebuilds its buckets once, in forward, and rank 0
# waits for rank 1 to do the same). On GPUs the same shows in a profiler's trace (lesson 06): the
# fast ranks' all-reduce kernels start early and last long, waiting. **The fix.** It depends on
# the cause: move the data to a faster file system, exclude the node (`--exclude`), give the job
# whole nodes.
#
# **Exercise 5: which rank.** Write `straggler(run_dir)`: the rank whose median `ready_s` in
# `run_dir/ranks/<rank>.jsonl` is the largest, and by how many seconds its median exceeds the
# median of the other ranks' medians: `(rank, seconds)`. Skip the first step of each rank (it
# includes one-off work), and a record whose `ready_s` is None.

# %% nbgrader={"grade": false, "grade_id": "straggler", "locked": false, "schema_version": 3, "solution": true, "task": false}
def straggler(run_dir):
    ### BEGIN SOLUTION
    medians = {}
    for path in sorted(Path(run_dir, "ranks").glob("*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()][1:]
        medians[int(path.stem)] = statistics.median(r["ready_s"] for r in records
                                                    if r["ready_s"] is not None)
    slowest = max(medians, key=medians.get)
    others = statistics.median(m for rank, m in medians.items() if rank != slowest)
    return slowest, medians[slowest] - others
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "straggler_tests", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def rank_logs(folder, ready_by_rank):
    """runs' ranks/<rank>.jsonl files with the given ready_s per step."""
    (folder / "ranks").mkdir(parents=True, exist_ok=True)
    for rank, readies in ready_by_rank.items():
        lines = [json.dumps({"step": step, "step_s": 1.0, "ready_s": ready})
                 for step, ready in enumerate(readies, start=1)]
        (folder / "ranks" / f"{rank}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


rank, behind = straggler(rank_logs(RUNS / "two-ranks", {0: [0.5, 0.1, 0.1, 0.1],
                                                         1: [0.1, 0.4, 0.4, 0.4]}))
assert rank == 1 and abs(behind - 0.3) < 1e-9
### BEGIN HIDDEN TESTS
rank, behind = straggler(rank_logs(RUNS / "first-step", {0: [9.0, 0.2, 0.2],
                                                         1: [0.1, 0.3, 0.3]}))
assert rank == 1 and abs(behind - 0.1) < 1e-9  # rank 0's slow first step does not count
rank, behind = straggler(rank_logs(RUNS / "four", {0: [1, 0.1, 0.2, 0.3],
                                                   1: [1, 0.2, 0.2, 0.2],
                                                   2: [1, 0.9, 1.1, 1.0],
                                                   3: [1, 0.3, 0.3, 0.3]}))
# median of the others' medians 0.2, 0.2, 0.3
assert rank == 2 and abs(behind - (1.0 - 0.2)) < 1e-9
rank, _ = straggler(rank_logs(RUNS / "none-ready", {0: [1, None, 0.5, 0.5],
                                                     1: [1, 0.1, None, 0.1]}))
assert rank == 0
if (RUNS / "straggler" / "ranks").exists():
    rank, behind = straggler(RUNS / "straggler")
    assert rank == 1 and 0.2 < behind < 0.5
### END HIDDEN TESTS

# %% [markdown]
# ## 8. A Slurm job that never starts, or dies at once
#
# These need a cluster; the commands are the same on every Slurm site. The course's tests submit
# three of them (a partition that does not exist, more CPUs per node than a node has, an
# environment that is not there) to a 2-node test cluster and check these messages.
#
# | mistake | what you see | first command |
# |---|---|---|
# | a partition that does not exist | `sbatch: error: invalid partition specified: gpu-typo`, at once | `sinfo -s` lists the partitions |
# | more GPUs or CPUs per node than a node has | `sbatch: error: CPU count per node can not be satisfied` (or the GPUs') and `Requested node configuration is not available`, at once | `sinfo -o "%P %G %c %m"` (GPUs, CPUs and memory per node) |
# | an account or QOS you may not use | `sbatch: error: Invalid account or account/partition combination specified` | `sacctmgr show assoc user=$USER` |
# | resources that exist but are busy | `squeue --me` says `PD` with reason `Resources` or `Priority` | `squeue --me --start` (estimated start) |
# | a module or an environment that is not there | the job starts and fails within seconds; its log's first error is the set-up's (`module: ... unable to locate a modulefile`, `.venv-typo/bin/activate: No such file or directory`) | `sacct -j JOBID --format=JobID,State,ExitCode,Elapsed` (FAILED), then the log's first error |
#
# A job that fails at once is a job that never trained: read the *first* error in its log, not
# the last: what follows the first is usually its consequence.
#
# ## Key points
#
# - Give every job a timeout that turns a hang into an error: `KIT_DIST_TIMEOUT` for
#   collectives, torchrun's `--rdzv-conf timeout=` for the rendezvous, and the job's own time
#   limit. A hang with a timeout is a diagnosis; without one, it is a lost allocation.
# - A hang at the start is the rendezvous (address, port, firewall); a hang after some steps is
#   a collective that not every rank called. Each rank's stack (the kit's watchdog, `py-spy
#   dump`, NCCL's flight recorder) says where each one is.
# - DDP needs a gradient for every parameter: remove or freeze what the loss does not use;
#   `find_unused_parameters=True` is for models whose unused part changes.
# - A wrong data split does not fail: compare with the std stage at the same global batch.
# - Out of memory inside a process is a Python error with a traceback: predict with
#   `coursekit.memory`; lower the micro-batch with the same global batch, or checkpoint
#   activations, or shard. Past a job's `--mem`, the kernel kills a process from outside: no
#   traceback, and `sacct` says `OUT_OF_MEMORY`.
# - A NaN starts earlier than it shows: look at the gradient norm; then fix the learning rate and
#   the warm-up, or the loss scaling in fp16.
# - A straggler makes every rank slow: find it from each rank's time to reach the collective,
#   not from the step time, which every rank shares.
