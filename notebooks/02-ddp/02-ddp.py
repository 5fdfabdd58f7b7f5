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
# # 02 · Data parallelism with DDP
#
# **Questions.** This lesson answers
# - How can $N$ processes train one model as one process would, only faster?
# - Which process reads which data, and how do they agree on the weights?
# - When does adding GPUs stop paying, and how do I find out why?
#
# **Objectives.** After this lesson you can
# - explain why averaging the gradients of $N$ processes gives the gradient of the global batch,
#   and what DistributedDataParallel (DDP) overlaps with the backward pass;
# - name a process's rank, local rank and world size as torchrun and Slurm set them;
# - split the data across ranks so that $N$ processes read what one process would have read;
# - turn the single-device script into the DDP script hunk by hunk, and check your copy;
# - launch `torchrun` from a notebook and compare 1 and $N$ processes at the same global batch;
# - measure strong and weak scaling from a run's own tokens/s, and tell from a run's evidence
#   whether the network, the input pipeline or too little work per GPU limits it;
# - scale the learning rate with the batch, with warm-up, and say why large batches can
#   generalise worse.
#
# **Prerequisites.** Lessons 00 and 01: the stage script `train_gpt2_std.py`, tokens per step,
# speedup and efficiency.
#
# **Time.** About 95 minutes: reading, the exercises, and waiting for the cells on a laptop's CPU.
# The time is an estimate; the instructor guide says how it is made.

# %%
import inspect
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

from coursekit import KIT_ROOT, data, diffs, distributed, presets, runs, stages, widgets
from coursekit.launch import torchrun
from solutions import gpt

# %% [markdown]
# The set-up: the offline corpus, the std and ddp stages, your working copy of the script,
# and the run length, the lesson's one knob.

# %%
DATA = KIT_ROOT / "data" / "builtin"
if not (DATA / "meta.json").exists():  # the offline corpus: built in seconds, once
    data.prepare_builtin(DATA)
std, ddp = stages.load("std"), stages.load("ddp")  # solutions/train_gpt2_{std,ddp}.py
LESSON = "02-ddp"
# yours, next to this notebook: handed in with it
WORKING_COPY = Path("train_gpt2.py").resolve()
tiny = presets.get_preset("tiny")
print(f"torch {torch.__version__}; GPUs visible: {torch.cuda.device_count()}")
# Run length, the one knob of this lesson: the short runs take seconds on a laptop's CPU
# and show the same things; with GPUs the longer ones are as quick. Set it to True or
# False to choose.
LONGER_RUNS = torch.cuda.is_available()

# %% [markdown]
# ## One model, many copies
#
# In **data parallelism** each of $N$ processes (one per GPU) holds a complete copy of the model
# and trains on its own share of the minibatch. Suppose the minibatch has $N \times b$ samples and
# rank $r$ gets samples $S_r$. The loss of the minibatch is the mean over all samples, so
#
# $$L = \frac{1}{Nb}\sum_{i=1}^{Nb} \ell_i = \frac{1}{N}\sum_{r=0}^{N-1} \underbrace{\frac{1}{b}\sum_{i \in S_r} \ell_i}_{L_r}
# \qquad\Longrightarrow\qquad
# \nabla L = \frac{1}{N}\sum_{r=0}^{N-1} \nabla L_r .$$
#
# Each rank computes $\nabla L_r$ on its own samples; one **all-reduce** (every rank sends its
# gradient and receives the sum) followed by a division by $N$ gives every rank the gradient of
# the whole minibatch. All ranks then take the same optimiser step from the same weights, so the
# copies stay identical. Weights are sent once: when DDP wraps the model it broadcasts rank 0's
# parameters and buffers to every rank, so that all copies start equal; after that, only
# gradients travel, for the GPT, which has no buffers that change. A model with BatchNorm (lesson
# 08's ResNet) also has DDP broadcast rank 0's buffers, its running means and variances, before
# every forward (`broadcast_buffers=True`, the default); each rank still normalises with its own
# batch's statistics, unless the layers are converted to `SyncBatchNorm`, which gathers them.
#
# Check the maths on the GPT of lesson 01 before any process is started: the gradient of 8
# samples equals the mean of the gradients of two halves of 4.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *DDP splits the model.* Spot it when trainees expect less memory per GPU with more
# GPUs. Every rank holds the whole model; lesson 04 splits it.
# :::

# %% tags=["demo"]
config = gpt.GPTConfig(vocab_size=tiny.vocab_size, block_size=tiny.seq_len,
                       n_layer=tiny.n_layer, n_head=tiny.n_head, n_embd=tiny.n_embd)
