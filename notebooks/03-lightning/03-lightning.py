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
# # 03 · PyTorch Lightning
#
# **Questions.** This lesson answers
# - What can a framework take off my training script, and what stays mine?
# - How do I switch strategies, devices and nodes without touching the model?
#
# **Objectives.** After this lesson you can
# - say what Lightning automates in a training script and what stays your job;
# - split a training script into a `LightningModule` (what to compute) and a `Trainer` (where
#   and how to run it), and compare the DDP stage with the Lightning stage side by side;
# - choose a distribution strategy by flag, and tell which ones need a GPU;
# - run Lightning inside a notebook (`ddp_notebook`) and from a script (`ddp`), and get the same
#   model;
# - resume a killed run from Lightning's checkpoint, and run under Slurm with `srun python` and
#   automatic requeueing.
#
# **Prerequisites.** Lesson 02: ranks, DDP, `no_sync`, the global batch.
#
# **Time.** About 50 minutes: reading, the exercises, and waiting for the cells on a laptop's CPU.
# The time is an estimate; the instructor guide says how it is made.

# %%
import lightning as L
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from IPython.display import HTML, display

from coursekit import KIT_ROOT, data, runs, stages

# %% [markdown]
# The set-up: the standard library's modules the lesson uses, the offline corpus, the lit
# stage imported as a module, and Lightning's start-up notes kept out of the lesson.

# %%
import html
import inspect
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

DATA = KIT_ROOT / "data" / "builtin"
if not (DATA / "meta.json").exists():  # the offline corpus: built in seconds, once
    data.prepare_builtin(DATA)
lit = stages.load("lit")  # solutions/train_gpt2_lit.py, imported as a module
# Lightning's start-up notes go to stderr, and nbgrader scores a test cell that writes
# to stderr as failed: keep Lightning's warnings and errors, drop its notes and a
# deprecation from torch.
for name in ("lightning.pytorch", "lightning.fabric"):
    logging.getLogger(name).setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated")
SCRIPT = KIT_ROOT / "solutions" / "train_gpt2_lit.py"
RUNS = Path("runs")
print(f"lightning {L.__version__}, torch {torch.__version__}; "
      f"GPUs visible: {torch.cuda.device_count()}")

# %% [markdown]
# ## What Lightning automates, and what it does not
#
# The DDP stage spends half its lines on machinery that every training script repeats: finding
# the device, starting the process group, wrapping the model, `no_sync` during accumulation,
# clipping, precision, checkpoints with the loop's position, signals from Slurm. Lightning's
# `Trainer` does all of that, the same way for 1 CPU, 8 GPUs or 64 nodes.
#
# | Lightning does it | it stays your job |
# |---|---|
# | pick the accelerator, start one process per device, set up the process group | the model |
# | wrap the model (DDP, FSDP, DeepSpeed) and move batches to the device | the loss |
# | gradient accumulation, with DDP's `no_sync` and the loss scaled by $1/k$ | the data: what each rank reads |
# | gradient clipping, mixed precision (`precision="bf16-mixed"`) | the optimiser and the learning-rate schedule |
# | checkpoints with optimiser, schedule, loop counters and data position | hyperparameters, and rescaling them for a bigger batch |
# | Slurm: ranks from `SLURM_*`, save and requeue on a signal | checking that $N$ devices train the same model as 1 |
#
# The last row matters: Lightning makes a wrong setting run just as smoothly as a right one.
#
# **Exercise 1.** For each job below, put `True` if Lightning's `Trainer` does it for you in
# this lesson's script, `False` if you must do it yourself.

# %% nbgrader={"grade": false, "grade_id": "automates", "locked": false, "schema_version": 3, "solution": true, "task": false}
lightning_does_it = {
    "wrap the model in DistributedDataParallel": None,
    "skip the all-reduce for accumulated microbatches (no_sync)": None,
    "scale the learning rate when the global batch grows": None,
    "clip the gradient norm": None,
    "give each rank different samples from the kit's own TokenShardLoader": None,
    "save the optimiser state and the step counter in checkpoints": None,
}
### BEGIN SOLUTION
lightning_does_it = {
    "wrap the model in DistributedDataParallel": True,
    "skip the all-reduce for accumulated microbatches (no_sync)": True,
    "scale the learning rate when the global batch grows": False,
    "clip the gradient norm": True,
    "give each rank different samples from the kit's own TokenShardLoader": False,
    "save the optimiser state and the step counter in checkpoints": True,
}
### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "automates_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
assert len(lightning_does_it) == 6
assert all(isinstance(answer, bool) for answer in lightning_does_it.values()), \
    "answer True or False"
### BEGIN HIDDEN TESTS
assert lightning_does_it["wrap the model in DistributedDataParallel"] is True
assert lightning_does_it[
    "skip the all-reduce for accumulated microbatches (no_sync)"] is True
assert lightning_does_it["scale the learning rate when the global batch grows"] is False
assert lightning_does_it["clip the gradient norm"] is True
assert lightning_does_it[
    "give each rank different samples from the kit's own TokenShardLoader"] is False
assert lightning_does_it[
    "save the optimiser state and the step counter in checkpoints"] is True
### END HIDDEN TESTS

# %% [markdown]
# Lightning gives each rank different samples only for a map-style `Dataset` read through a
# `DataLoader`, by adding a `DistributedSampler`. The kit's loader reads a token stream in order
# and shards it by rank itself, as in lesson 02, so that 1 and $N$ processes see the same tokens.
#
# ## LightningModule and Trainer
#
# A **LightningModule** is an `nn.Module` with hooks that say *what* to compute:
# `training_step` returns the loss of one batch, `configure_optimizers` returns the optimiser and
# schedule, `validation_step` evaluates, and `on_*` hooks run at fixed points of the loop. The
# **Trainer** decides *where* and *how*: devices, strategy, precision, accumulation, clipping,
# when to validate and checkpoint. Here are the hooks of the stage script's `LitGPT`:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *Lightning adapts everything to the number of GPUs.* Exercise 1, above, is the
#   moment to find out what it does and does not do; discuss the answers after the
#   deadline.
# - Say, of the section above: what a framework takes over and what stays yours (data,
#   learning rate, checkpoint content).
# :::

# %%
for name, member in vars(lit.LitGPT).items():
    if callable(member) and not name.startswith("_"):
        doc = (member.__doc__ or "").strip().splitlines()
        print(f"LitGPT.{name}{'  # ' + doc[0] if doc else ''}")

# %% [markdown]
# **Exercise 2.** Complete the smallest useful LightningModule: a straight-line fit
# $\hat y = wx + b$. `training_step` returns the mean squared error of the batch
# (`F.mse_loss`); `configure_optimizers` returns SGD with learning rate 0.1. The test cell
# trains it with a Trainer and checks that it finds $w = 3$, $b = 1$.