torch.manual_seed(0)
model = gpt.GPT(config)  # solutions/gpt.py: the model every stage trains
x, y = std.TokenShardLoader(DATA, "train", 8, tiny.seq_len).next_batch()


def gradient(samples):
    model.zero_grad()
    gpt.cross_entropy(model(x[samples]), y[samples]).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


whole = gradient(slice(0, 8))
# what all-reduce / N computes
halves = (gradient(slice(0, 4)) + gradient(slice(4, 8))) / 2
print(f"{whole.numel():,} gradient entries; max |mean of halves - whole batch| = "
      f"{(halves - whole).abs().max():.1e}")

# %% [markdown]
# ### All-reduce in practice, and why DDP overlaps it with backward
#
# `allreduce_demo.py` next to this notebook does the same with real processes: each rank computes
# the gradient of its share of a small batch, `dist.all_reduce` sums them, and every rank ends up
# with the gradient of the whole batch. The launcher, `torchrun`, starts one process per device and
# tells each where it is.

# %% tags=["demo"]
# found from any working folder
DEMO = KIT_ROOT / "notebooks" / "02-ddp" / "allreduce_demo.py"
demo = subprocess.run([*torchrun(2), str(DEMO)],
                      capture_output=True, text=True, check=True)
print(demo.stdout)

# %% [markdown]
# The all-reduce moves every gradient byte across the network. A **ring all-reduce** of a
# gradient of $S$ bytes over $N$ ranks is a reduce-scatter then an all-gather, $N-1$ steps each,
# and in every step each rank sends one $S/N$ chunk to its neighbour and receives one from the
# other: each rank sends $2(N-1)/N \times S$ bytes per all-reduce and receives as many. For GPT-2
# 124M in fp32, $S \approx 0.5$ GB: on 8 GPUs each GPU sends $2 \cdot 7/8 \cdot 0.5 = 0.875$ GB per
# all-reduce (one per optimiser step, after the last microbatch) and receives 0.875 GB, and on
# any number of GPUs less than $2S$ = 1 GB each way: nearly independent of $N$, which is why data
# parallelism scales to thousands of GPUs.
#
# Bandwidth is not the only limit. Each of the $2(N-1)$ steps also pays a latency (tens of
# microseconds between nodes), which grows with $N$; rings give way to trees and hierarchies at
# scale for that reason. And adding ranks grows the global batch: beyond the **critical batch
# size** a larger batch no longer cuts the number of steps needed in proportion, so more GPUs
# stop saving time however fast the network is (lesson 07 comes back to this).
#
# DDP hides most of that time. It groups parameters into **buckets** of about 25 MB, in the
# reverse order of the forward pass, and starts all-reducing a bucket as soon as backward has
# produced all its gradients, while backward carries on with earlier layers. Only the last bucket
# is waited for. Two consequences you will see in the script:
# - with gradient accumulation, the all-reduce is only needed after the *last* microbatch;
#   `model.no_sync()` skips it for the others;
# - every rank must run the same backward passes in the same order, or the buckets never fill and
#   the job hangs.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# Say here that the all-reduce volume is nearly independent of the number of GPUs; DDP
# hides it behind backward in buckets.
# :::

# %% tags=["demo"]
bucket_mb = 25
for name in ("tiny", "gpt2-124m"):
    p = presets.get_preset(name)
    n_params = 12 * p.n_layer * p.n_embd**2 + p.vocab_size * p.n_embd
    megabytes = 4 * n_params / 1e6  # fp32 gradients
    print(f"{name:10s} ~{n_params / 1e6:6.1f} M matmul parameters -> "
          f"{megabytes:6.1f} MB of gradients "
          f"-> about {max(1, round(megabytes / bucket_mb))} bucket(s) of "
          f"{bucket_mb} MB")

# %% [markdown]
# ## Where am I? Rank, local rank, world size
#
# Every process of a distributed job needs three numbers and the address of a meeting point:
#
# | meaning | torchrun sets | Slurm's `srun` sets |
# |---|---|---|
# | **world size**: processes in the job | `WORLD_SIZE` | `SLURM_NTASKS` |
# | **rank**: this process's number, 0 … world size − 1 | `RANK` | `SLURM_PROCID` |
# | **local rank**: its number on this node; picks its GPU | `LOCAL_RANK` | `SLURM_LOCALID` |
# | node's number | `GROUP_RANK` | `SLURM_NODEID` |
# | where rank 0 listens | `MASTER_ADDR`, `MASTER_PORT` | (the batch file exports them) |
#
# `torchrun` is used on one machine and, under Slurm, as `srun torchrun ...` with one torchrun per
# node; `srun python train.py` with one task per GPU needs no torchrun at all, and the script reads
# the `SLURM_*` names. The DDP stage accepts both.
#
# **Exercise 1.** Write `process_coordinates(env)`: `(rank, world_size, local_rank)` as integers
# from a dictionary of environment variables. Use torchrun's names when present, else Slurm's,
# else `(0, 1, 0)` (a plain `python train.py`).