# %% nbgrader={"grade": false, "grade_id": "module", "locked": false, "schema_version": 3, "solution": true, "task": false}
class StraightLine(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.line = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        ### BEGIN SOLUTION
        return F.mse_loss(self.line(x), y)
        ### END SOLUTION

    def configure_optimizers(self):
        ### BEGIN SOLUTION
        return torch.optim.SGD(self.parameters(), lr=0.1)
        ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "module_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
xs = torch.rand(256, 1)
points = DataLoader(TensorDataset(xs, 3 * xs + 1), batch_size=32, shuffle=True)
fit = StraightLine()
L.Trainer(accelerator="cpu", devices=1, max_epochs=60, logger=False,
          enable_checkpointing=False, enable_progress_bar=False,
          enable_model_summary=False).fit(fit, points)
w, b = fit.line.weight.item(), fit.line.bias.item()
print(f"w = {w:.3f}, b = {b:.3f}")
assert abs(w - 3) < 0.05 and abs(b - 1) < 0.05

# %% [markdown]
# ## DDP and Lightning, side by side
#
# `train_gpt2_lit.py` is not a small diff on the DDP stage: Lightning replaces its training loop.
# What stays is imported rather than copied: the model of `solutions/gpt.py`, and the DDP stage's
# data loader (made iterable for Lightning), optimiser and schedule. So the same preset and seed
# give the same first loss as std and ddp. What the DDP stage does by hand, Lightning does here:
#
# | the DDP stage, by hand | the Lightning stage |
# |---|---|
# | `distributed.setup`, `DDP(model)` | `Trainer(strategy=..., devices=..., num_nodes=...)` |
# | `forward_backward`: forward, loss, backward | `training_step` returns the loss |
# | the microbatch loop with `no_sync()` | `accumulate_grad_batches` |
# | `clip_grad_norm_`, bf16 `autocast` | `gradient_clip_val`, `precision="bf16-mixed"` |
# | the learning rate set each step | a `LambdaLR` schedule from `configure_optimizers` |
# | `save_checkpoint`, `resume` | a `ModelCheckpoint` callback, `fit(ckpt_path=...)` |
# | the stop signal, checkpoint and exit | Lightning's Slurm plug-in: checkpoint and requeue |
# | the loss averaged over ranks | `self.trainer.strategy.reduce` |
#
# Two of these, the step itself and the logging of a step, next to each other:

# %% tags=["demo"]
ddp = stages.load("ddp")


def side_by_side(left, right):
    """Two functions' source, left and right, as the book and JupyterLab show HTML."""
    columns = "".join(f"<td style='vertical-align:top'><pre>"
                      f"{html.escape(inspect.getsource(f))}"
                      "</pre></td>" for f in (left, right))
    display(HTML(f"<table><tr>{columns}</tr></table>"))


side_by_side(ddp.forward_backward, lit.LitGPT.training_step)
side_by_side(ddp.main, lit.LitGPT.on_train_batch_end)

# %% [markdown]
# ## The Trainer and strategies by flag
#
# `make_trainer` in the script is one call: accelerator and devices, `num_nodes`, `strategy`,
# precision, `max_steps`, `accumulate_grad_batches` (Lightning counts microbatches), clipping,
# validation every `eval_interval` steps, and a `ModelCheckpoint` callback. The strategy is a
# flag of the script:
#
# | `--strategy` | what it does | needs |
# |---|---|---|
# | `auto` | DDP when there are several devices, else one device | |
# | `ddp` | one process per device, started by Lightning or by `srun` | |
# | `ddp_notebook` | the same, forked from a notebook kernel | not from a script |
# | `fsdp` | shards parameters, gradients and optimiser state (lesson 04) | GPUs |
# | `deepspeed_stage_1/2/3` | ZeRO: optimiser state / + gradients / + parameters sharded | GPUs and `pip install deepspeed` |
#
# **Exercise 3.** Write `cpu_trainer(devices, grad_accum, max_steps)`: a Trainer on CPU with
# `devices` processes (strategy `ddp_notebook` when there are several, since we are in a
# notebook; `auto` for one), accumulating `grad_accum` microbatches per step, clipping the
# gradient norm at 1.0, stopping after `max_steps` steps, with no logger.

# %% nbgrader={"grade": false, "grade_id": "trainer", "locked": false, "schema_version": 3, "solution": true, "task": false}
def cpu_trainer(devices, grad_accum, max_steps):
    ### BEGIN SOLUTION
    return L.Trainer(accelerator="cpu", devices=devices,
                     strategy="ddp_notebook" if devices > 1 else "auto",
                     accumulate_grad_batches=grad_accum, gradient_clip_val=1.0,
                     max_steps=max_steps, logger=False)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "trainer_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
trainer = cpu_trainer(2, 4, 50)
assert (trainer.num_devices, trainer.accumulate_grad_batches,
        trainer.max_steps) == (2, 4, 50)
assert trainer.gradient_clip_val == 1.0 and trainer.logger is None
assert (type(trainer.strategy).__name__ == "DDPStrategy"
        and trainer.strategy._start_method == "fork")
### BEGIN HIDDEN TESTS
single = cpu_trainer(1, 1, 7)
assert (single.num_devices, single.world_size, single.max_steps) == (1, 1, 7)
assert type(single.strategy).__name__ == "SingleDeviceStrategy"
assert single.accelerator.__class__.__name__ == "CPUAccelerator"
### END HIDDEN TESTS

# %% [markdown]
# A setting that cannot run is refused in one line before anything starts: a global batch that
# does not split over the processes, and (on a machine without a GPU) FSDP.

# %% tags=["demo"]
refusals = [["--devices", "3"]]
if not torch.cuda.is_available():  # with GPUs, this would start a real FSDP run
    refusals.append(["--strategy", "fsdp", "--devices", "2"])
for flags in refusals:
    refused = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--data",
                              str(DATA), "--out", str(RUNS / "refused"), *flags],
                             capture_output=True, text=True)
    print(f"$ python train_gpt2_lit.py {' '.join(flags)}\n"
          f"  exit {refused.returncode}: {refused.stderr.strip()}")