# %% nbgrader={"grade": false, "grade_id": "coordinates", "locked": false, "schema_version": 3, "solution": true, "task": false}
def process_coordinates(env):
    ### BEGIN SOLUTION
    rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
    world_size = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1)))
    local_rank = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))
    return rank, world_size, local_rank
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "coordinates_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
assert process_coordinates({"RANK": "5", "WORLD_SIZE": "8",
                            "LOCAL_RANK": "1"}) == (5, 8, 1)
assert process_coordinates({}) == (0, 1, 0)
### BEGIN HIDDEN TESTS
assert process_coordinates({"SLURM_PROCID": "6", "SLURM_NTASKS": "16",
                            "SLURM_LOCALID": "2"}) == (6, 16, 2)
# srun torchrun: Slurm counts one task per node, torchrun's names are the ones
# that matter
assert process_coordinates({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3",
                            "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                            "SLURM_LOCALID": "0"}) == (3, 8, 3)
### END HIDDEN TESTS

# %% [markdown]
# ## Sharing out the data
#
# The ranks must read different samples, and together exactly the samples that one process would
# have read, so that $N$ processes train the same model as one. The DDP stage's loader reads
# $N$ microbatches side by side from the token stream and keeps the one at position `rank`
# (**rank-strided**): at every step the ranks together hold the next $N \times B$ samples, in the
# order one process would read them with gradient accumulation. Its position after a step is the
# same on every rank, so one rank's checkpoint is enough to resume all of them.
#
# **Exercise 2.** Write `rank_microbatch(tokens, B, T, rank, world_size)`: the first microbatch
# `(x, y)` of rank `rank` from a 1-D tensor of token ids, each of shape `(B, T)`, where `y` is `x`
# shifted by one token. Rank $r$'s samples follow rank $r-1$'s in the stream.

# %% nbgrader={"grade": false, "grade_id": "sharding", "locked": false, "schema_version": 3, "solution": true, "task": false}
def rank_microbatch(tokens, B, T, rank, world_size):
    ### BEGIN SOLUTION
    start = rank * B * T
    chunk = tokens[start:start + B * T + 1]
    return chunk[:-1].view(B, T), chunk[1:].view(B, T)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "sharding_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
stream = torch.arange(100)
x0, y0 = rank_microbatch(stream, 2, 3, 0, 2)
x1, y1 = rank_microbatch(stream, 2, 3, 1, 2)
assert x0.tolist() == [[0, 1, 2], [3, 4, 5]] and y0.tolist() == [[1, 2, 3], [4, 5, 6]]
assert x1.tolist() == [[6, 7, 8], [9, 10, 11]]
### BEGIN HIDDEN TESTS
import numpy as np

train_tokens = torch.from_numpy(
    np.load(sorted(DATA.glob("train_*.npy"))[0])[:10_000].astype(np.int64))
for r in range(4):
    expected = ddp.TokenShardLoader(DATA, "train", 2, 16, rank=r,
                                    world_size=4).next_batch()
    got = rank_microbatch(train_tokens, 2, 16, r, 4)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
### END HIDDEN TESTS

# %% [markdown]
# The loader of `train_gpt2_ddp.py` does the same: two ranks with microbatch 4 see, between them,
# the 8 samples that one process with microbatch 8 sees.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *Every rank may read the same batches.* Spot it when a copy's ranks all start at
# offset 0. Exercise 2 and the "ranks 0 and 1 together" cell show the split.
# :::

# %% tags=["demo"]
ranks = [ddp.TokenShardLoader(DATA, "train", 4, tiny.seq_len, rank=r,
                              world_size=2).next_batch()
         for r in range(2)]
one_process = std.TokenShardLoader(DATA, "train", 8, tiny.seq_len).next_batch()
together = torch.cat([ranks[0][0], ranks[1][0]])
print("rank 0 starts with",
      data.gpt2_encoding().decode(ranks[0][0][0, :12].tolist()).__repr__())
print("rank 1 starts with",
      data.gpt2_encoding().decode(ranks[1][0][0, :12].tolist()).__repr__())
print("ranks 0 and 1 together == one process with B=8:",
      torch.equal(together, one_process[0]))

# %% [markdown]
# ## From `train_gpt2_std.py` to `train_gpt2_ddp.py`, hunk by hunk
#
# The whole lesson is one diff, `diffs/std-ddp.patch`. Each **hunk** is one change, with three
# lines of context around it:
#
# 1. the docstring's launch command; 2. imports (`nullcontext`, `DistributedDataParallel`);
# 3–4. the loader takes `rank` and `world_size` and keeps its share of $N$ microbatches;
# 5. `main` finds its place in the job: `distributed.setup` (below) gives it its rank, the
#    number of processes and its device;
# 6. DDP wraps the model; `grad_accum` counts the processes; each rank's loader gets its rank;
#    rank 0 alone starts the run directory;
# 7. the loop: `no_sync()` for all but the last microbatch; one all-reduce averages the loss over
#    the ranks and tells each whether any rank was told to stop; rank 0 alone writes metrics,
#    checkpoints and the sample; a clean shutdown of the process group.
#
# Every multi-process stage of the course starts the same way, so `distributed.setup` lives once,
# in `coursekit/distributed.py`. Read it: it is the part of this lesson the diff does not show.
# The launcher's variables say where the process is; its device comes from its local rank and is
# made the current one *before* the group starts, so that NCCL's communicator and every bare
# `"cuda"` tensor land on this process's GPU (without it, every rank would use GPU 0); the group
# gets the backend for that device (gloo on CPUs, NCCL beside gloo on NVIDIA and AMD GPUs) and,
# on GPUs, its `device_id`; its collectives give up after `KIT_DIST_TIMEOUT` seconds (600) rather
# than wait for ever for a process that hung or died. A single process gets a group of one, so
# that the same script runs alone.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *The rank picks the GPU.* On a second node, rank 4 has no GPU 4. The local rank
#   picks it.
# - Say here that the conversion, hunk by hunk, is the skill the course is for (exercise
#   3 is graded by running the trainee's script).
# :::

# %% tags=["demo"]
print(inspect.getsource(distributed.setup))
print(inspect.getsource(distributed.device_for))

# %% [markdown]
#
# Start your working copy, `train_gpt2.py` in this notebook's folder, from the std stage (an
# existing copy is kept), then read the hunks.

# %% tags=["demo"]
working_copy = diffs.start_working_copy(LESSON, WORKING_COPY)
patch_text = diffs.patch_path(diffs.step_for_lesson(LESSON)).read_text()
added, removed = diffs.counts(patch_text)
print(f"{working_copy.name}: {len(working_copy.read_text().splitlines())} lines; "
      f"the patch adds {added} and removes {removed}")
for hunk in diffs.hunks(LESSON):
    display(Markdown(f"**hunk {hunk.number}**\n```diff\n{hunk.text}\n```"))

# %% [markdown]
# Open `train_gpt2.py` in the editor (File → Open, or the file browser) and make the changes one
# hunk at a time: lines with `-` go, lines with `+` come in. After each, run the next cell. It
# reports every hunk as *applied*, *not yet applied* (the old lines are still there) or
# *conflicting* (neither: it shows your lines with `-` and the expected ones with `+`). The same
# check from a terminal in this folder: `python -m coursekit diffs status --lesson 02-ddp --file
# train_gpt2.py`.

# %% tags=["demo"]
print(diffs.report(LESSON, diffs.status(LESSON, WORKING_COPY)))

# %% [markdown]
# Stuck on a hunk? `python -m coursekit diffs apply --lesson 02-ddp --hunk N --file
# train_gpt2.py`, or the cell below, applies one hunk whose old lines are still in place (here
# the imports, hunk 2) and leaves the rest to you.

# %% tags=["demo"]
imports = diffs.status(LESSON, WORKING_COPY)[1]
if imports.state == "not yet applied":
    diffs.apply_hunk(LESSON, imports.hunk.number, WORKING_COPY)
print(diffs.report(LESSON, diffs.status(LESSON, WORKING_COPY)).splitlines()[-1])

# %% [markdown] tags=["practice"]
# **The conversion, your practice.** Make every hunk in `train_gpt2.py`, in the editor, until the
# report above has nothing left; the runs below use the finished script either way. The
# conversion is not graded, since applying hunks takes no understanding of them; the exercise
# after it is, and it is the step at the heart of the script.

# %% [markdown]
# **Exercise 3: one DDP step.** Write `ddp_step(ddp_model, optimizer, microbatches, loss_fn)`:
# one optimiser step of a model wrapped in DDP, on this rank's `microbatches` (a list of
# `(inputs, targets)` pairs). The gradients are those of the mean loss over every microbatch of
# every rank; DDP averages them over the ranks, but only one all-reduce per step is needed, after
# the last microbatch (hunk 7 and "All-reduce in practice" above). Return the step's mean loss
# over every rank's microbatches, the same float on every rank. Your function may use `torch`,
# `dist` (`torch.distributed`) and `nullcontext`. The test runs it on 2 processes
# (`coursekit/ddp_step_check.py`): each rank takes 3 steps on 2 microbatches of its
# own, and the result must be the model of one process that takes each step on all the ranks'
# microbatches at once.

# %% nbgrader={"grade": false, "grade_id": "ddp_step", "locked": false, "schema_version": 3, "solution": true, "task": false}
def ddp_step(ddp_model, optimizer, microbatches, loss_fn):
    ### BEGIN SOLUTION
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros(())
    for i, (inputs, targets) in enumerate(microbatches):
        last = i == len(microbatches) - 1
        with nullcontext() if last else ddp_model.no_sync():
            loss = loss_fn(ddp_model(inputs), targets) / len(microbatches)
            loss.backward()
        loss_sum += loss.detach()
    optimizer.step()
    dist.all_reduce(loss_sum)  # the sum of the ranks' means...
    return loss_sum.item() / dist.get_world_size()  # ...and their mean
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "ddp_step_tests", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
from coursekit import exercise  # noqa: E402

# coursekit.ddp_step_check's result, on 2 processes
result = exercise.run_checker("coursekit.ddp_step_check", ddp_step)
print(result)
assert result["error"] is None, result["error"]
assert result["largest_difference"] < 1e-6, \
    "the model differs from that of one process on every rank's microbatches"
### BEGIN HIDDEN TESTS
assert all(abs(mine - one) < 1e-6 for mine, one in
           zip(result["losses"], result["expected_losses"], strict=True)), \
    "the loss returned is the mean over every microbatch of every rank"
assert result["all_reduces"] == [1, 1, 1], (
    "the gradients are all-reduced after every microbatch: no_sync() skips all but "
    "the last")
### END HIDDEN TESTS

# %% [markdown]
# ## Launching: 1 process and $N$ processes at the same global batch
#
# `torchrun --nnodes=1 --nproc-per-node=N --master-addr=127.0.0.1 --master-port=P script.py`
# starts $N$ processes on this machine with the variables of the table above, meeting at port $P$
# (one that is free: `python -m coursekit free-port`). `python -m coursekit torchrun --nproc N
# script.py` types that command for you and prints it; the cells below run the same one. Here $N$ is the number of GPUs if there are two or more, else
# two CPU processes talking over gloo (NCCL does not let two ranks share one GPU). The runs below use the finished script in `solutions/`,
# so they work whether or not your copy is done; point `SCRIPT` at `train_gpt2.py` to run yours.
#
# The **global batch** (tokens per optimiser step) is the same in both runs: one process gets
# there with `grad_accum` = $N$ microbatches, $N$ processes with one microbatch each. The losses
# should agree to rounding: that is the proof that the DDP script trains the same model.

# %% tags=["demo"]
SCRIPT = KIT_ROOT / "solutions" / "train_gpt2_ddp.py"  # or WORKING_COPY: yours
GPUS = torch.cuda.device_count()
# two ranks cannot share one GPU
NPROC, DEVICE = (GPUS, "auto") if GPUS >= 2 else (2, "cpu")
# GPUs: keep them busy
RUN_PRESET = presets.get_preset("small" if DEVICE == "auto" else "tiny")
MICROBATCH_TOKENS = RUN_PRESET.micro_batch * RUN_PRESET.seq_len
GLOBAL_BATCH = MICROBATCH_TOKENS * NPROC
RUNS = Path("runs")
STEPS = 40 if LONGER_RUNS else 20  # per run, at the global batch


def train(name, processes, batch_tokens, steps, *flags):
    """Run the DDP stage (plain python for 1 process, torchrun for more); return its
    metrics."""
    out = RUNS / name
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time the cell runs
    launcher = torchrun(processes) if processes > 1 else [sys.executable]
    command = launcher + [str(SCRIPT), "--preset", RUN_PRESET.name, "--device", DEVICE,
                          "--data", str(DATA),
                          "--out", str(out), "--batch-tokens", str(batch_tokens),
                          "--max-steps", str(steps), "--eval-interval", str(steps),
                          "--sample-tokens", "0", *flags]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    shown = " ".join(Path(word).name if os.sep in word else word for word in command)
    summary = [line for line in result.stdout.splitlines()
               if "processes" in line or "grad_accum" in line]
    print("\n  ".join([f"$ {shown}", *summary, result.stdout.splitlines()[-1]]))
    return runs.read_metrics(out)


one = train("strong-1", 1, GLOBAL_BATCH, STEPS)
many = train(f"strong-{NPROC}", NPROC, GLOBAL_BATCH, STEPS)

# %% tags=["demo"]
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot([r["step"] for r in one], [r["loss"] for r in one],
        label="1 process, grad_accum")
ax.plot([r["step"] for r in many], [r["loss"] for r in many], "--",
        label=f"{NPROC} processes (DDP)")
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.set_title(f"same global batch: {GLOBAL_BATCH:,} tokens per step")
ax.legend()
plt.show()
print(f"largest loss difference over {len(one)} steps: "
      f"{max(abs(a['loss'] - b['loss']) for a, b in zip(one, many)):.1e}")

# %% [markdown]
# ## Strong and weak scaling
#
# - **Strong scaling**: the same job (the same global batch) on $N$ processes. Speedup
#   $S = \text{throughput}_N / \text{throughput}_1$, efficiency $E = S / N$. Each process does
#   $1/N$ of the work, so fixed costs (communication, Python, small kernels) weigh more and more.
# - **Weak scaling**: the same work *per process* (one microbatch each), so the global batch
#   grows with $N$. Efficiency $E_w = \text{throughput}_N / (N \times \text{throughput}_1)$ with
#   the 1-process run at one microbatch per step. This is how data parallelism is normally used:
#   more GPUs, bigger global batch.
#
# Throughput is tokens per second, the median of the steps after a short warm-up, from each run's
# own `metrics.jsonl`. Lesson 00's speedup and efficiency apply, with throughputs in place of
# times.

# %% [markdown]
# The weak-scaling baseline is one process at one microbatch per step. It runs $N$ times as many
# steps ($N$ = `NPROC`, the number of processes of the runs above), so that it sees as many
# tokens as they do; we use it again in the next section.

# %% tags=["demo"]
small_batch = train("weak-1", 1, MICROBATCH_TOKENS, STEPS * NPROC)


def throughput(metrics, warmup=5):
    return statistics.median(r["tok_per_s"] for r in metrics[warmup:])


speedup = throughput(many) / throughput(one)  # the same steps: time 1 / time N
efficiency = speedup / NPROC
weak = throughput(many) / (NPROC * throughput(small_batch))  # N times the work per step
device = "GPUs" if DEVICE == "auto" else "CPU processes"
print(f"{'1 process, ' + f'{GLOBAL_BATCH:,}-token steps':36s} "
      f"{throughput(one):8,.0f} tok/s")
print(f"{f'{NPROC} {device}, the same steps':36s} {throughput(many):8,.0f} tok/s -> "
      f"strong scaling: speedup {speedup:.2f}, efficiency {efficiency:.0%}")
print(f"{'1 process, ' + f'{MICROBATCH_TOKENS:,}-token steps':36s} "
      f"{throughput(small_batch):8,.0f} tok/s -> "
      f"weak scaling efficiency of {NPROC} processes: {weak:.0%}")

# %% [markdown]
# The same runs in the scaling calculator: the time of a step is one over its throughput, so the
# measured speedup gives the serial fraction that Amdahl's law needs to explain it. Move the
# processes slider to see what that fraction would cost on a whole node or a rack.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *A slow run means a slow network.* Exercise 4 asks for the evidence; let trainees
# argue from the table before anyone gives an answer.
# :::

# %% tags=["demo"]
widgets.scaling_calculator({1: 1 / throughput(one), NPROC: 1 / throughput(many)})

# %% [markdown]
# On a laptop CPU these numbers are humbling, and honestly so: one process already uses every core
# through PyTorch's threads, and `torchrun` gives each of its processes one thread
# (`OMP_NUM_THREADS=1`), so two processes share the same cores and add communication. The speedup
# stays near 1. On GPUs each process has a device of its own and DDP hides the all-reduce behind
# backward, so efficiency within a node should stay high; across nodes the network decides. The
# lesson is the method: run this section in a GPU session or batch job, measure tokens/s at 1 and
# $N$, compute $S$ and $E$, and find out what the difference costs before asking for more GPUs.
#
# A low efficiency says that something limits the run, not what. Three kinds of evidence say
# what: tokens/s at 1 and $N$ GPUs, as above; how busy the GPUs were (`nvidia-smi`); and where a
# step's time went (the profiler of lesson 06). Here are four runs as an illustration: made-up
# figures of the kind such runs show, not measurements:
#
# | run | GPUs | tok/s, 1 GPU | tok/s, $N$ GPUs | GPUs busy | where a step's time goes at $N$ GPUs |
# |---|---|---|---|---|---|
# | A | 4, one node, NVLink | 110,000 | 422,000 | 97% | forward and backward 91%, optimiser 6%, all-reduce not hidden by backward 3% |
# | B | 16, 4 nodes, 10 Gb/s Ethernet | 110,000 | 520,000 | 30% | forward and backward 33%, waiting for the all-reduce after backward 62% |
# | C | 4, one node; the job asked for 2 CPU cores | 110,000 | 150,000 | 31% | waiting for the next batch from the data loader 66%, forward and backward 30% |
# | D | 8, one node; a 10M-parameter model, one 128-token sample per GPU | 9,000 | 14,000 | 20% | 2.1 ms steps: kernels 0.4 ms, all-reduce 0.3 ms, the rest Python and kernel launches |
#
# **Exercise 4: what limits each run?** Answer `"scales well"`, `"network"`, `"input pipeline"`
# or `"too little work per GPU"` for each.

# %% nbgrader={"grade": false, "grade_id": "limits", "locked": false, "schema_version": 3, "solution": true, "task": false}
limit = {"A": None, "B": None, "C": None, "D": None}
### BEGIN SOLUTION
limit = {"A": "scales well",  # 96% efficiency, the all-reduce hidden behind backward
         # busy 30%, 62% of each step waiting for gradients across Ethernet
         "B": "network",
         # idle GPUs waiting on the data loader with two cores to run it
         "C": "input pipeline",
         "D": "too little work per GPU"}  # fixed costs per step dwarf 0.4 ms of kernels
### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "limits_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
assert set(limit) == {"A", "B", "C", "D"}
assert all(answer in ("scales well", "network", "input pipeline",
                      "too little work per GPU")
           for answer in limit.values()), "answer with one of the four phrases"
### BEGIN HIDDEN TESTS
assert limit == {"A": "scales well", "B": "network", "C": "input pipeline",
                 "D": "too little work per GPU"}
### END HIDDEN TESTS

# %% [markdown]
# ## Large batches: learning rate, warm-up and the generalisation gap
#
# Weak scaling multiplies the global batch by $N$. With the same number of tokens the run now
# takes $N$ times fewer optimiser steps, each with a less noisy gradient. Two consequences:
#
# - **The learning rate must grow.** With SGD the **linear scaling rule** (Goyal et al., 2017)
#   multiplies the learning rate by $k$ when the batch grows by $k$; with Adam the
#   **square-root rule** ($\sqrt{k}$) is the usual starting point. A large learning rate at the
#   start, while the weights are random, makes the loss diverge: a linear **warm-up** over the
#   first steps (here a tenth of the run) lets it grow safely.
# - **A generalisation gap.** Past a critical batch size, more samples per step no longer buy a
#   better step, and very large batches tend to find sharp minima that generalise worse (Keskar
#   et al., 2017). GPT-2 124M's 0.5M tokens per step is well below the critical batch of language
#   models; image classifiers hit it much sooner.
#
# %% [markdown]
# Now the experiment, at the same number of tokens: the small batch (one microbatch per step)
# at the preset's learning rate, the $N$-times larger batch at the same learning rate (the run
# of the scaling section), and the larger batch at the square-root-scaled learning rate. We
# compare the validation loss at the end.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *The learning rate stays when the global batch grows.* Spot it in weak-scaling runs
# whose loss per token falls behind.
# :::

# %% tags=["demo"]
# the square-root rule
scaled_lr = RUN_PRESET.lr * (GLOBAL_BATCH / MICROBATCH_TOKENS) ** 0.5
scaled = train(f"sqrt-lr-{NPROC}", NPROC, GLOBAL_BATCH, STEPS, "--lr",
               f"{scaled_lr:.6g}")
tokens_seen = {"small batch": small_batch, "large batch, same lr": many,
               "large batch, sqrt lr": scaled}
fig, ax = plt.subplots(figsize=(6, 3.5))
for label, metrics in tokens_seen.items():
    batch = MICROBATCH_TOKENS if metrics is small_batch else GLOBAL_BATCH
    ax.plot([r["step"] * batch for r in metrics], [r["loss"] for r in metrics],
            label=label)
    print(f"{label:22s} {len(metrics):3d} steps, final validation loss "
          f"{metrics[-1]['val_loss']:.3f}")
ax.set_xlabel("tokens seen")
ax.set_ylabel("training loss")
ax.legend()
plt.show()
gap = many[-1]["val_loss"] - small_batch[-1]["val_loss"]
won_back = (many[-1]["val_loss"] - scaled[-1]["val_loss"]) / gap
print(f"the sqrt-scaled learning rate wins back {won_back:.0%} of the large batch's "
      f"gap of {gap:.3f}")
assert won_back > 0.25, won_back

# %% [markdown]
# With the same learning rate, the larger batch falls behind at the same number of tokens: it
# took $N$ times fewer steps. Scaling the learning rate wins back a good part of the difference
# (the last line above says how much in this run; the cell checks that it is over a quarter).
# Curves this short are noisy: try `"linear"`, a longer `--warmup-steps`, or a batch 8 times
# larger, and watch where the benefit stops.
#
# ## Under Slurm
#
# The same script runs on a cluster with one task per GPU, either
#
# ```bash
# srun python solutions/train_gpt2_ddp.py                # reads SLURM_PROCID / NTASKS / LOCALID
# srun bash -c 'PET_NODE_RANK="$SLURM_NODEID" exec "$@"' per-node python -m torch.distributed.run \
#      --nnodes=$SLURM_NNODES --nproc-per-node=4 --master-addr=$MASTER_ADDR \
#      --master-port=$MASTER_PORT solutions/train_gpt2_ddp.py
# ```
#
# with `MASTER_ADDR` the first host of the allocation
# (`scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1`) and `MASTER_PORT` a port free
# there (`python -m coursekit free-port`). The second form is torchrun's **static rendezvous**:
# one torchrun per node, each told its node's rank (torchrun reads `--node-rank` from
# `PET_NODE_RANK`, which each node's own shell sets from `$SLURM_NODEID`). NCCL is chosen
# automatically for GPU tensors. The kit's batch files (lesson 00 and `batchfiles/`) set all of
# this up; a pre-empted job gets SIGUSR1, every rank agrees to stop, rank 0 checkpoints and
# `--resume` continues with the same data order.
#
# One caution before you run on a shared cluster: `torch.distributed` trusts its network. Many
# tutorials launch with torchrun's c10d rendezvous, the job id as its id: that rendezvous keeps
# its state in a store on the first node that accepts any connection, without a password, and
# unpickles the state at every check, so whoever reaches the port and knows the id (the job id is
# public) can run code in your job. torchrun's standalone mode, on one machine, uses the same
# rendezvous with a random id and port, and that protects nothing: another user of the node finds
# the port with `ss` and reads the id from the store, which lists its keys to anyone. The static
# rendezvous above keeps no pickled state, and the kit sends numbers between ranks as tensors
# rather than pickled objects. The collectives still accept any connection that reaches their
# ports; PyTorch's security policy says as much: distributed training belongs on private
# networks. Clusters make that true with compute networks users cannot reach from elsewhere, and
# nodes that are not shared between users while a job runs; the cluster chapter says what to ask
# your centre.
#
# The batch-file builder shows the file the kit's generator writes for a site, a stage and a
# shape: pick your cluster's profile, 2 nodes and its GPUs per node, and read how the job finds
# its rendezvous host, starts `torchrun` on every node and requeues itself when pre-empted.

# %% tags=["demo"]
widgets.batchfile_builder(site="ci", stage="ddp")

# %% [markdown]
# ## Key points
#
# - Data parallelism: every rank holds the model, computes the gradient of its share, and one
#   all-reduce (sum / $N$) gives all ranks the gradient of the global batch.
# - DDP all-reduces gradient buckets while backward is still running; `no_sync()` skips the
#   all-reduce for all but the last accumulated microbatch.
# - Rank, local rank and world size come from torchrun (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`) or
#   Slurm (`SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS`); the local rank picks the GPU.
# - Rank-strided data: $N$ processes read exactly what one process would, so 1 and $N$ processes
#   at the same global batch give the same losses.
# - Strong scaling keeps the job, weak scaling the work per process; compute speedup and
#   efficiency from measured tokens/s.
# - Bigger global batches need a larger learning rate (linear or square-root rule) with warm-up,
#   and past a critical batch size they stop paying.