# %% [markdown]
# ## Inside a notebook: `ddp_notebook`; from a script: `ddp`
#
# A Jupyter kernel is one long-lived process, so Lightning cannot start the script again once per
# device as it does for `ddp`. `ddp_notebook` *forks* the kernel instead: the children share
# everything defined so far. Two rules follow: the work must happen inside `trainer.fit`, and
# CUDA must not be initialised in the kernel before the fork. The stage script's `main` takes its
# arguments as a list, so the kernel can run it directly, on 2 processes:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *`ddp_notebook` and `ddp` are interchangeable.* Spot it in "cannot re-initialise CUDA
# in a forked subprocess". A notebook forks; a script under Slurm starts one process per
# task.
# :::

# %% tags=["demo"]
# 2 GPUs, or 2 CPU processes
DEVICE = "auto" if torch.cuda.device_count() >= 2 else "cpu"
# GPUs: a model that keeps them busy
RUN_PRESET = "small" if DEVICE == "auto" else "tiny"
STEPS = ["--preset", RUN_PRESET, "--device", DEVICE, "--data", str(DATA), "--max-steps",
         "12", "--eval-interval", "6", "--ckpt-interval", "6", "--sample-tokens", "0",
         "--devices", "2"]
shutil.rmtree(RUNS / "notebook", ignore_errors=True)
start = time.perf_counter()
lit.main(STEPS + ["--strategy", "ddp_notebook", "--out", str(RUNS / "notebook")])
print(f"ddp_notebook: {time.perf_counter() - start:.0f} s")

# %% [markdown]
# From a terminal or a batch job the script runs with `ddp` (the default with several devices):
# Lightning starts the second process itself by running the same command line again with
# `LOCAL_RANK=1`. One thread per process keeps the two processes off each other's core on a
# laptop, and makes the runs repeat bit for bit.

# %% tags=["demo"]
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_script(name, *flags, check=True):
    out = RUNS / name
    command = [sys.executable, str(SCRIPT), *STEPS, "--out", str(out), *flags]
    result = subprocess.run(command, capture_output=True, text=True, env=ONE_THREAD)
    if check and result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return result


shutil.rmtree(RUNS / "script", ignore_errors=True)
start = time.perf_counter()
print(run_script("script").stdout)
print(f"ddp from the script: {time.perf_counter() - start:.0f} s")

# %% tags=["demo"]
in_kernel, from_script = (runs.read_metrics(RUNS / "notebook"),
                          runs.read_metrics(RUNS / "script"))
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot([r["step"] for r in in_kernel], [r["loss"] for r in in_kernel],
        label="ddp_notebook (kernel)")
ax.plot([r["step"] for r in from_script], [r["loss"] for r in from_script], "--",
        label="ddp (script)")
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.legend()
plt.show()
print(f"largest loss difference: "
      f"{max(abs(a['loss'] - b['loss']) for a, b in zip(in_kernel, from_script)):.1e}")

# %% [markdown]
# ## Checkpoints and resuming
#
# `ModelCheckpoint` writes `ckpt/step_NNNNNNNN.ckpt` every `--ckpt-interval` steps and points
# `ckpt/last.ckpt` at the newest. A Lightning checkpoint holds the weights, the optimiser and
# schedule, the loop counters, and the state of the data loader (our loader has `state_dict`,
# so Lightning saves its position). It is loaded with `weights_only=True`: no code is unpickled.

# %% tags=["demo"]
checkpoint = torch.load(RUNS / "script" / "ckpt" / "last.ckpt", weights_only=True)
print(sorted(checkpoint))
print("step:", checkpoint["global_step"])
print("data position:",
      checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"])

# %% [markdown]
# Now a failure: the same run, killed without warning (as when a node dies) after step 8. Its
# last checkpoint is from step 6. `--resume` continues from it; steps 7 to 12 of the resumed
# run should repeat those of the uninterrupted run exactly.

# %% tags=["demo"]
shutil.rmtree(RUNS / "killed", ignore_errors=True)
job = subprocess.Popen([sys.executable, str(SCRIPT), *STEPS, "--out",
                        str(RUNS / "killed")],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=ONE_THREAD,
                       # its own process group: both ranks die together
                       start_new_session=True)
while len(runs.read_metrics(RUNS / "killed")) < 8 and job.poll() is None:
    time.sleep(0.1)
os.killpg(job.pid, signal.SIGKILL)
job.wait()
killed_at = runs.read_metrics(RUNS / "killed")[-1]["step"]
last_checkpoint = (RUNS / "killed" / "ckpt" / "last.ckpt").resolve().name
print(f"killed after step {killed_at}; last checkpoint {last_checkpoint}")
resumed = run_script("killed", "--resume")
print("\n".join(line for line in resumed.stdout.splitlines()
                if line.startswith("step")))
same = ([(r["step"], r["loss"], r.get("val_loss"))
         for r in runs.read_metrics(RUNS / "killed")]
        == [(r["step"], r["loss"], r.get("val_loss")) for r in from_script])
print(f"resumed run identical to the uninterrupted one: {same}")
# What this shows is checked too (the kit's tests run the lesson under nbval). On CPU
# the resumed run is the uninterrupted one bit for bit; on GPUs, atomic adds in the
# backward pass (the embedding's gradient) change the last bits of any run, so there the
# losses agree to 1e-4.
assert job.returncode == -signal.SIGKILL and 6 < killed_at < 12
assert (last_checkpoint == "step_00000006.ckpt"
        and resumed.stdout.count("step 7/12 ") == 1)
assert "step 6/12 " not in resumed.stdout
assert same or DEVICE != "cpu" and max(abs(a["loss"] - b["loss"]) for a, b in zip(
    runs.read_metrics(RUNS / "killed"), from_script, strict=True)) < 1e-4

# %% [markdown]
# ## Lightning under Slurm
#
# In a batch job, Slurm starts the processes and Lightning only joins them: one task per device,
# with the Trainer's `devices` equal to `--ntasks-per-node` and `num_nodes` to `--nodes`. Here is
# the batch file the kit's generator writes for a generic cluster with 4 GPUs per node (the same
# generator writes every site's, and the kit's tests run its CI site's on a real Slurm cluster):

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *The Trainer's devices and nodes can differ from the batch file's.* Spot it in jobs
# that hang at start-up. They must equal `--ntasks-per-node` and `--nodes`.
# :::

# %% tags=["demo"]
lit_batch_file = (KIT_ROOT / "batchfiles" / "generic" / "batch-lit-2n4g.sh").read_text()
print("\n".join(line for line in lit_batch_file.splitlines()
                if line.startswith(("#SBATCH", "srun", "    ", "trap", "  scontrol"))))

# %% [markdown]
# Slurm sends `SIGUSR1` to the batch shell (`B:`) 180 s before the time limit; the shell passes
# it on to every training process with `scancel --signal=USR1`. Lightning's `SLURMEnvironment`
# reads the ranks from `SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NODEID` and `SLURM_NTASKS`, takes
# the first host of `SLURM_NODELIST` as the main address and derives the port from the job id.
# On `SIGUSR1` it saves `hpc_ckpt_N.ckpt` in the run directory, and the job is requeued; the
# script's `--resume` takes the newer of that and `ckpt/last.ckpt`. Here is what it reads for
# rank 5 of a 2-node, 8-GPU job:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# Say here: requeue as a normal event on a shared cluster.
# :::

# %% tags=["demo"]
from unittest import mock

from lightning.fabric.plugins.environments import SLURMEnvironment

rank_5_of_8 = {"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2",
               "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
               "SLURM_NODELIST": "gpu[017-018]", "SLURM_JOB_ID": "4242",
               "SLURM_JOB_NAME": "gpt2"}
with mock.patch.dict(os.environ, rank_5_of_8):
    slurm = SLURMEnvironment()
    print(f"detected: {SLURMEnvironment.detect()}; world size {slurm.world_size()}, "
          f"global rank {slurm.global_rank()}, local rank {slurm.local_rank()}, "
          f"node {slurm.node_rank()}, "
          f"main address {slurm.main_address}:{slurm.main_port}, "
          f"requeue on {slurm.requeue_signal!r}")

# %% [markdown]
# **Exercise 4.** Write `trainer_shape(sbatch)`: from a dictionary of a batch file's `#SBATCH`
# options (`"nodes"`, `"ntasks-per-node"`, `"gpus-per-node"`, as integers) return the Trainer's
# `(devices, num_nodes)`. Lightning needs one task per GPU: raise `ValueError` when the tasks per
# node and the GPUs per node differ.

# %% nbgrader={"grade": false, "grade_id": "slurm_shape", "locked": false, "schema_version": 3, "solution": true, "task": false}
def trainer_shape(sbatch):
    ### BEGIN SOLUTION
    if sbatch["ntasks-per-node"] != sbatch["gpus-per-node"]:
        raise ValueError(f"--ntasks-per-node={sbatch['ntasks-per-node']} must equal "
                         f"--gpus-per-node={sbatch['gpus-per-node']}: one task per GPU")
    return sbatch["gpus-per-node"], sbatch["nodes"]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "slurm_shape_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
assert trainer_shape({"nodes": 2, "ntasks-per-node": 4, "gpus-per-node": 4}) == (4, 2)
### BEGIN HIDDEN TESTS
assert trainer_shape({"nodes": 1, "ntasks-per-node": 1, "gpus-per-node": 1}) == (1, 1)
assert trainer_shape({"nodes": 16, "ntasks-per-node": 8, "gpus-per-node": 8}) == (8, 16)
try:
    trainer_shape({"nodes": 2, "ntasks-per-node": 1, "gpus-per-node": 4})
    raise AssertionError("one task for four GPUs must raise ValueError")
except ValueError:
    pass
### END HIDDEN TESTS

# %% [markdown]
# ## Key points
#
# - Lightning's Trainer runs the loop: devices and processes, DDP and `no_sync`, accumulation,
#   clipping, precision, checkpoints, Slurm. The model, the loss, the data and the
#   hyperparameters stay yours, and so does checking that $N$ devices train the same model as 1.
# - A LightningModule says what to compute (`training_step`, `configure_optimizers`, hooks); the
#   Trainer says where and how.
# - The strategy is a flag: `ddp` from scripts and `srun`, `ddp_notebook` inside a kernel, `fsdp`
#   and DeepSpeed on GPUs.
# - A Lightning checkpoint holds weights, optimiser, schedule, loop counters and the data
#   position; a killed run resumes exactly.
# - Under Slurm: one task per device, `srun python`, devices = tasks per node; `--signal=SIGUSR1`
#   and `--requeue` let Lightning save and requeue before the time limit.
