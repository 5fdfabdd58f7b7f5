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
# # 06 · MLOps: tracking, reproducibility, the registry, monitoring and profiling
#
# **Questions.** This lesson answers
# - How do I keep track of hundreds of runs, and compare them?
# - What does a run need to be reproduced, and how do I check that it is?
# - How do I share a model safely, and watch a job that is running?
#
# **Objectives.** After this lesson you can
# - log a run's parameters, per-step metrics, system information and artifacts to MLflow with
#   `--track mlflow`, and find them again from Python;
# - compare runs: their metric histories side by side, a table of parameters against results, and
#   the best run picked by code;
# - open the MLflow UI on a cluster without exposing it to the network: a batch job and an SSH
#   tunnel, or a terminal in Open OnDemand;
# - make a run reproducible and check that it is: seeds, deterministic algorithms, the environment,
#   the git commit, and a data manifest that `verify-data` compares with the data;
# - say why loading a pickled checkpoint can run code, and store weights safely (safetensors,
#   `torch.load(weights_only=True)`);
# - register a model in MLflow's model registry under an alias, and load it back by that alias;
# - watch a job's GPU (or CPU) utilisation and memory, and profile a few training steps with
#   `torch.profiler`.
#
# **Prerequisites.** Lesson 01: the std stage and its run directory (`config.json`,
# `metrics.jsonl`, checkpoints) and MFU. Lesson 03 for Lightning's callbacks, lesson 05 for the
# Hugging Face model format.
#
# **Time.** About 70 minutes, in two parts of about 45 and 30 (the end of part 1 is marked):
# reading, the exercises, and waiting for the cells on a laptop's CPU. The times are estimates; the
# instructor guide says how they are made.

# %%
import matplotlib.pyplot as plt
import mlflow
import psutil
import torch
from IPython.display import Markdown, display
from mlflow import MlflowClient
from safetensors.torch import load_file, save_file
from torch.profiler import ProfilerActivity, profile, record_function
from transformers.utils import logging as transformers_logging

from coursekit import (KIT_ROOT, data, distributed, hfexport, presets, registry, runs,
                       stages)
from solutions import gpt

# %% [markdown]
# The set-up: the standard library's modules the lesson uses, the offline corpus, a fresh
# folder for everything the lesson writes, and quieter libraries.

# %%
import contextlib
import hashlib
import io
import json
import logging
import os
import pickle
import pickletools
import shutil
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

DATA = KIT_ROOT / "data" / "builtin"
if not (DATA / "meta.json").exists():  # the offline corpus: built in seconds, once
    data.prepare_builtin(DATA)
# MLflow keeps the database open: deleting it now would break the lesson
if "STORE" in globals():
    raise RuntimeError("to run the lesson again, restart the kernel first (Kernel, "
                       "Restart Kernel and Run All Cells)")
# everything this lesson writes: runs, the MLflow store, copies, a trace
RUNS = Path("runs")
shutil.rmtree(RUNS, ignore_errors=True)  # a fresh store each time the lesson runs
RUNS.mkdir()
EXPERIMENT = "06-mlops"  # the MLflow experiment (a named group of runs) of this lesson
# Progress bars and MLflow's notes on creating its database would clutter the lesson.
os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
logging.getLogger("mlflow").setLevel(logging.WARNING)
transformers_logging.disable_progress_bar()
print(f"torch {torch.__version__}, mlflow {mlflow.__version__}; "
      f"data {DATA.relative_to(KIT_ROOT)}")

# %% [markdown]
# ## Tracking runs
#
# Lessons 01 to 05 read one run at a time from its run directory. A project makes hundreds of
# runs: other learning rates, presets, numbers of GPUs, code versions. **Experiment tracking**
# keeps them in one searchable place, each with everything needed to understand and repeat it:
#
# - **parameters**: the whole configuration (`args.lr`, `preset.name`, `model.n_layer`, ...);
# - **metrics**: every step's loss, learning rate, gradient norm, step time, tokens/s, MFU, and
#   the validation loss;
# - **tags**: where and how it ran (stage, world size, device, PyTorch version, host, Slurm job,
#   git commit, the data's manifest);
# - **artifacts**: files (`config.json`, `metrics.jsonl`, the loss plot, the installed packages,
#   the final checkpoint).
#
# Every stage script takes `--track {none,mlflow,tensorboard}`. With `mlflow`, the first process
# (rank 0) logs to the server named by `MLFLOW_TRACKING_URI` or, when it is unset, to a SQLite
# file next to the run directory, `RUN_DIR/../mlflow.db`, with the artifacts in
# `RUN_DIR/../mlartifacts`: a single file on any shared file system, no server needed. The run is
# named after its directory, the experiment comes from `MLFLOW_EXPERIMENT_NAME` (default
# "coursekit"), and `RUN_DIR/tracking.json` remembers the run's id, so that `--resume` continues
# the same MLflow run.
#
# Two short runs of the std stage that differ only in their peak learning rate, 12 steps of 256
# tokens each (2 samples of 128), started side by side as two jobs of a sweep would be. Both log
# to the same store and experiment, so the experiment is created first: two runs that both find
# it missing would both try to create it, and one would fail. Each process gets its share of the
# cores through `OMP_NUM_THREADS`, as a Slurm job's batch file sets it from `--cpus-per-task`:
# PyTorch otherwise starts one thread per core in every process, and threads that outnumber the
# cores wait for each other, several times slower. While the runs train, the notebook samples
# each process's CPU use and memory with `psutil` (plotted in the monitoring section below).

# %% tags=["demo"]
SCRIPT = KIT_ROOT / "solutions" / "train_gpt2_std.py"
STEPS = 12
LEARNING_RATES = {"lr-1e-3": 1e-3, "lr-6e-3": 6e-3}
# RUN_DIR/../mlflow.db of runs in RUNS
STORE = f"sqlite:///{(RUNS / 'mlflow.db').resolve()}"
client = MlflowClient(STORE)  # creates the database on first use
client.create_experiment(EXPERIMENT,
                         artifact_location=(RUNS / "mlartifacts").resolve().as_uri())
THREADS = max(1, (os.cpu_count() or 2) // len(LEARNING_RATES))  # the cores, shared out
CHILD_ENV = {**os.environ, "MLFLOW_EXPERIMENT_NAME": EXPERIMENT,
             "OMP_NUM_THREADS": str(THREADS)}
# this lesson's own store, even where a server is set
CHILD_ENV.pop("MLFLOW_TRACKING_URI", None)


def start(name, lr):
    """Start the std stage with --track mlflow; its output goes to RUNS/<name>.out, as a
    Slurm job's goes to its --output file."""
    command = [sys.executable, SCRIPT, "--preset", "tiny", "--data", DATA, "--out",
               RUNS / name, "--max-steps", STEPS, "--micro-batch", 2,
               "--batch-tokens", 256, "--lr", lr, "--eval-interval", 4,
               "--eval-steps", 2, "--sample-tokens", 0, "--track", "mlflow"]
    with open(RUNS / f"{name}.out", "w") as output:
        return subprocess.Popen(list(map(str, command)), stdout=output,
                                stderr=subprocess.STDOUT, env=CHILD_ENV)


def watch(jobs, interval=0.25):
    """Sample the CPU use (% of one core) and resident memory (bytes) of every job
    until all have ended: {name: [(seconds, cpu, rss), ...]}."""
    processes = {name: psutil.Process(job.pid) for name, job in jobs.items()}
    samples, began = {name: [] for name in jobs}, time.perf_counter()
    for process in processes.values():
        process.cpu_percent()  # the first call starts the measurement
    while any(job.poll() is None for job in jobs.values()):
        time.sleep(interval)
        for name, process in processes.items():
            if jobs[name].poll() is not None:  # this one has ended
                continue
            try:
                samples[name].append((time.perf_counter() - began,
                                      process.cpu_percent(), process.memory_info().rss))
            except psutil.Error:  # it ended just now
                pass
    return samples


jobs = {name: start(name, lr) for name, lr in LEARNING_RATES.items()}
usage = watch(jobs)
run_dirs = {}
for name, job in jobs.items():
    lines = (RUNS / f"{name}.out").read_text().splitlines()
    if job.returncode != 0:
        raise RuntimeError(f"run {name} failed:\n" + "\n".join(lines[-30:]))
    run_dirs[name] = RUNS / name
    print("\n  ".join([f"{name}:"]
                      + [line for line in lines if line.startswith("tracking:")]
                      + lines[-1:]))

# %% [markdown]
# ## Comparing runs from Python
#
# `mlflow.search_runs` returns the runs of some experiments as a pandas DataFrame: one row per
# run, with columns `run_id`, `params.<name>`, `metrics.<name>` (the last value logged) and
# `tags.<name>`. It takes a filter in a small SQL-like language, such as
# ``filter_string="params.`preset.name` = 'tiny' and metrics.val_loss < 10"`` (backquotes around
# a name with dots), and an order, such as `order_by=["metrics.val_loss ASC"]`.
# `MlflowClient` reads the rest: whole metric histories, artifacts, the registry.

# %% tags=["demo"]
assert runs.read_json(run_dirs["lr-1e-3"] / "tracking.json")["tracking_uri"] == STORE
# where search_runs (and MlflowClient() with no URI) look
mlflow.set_tracking_uri(STORE)
found = mlflow.search_runs(experiment_names=[EXPERIMENT]).sort_values(
    "tags.mlflow.runName")
found = found.reset_index(drop=True)
print(f"{len(found)} runs in experiment {EXPERIMENT!r} of {STORE}; each with "
      f"{found.columns.str.startswith('params.').sum()} params, "
      f"{found.columns.str.startswith('metrics.').sum()} metrics and "
      f"{found.columns.str.startswith('tags.').sum()} tags")


def short(value):
    """The start of a commit or hash; a dash where a run did not record it (NaN)."""
    return f"`{value[:12]}`" if isinstance(value, str) else "-"


rows = ["| run | args.lr | steps | final loss | final val_loss | median tok/s "
        "| git commit | data manifest |",
        "|---|---|---|---|---|---|---|---|"]
for _, row in found.iterrows():  # a row's index holds the column names
    tok_per_s = [m.value for m in client.get_metric_history(row["run_id"], "tok_per_s")]
    rows.append(f"| {row['tags.mlflow.runName']} | {row['params.args.lr']} | "
                f"{row['params.args.max_steps']} | {row['metrics.loss']:.3f} | "
                f"{row['metrics.val_loss']:.3f} | "
                f"{statistics.median(tok_per_s):,.0f} | "
                f"{short(row.get('tags.git_commit'))} | "
                f"{short(row['tags.data_manifest_sha256'])} |")
display(Markdown("\n".join(rows)))

# %% tags=["demo"]
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True,
                                  layout="constrained")
for _, row in found.iterrows():
    name = row["tags.mlflow.runName"]
    for ax, metric in ((left, "loss"), (right, "val_loss")):
        history = sorted(client.get_metric_history(row["run_id"], metric),
                         key=lambda m: m.step)
        ax.plot([m.step for m in history], [m.value for m in history],
                "o-" if metric == "val_loss" else "-", label=name)
left.set_title("training loss")
right.set_title("validation loss")
for ax in (left, right):
    ax.set_xlabel("step")
    ax.legend()
left.set_ylabel("loss")
fig.suptitle(f"experiment {EXPERIMENT}: the metric histories MLflow holds")
plt.show()

# %% [markdown]
# The larger learning rate falls faster in so short a run: with 12 steps, the warm-up is one step
# and the cosine decay leaves little time to go wrong. Over a few hundred steps a learning rate
# that is too large shows up instead as spikes or a loss that stops falling; comparing histories,
# not only final numbers, is how you see it.
#
# **Exercise 1.** Write `best_run(found, metric="val_loss")`: the `run_id` of the run with the
# lowest final value of `metric` in a DataFrame returned by `mlflow.search_runs` (column
# `metrics.<metric>`). Runs that did not log the metric have NaN there: they do not count.

# %% nbgrader={"grade": false, "grade_id": "best_run", "locked": false, "schema_version": 3, "solution": true, "task": false}
def best_run(found, metric="val_loss"):
    ### BEGIN SOLUTION
    return found.loc[found[f"metrics.{metric}"].idxmin(), "run_id"]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "best_run_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import pandas as pd  # noqa: E402

table = pd.DataFrame({"run_id": ["r1", "r2", "r3"], "metrics.val_loss": [4.2, 3.9, 4.0],
                      # the columns search_runs returns
                      "metrics.loss": [3.1, 3.6, 2.9]})
assert best_run(table) == "r2" and best_run(table, "loss") == "r3"
### BEGIN HIDDEN TESTS
fake = pd.DataFrame({"run_id": ["a", "b", "c"],
                     "metrics.val_loss": [3.0, float("nan"), 2.5],
                     "metrics.loss": [1.0, 0.5, 2.0]})
assert best_run(fake) == "c" and best_run(fake, "loss") == "b"
assert best_run(fake.iloc[::-1]) == "c" and best_run(fake.iloc[[2, 0]], "loss") == "a"
### END HIDDEN TESTS

# %% [markdown]
# The same on this lesson's two runs: MLflow's table and the runs' own `metrics.jsonl` agree.

# %% tags=["demo"]
final = {runs.read_json(d / "tracking.json")["run_id"]: runs.read_metrics(d)[-1]
         for d in run_dirs.values()}
for metric in ("val_loss", "loss"):
    from_files = min(final, key=lambda run_id: final[run_id][metric])
    print(f"lowest final {metric}: {best_run(found, metric)} in MLflow's table, "
          f"{from_files} in metrics.jsonl")
    assert best_run(found, metric) == from_files

# %% [markdown]
# ## The MLflow UI, and TensorBoard
#
# The same store opens in MLflow's web UI: runs side by side, metric charts, parameters, artifacts,
# the registry. MLflow's plain server has *no login*: anyone who can reach its port can read,
# change and delete every run, and move the `champion` alias. `127.0.0.1` keeps the network out,
# but not the other users of the same machine: on a cluster's shared login and compute nodes they
# reach `127.0.0.1` too. So the kit starts MLflow with its basic-auth app and one account, yours:
#
# ```bash
# python -m coursekit mlflow-server        # from the kit's root: the store is runs/mlflow.db
# ```
#
# picks a free port on `127.0.0.1`, makes a random password the first time and keeps it in
# `runs/mlflow-server/password`, which only you can read (the folder is `0700`), and prints where
# it listens. Log in as your user name with that password. Every request without it gets
# `401 Unauthorized`.
#
# - *On your own machine*: open the printed `http://127.0.0.1:PORT`.
# - **On a cluster, as a batch job.** Not on a login node: the generated batch file
#   `batchfiles/<site>/batch-mlflow-ui.sh` asks for one CPU task for a few hours and runs the same
#   command. Its output file (`mlflow-ui-<job id>.out`) names the node and port, and the tunnel to
#   run *on your laptop*, through the login node to the compute node:
#
#   ```bash
#   sbatch batchfiles/<site>/batch-mlflow-ui.sh      # from the kit's root
#   cat mlflow-ui-<job id>.out                       # on the cluster: prints, for example
#   ssh -N -J you@<login node> -L 31234:127.0.0.1:31234 you@<node>   # on your laptop
#   ```
#
#   then open `http://127.0.0.1:31234`, and `scancel` the job when you are done.
# - **On Open OnDemand.** In this JupyterLab session, open a terminal (File, New, Terminal) and
#   run the same command in the kit's root. The kit's environment includes `jupyter-server-proxy`,
#   so the portal reaches it at the session's address followed by `proxy/PORT/` (such as
#   `https://<portal>/node/<node>/<port>/proxy/31234/`): behind the portal's login, and then
#   MLflow's. Where a site's JupyterLab lacks the proxy, use the SSH tunnel above with the
#   session's node.
#
# A model registered in the store is code as well as weights: MLflow keeps the model's Python
# file with it, and MLflow's own loaders import that copy. `python -m coursekit registry load`
# reads only the weights (safetensors) and JSON files, with the kit's own code; load models with
# MLflow's loaders only from a store that no one else can write.
#
# Tracking to a SQLite file suits one user and a few jobs at a time, as here. Many users, or many
# jobs writing at once (a large sweep), call for a shared MLflow server: set `MLFLOW_TRACKING_URI` to it in
# the jobs (the site profile's `env`), and the stage scripts log there instead.
#
# **TensorBoard** is the lighter alternative: `--track tensorboard` writes event files to
# `RUN_DIR/tensorboard/`, and `tensorboard --logdir runs --host 127.0.0.1 --port 6006` plots every
# run under `runs/` (same tunnel or proxy, port 6006). It shows scalars, text and images per step,
# but has no searchable table of parameters, no artifact store and no registry.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *A server on 127.0.0.1 is private.* Every user of that node reaches it. Run a tracking
# server only where no one else works, your own machine or a node allocated to you
# alone.
# :::

# %% [markdown]
# ## Reproducibility
#
# A result you cannot repeat cannot be checked, debugged or built on. What fixes a run:
#
# | what | why it matters | in the kit |
# |---|---|---|
# | seeds | initial weights, dropout, sampling | `--seed` (1337) seeds PyTorch before the model is built; the loader reads the shards in order, and checkpoints save its position and the RNG states |
# | deterministic kernels | some GPU kernels add in whatever order threads finish (atomics), some cuBLAS and cuDNN algorithms are picked by timing | `torch.use_deterministic_algorithms(True)`, `CUBLAS_WORKSPACE_CONFIG=:4096:8`, `torch.backends.cudnn.benchmark = False` |
# | the environment | another PyTorch or CUDA version computes differently | tags `torch`, `cuda`, `python`; artifact `environment/requirements.txt` |
# | the code | a changed line, even a fixed bug, changes the numbers | tag `git_commit` (`+dirty` when files differ from the commit) |
# | the data | a re-tokenised or truncated shard changes what is learnt | `data_manifest` in `config.json` (the sha256 of every shard), tag `data_manifest_sha256`, `verify-data` |
# | the layout | the number of GPUs and the precision change the order and width of sums | tags `device`, `world_size`; params `precision`, `grad_accum` |
#
# Deterministic mode goes at the top of a training script, before the first GPU operation. It
# costs speed, and an operation with no deterministic implementation then raises an error instead
# of running:
#
# ```python
# os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before the first cuBLAS call
# torch.use_deterministic_algorithms(True)
# torch.backends.cudnn.benchmark = False
# ```
#
# On a CPU, with one thread per process, the kit's runs repeat bit for bit already. One check of
# the seeding: both runs above started from the same weights and saw the same first batch, and the
# first loss is computed before any update, so it must be the same in both. Then why layouts
# matter: floating-point addition is not associative, so the same million numbers summed in
# shards, as an all-reduce over $N$ processes adds them, give slightly different totals.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *The same seed reproduces a run.* The data, the code version and the environment
#   must be the same too; the run records all of them.
# - Say here: what to record so that someone else can rerun a result.
# :::

# %% tags=["demo"]
first = {name: runs.read_metrics(d)[0]["loss"] for name, d in run_dirs.items()}
print(f"step-1 loss of each run: {first}; the same: {len(set(first.values())) == 1}")
numbers = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0))
for n in (1, 2, 3, 4):
    total = torch.zeros(())
    for shard in numbers.chunk(n):
        total += shard.sum()
    print(f"summed in {n} shard(s): {total.item():.7f}")

# %% [markdown]
# The kit captures the rest with every tracked run. The environment is an artifact (beside the
# run's files, its loss plot and final checkpoint), the code version and the data's manifest are
# tags:

# %% tags=["demo"]
# the run with the lowest final validation loss (what best_run finds in MLflow's table)
BEST_NAME = min(run_dirs,
                key=lambda name: runs.read_metrics(run_dirs[name])[-1]["val_loss"])
BEST_DIR = run_dirs[BEST_NAME]
BEST = runs.read_json(BEST_DIR / "tracking.json")["run_id"]
packages = client.download_artifacts(BEST, "environment/requirements.txt", str(RUNS))
pins = Path(packages).read_text().split()
print(f"{len(pins)} packages pinned, such as "
      + ", ".join(p for p in pins
                  if p.split("==")[0].lower() in ("torch", "mlflow", "numpy")))
print(f"artifacts of {BEST_NAME}: "
      f"{', '.join(a.path for a in client.list_artifacts(BEST))}")
tags = client.get_run(BEST).data.tags
for key in ("git_commit", "data_manifest_sha256", "torch", "device", "world_size",
            "host"):
    print(f"  {key:22s} {tags.get(key, '(not recorded)')}")

# %% [markdown]
# `pip install -r requirements.txt` with that file rebuilds the environment (on another machine,
# the PyTorch line may need the site's CUDA or ROCm build instead).
#
# The data is the easiest part to change without noticing: a shard re-tokenised, a file
# truncated by a full disk, a colleague's "cleaned" copy. Each run's `config.json` records the
# data's manifest, the sha256 of every file, and `runs.verify_data` (or `python -m coursekit
# verify-data RUN_DIR [--data DIR]` in a batch job) hashes the files again and names what
# differs. Here it checks the data directory, then a copy in which one token of the validation
# shard is changed.

# %% tags=["demo"]
manifest = runs.read_json(BEST_DIR / "config.json")["data_manifest"]
print(f"manifest of {BEST_DIR.name}: {json.dumps(manifest['files'], indent=1)}")
_, problems = runs.verify_data(BEST_DIR)
print(f"{DATA.relative_to(KIT_ROOT)}: {problems or 'matches the manifest'}")

copy = RUNS / "data-copy"
shutil.copytree(DATA, copy)
shard = bytearray((copy / "val_000000.npy").read_bytes())
shard[-1] ^= 1  # one bit of the last token
(copy / "val_000000.npy").write_bytes(bytes(shard))
_, problems = runs.verify_data(BEST_DIR, copy)
print(f"the copy: {problems}")
check = subprocess.run([sys.executable, "-m", "coursekit", "verify-data", str(BEST_DIR),
                        "--data", str(copy)], capture_output=True, text=True)
print(f"$ python -m coursekit verify-data {BEST_DIR} --data {copy}\n"
      f"{check.stderr.strip()}\n"
      f"exit status {check.returncode}: "
      f"a batch job that runs it first stops before training")

# %% [markdown]
# **Exercise 2.** Write `sha256_manifest(directory)`: a dictionary from the name of every file
# directly in `directory` (not in its sub-folders), except `meta.json`, to the sha256 of the
# file's bytes as a hexadecimal string (`hashlib.sha256(...).hexdigest()`). The test compares it
# with the manifest every run records (`runs.data_manifest`, from the hashes written when the
# data was prepared), and its digest, the sha256 of the dictionary written as JSON with sorted
# keys, with the manifest's own.

# %% nbgrader={"grade": false, "grade_id": "sha256_manifest", "locked": false, "schema_version": 3, "solution": true, "task": false}
def sha256_manifest(directory):
    ### BEGIN SOLUTION
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(Path(directory).iterdir())
            if path.is_file() and path.name != "meta.json"}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "sha256_manifest_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
mine = sha256_manifest(DATA)
# what every run records, from the hashes made with the data
recorded = runs.data_manifest(DATA)
assert mine == recorded["files"]
assert (hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()
        == recorded["sha256"])
### BEGIN HIDDEN TESTS
folder = RUNS / "hidden-manifest"
shutil.rmtree(folder, ignore_errors=True)
(folder / "sub").mkdir(parents=True)
(folder / "a.bin").write_bytes(b"abc")
(folder / "empty.jsonl").write_bytes(b"")
(folder / "meta.json").write_text("{}")
(folder / "sub" / "b.bin").write_bytes(b"b")
from coursekit import exercise  # noqa: E402

# the manifest the kit reads back is not the exercise
with exercise.own_work(runs.data_manifest):
    assert sha256_manifest(DATA) == recorded["files"]
    assert sha256_manifest(folder) == {
        "a.bin": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
        "empty.jsonl":
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"}
    assert sha256_manifest(folder / "sub") == {
        "b.bin": hashlib.sha256(b"b").hexdigest()}
### END HIDDEN TESTS

# %% [markdown]
# Your manifest against the best run's tag, and against the copy with one changed bit:

# %% tags=["demo"]
mine = sha256_manifest(DATA)
digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()
print(f"equal to the run's data_manifest_sha256 tag: "
      f"{digest == tags['data_manifest_sha256']}")
print(f"files that differ in the copy: "
      f"""{[name for name, found_digest in sha256_manifest(copy).items()
            if mine[name] != found_digest]}""")

# %% [markdown]
# ## Checkpoints: pickle and safetensors
#
# `torch.save` writes a zip file whose main part is a **pickle**, Python's format for any object.
# A pickle is a small program: to rebuild an object, it may import any function and call it.
# That is how tensors come back (`torch._utils._rebuild_tensor_v2`), and it is also how a file can
# run anything, `os.system` included, the moment it is loaded. An object chooses what its pickle
# calls with `__reduce__`. A harmless one here: a checkpoint whose extra entry, when unpickled,
# calls `print`.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *Loading a checkpoint is harmless.* A pickle runs code. The kit's own checkpoints are
# safetensors and JSON; the distributed formats that still unpickle are resumed only
# when the run directory is yours and the files match the checkpoint's manifest.
# :::

# %% tags=["demo"]
class Surprise:
    """Pickled as 'call print(...)': a stand-in for a malicious payload."""

    def __reduce__(self):
        return (print, ("this line was printed by torch.load, from inside the "
                        "checkpoint",))


suspicious = RUNS / "suspicious.pt"
torch.save({"weight": torch.ones(2, 3), "extra": Surprise()}, suspicious)
with zipfile.ZipFile(suspicious) as archive:
    program = archive.read(next(n for n in archive.namelist()
                                if n.endswith("data.pkl")))
calls = [arg for op, arg, _ in pickletools.genops(program)
         if op.name in ("GLOBAL", "STACK_GLOBAL")]
print(f"what the pickle imports to rebuild its objects: {calls}")

try:
    torch.load(suspicious, weights_only=True)
except pickle.UnpicklingError as err:
    reason = next(line for line in str(err).splitlines()
                  if "Unsupported global" in line)
    print(f"weights_only=True refused it: {reason.strip()[:110]}...")
print("weights_only=False ran it:")
print(f"  and returned {torch.load(suspicious, weights_only=False)}")

# %% [markdown]
# Since PyTorch 2.6, `torch.load` defaults to `weights_only=True`: an unpickler that allows only
# tensors, plain containers and numbers, and refuses every other import. Keep it that way; pass
# `weights_only=False` only for a file you made yourself, and never for one downloaded or shared.
#
# **safetensors** removes the question: the file is an 8-byte length, a JSON header (every
# tensor's name, dtype, shape and byte range), then the raw bytes. Loading it reads numbers and
# nothing else, and it can be memory-mapped, so loading is also fast. It holds only tensors; the
# kit's checkpoints put them in `tensors.safetensors` and everything else (step, data position,
# the optimiser's hyperparameters) in `state.json`.

# %% tags=["demo"]
weights = RUNS / "weights.safetensors"
save_file({"weight": torch.ones(2, 3), "bias": torch.zeros(3)}, weights)
raw = weights.read_bytes()
header_length = int.from_bytes(raw[:8], "little")
print(f"{len(raw)} bytes: an 8-byte length, then the header "
      f"{raw[8:8 + header_length].decode()}")
print(f"loaded back: {sorted(load_file(weights))}")
try:
    save_file({"extra": Surprise()}, RUNS / "refused.safetensors")
except ValueError as err:
    print(f"safetensors refuses anything else: {err}")

checkpoint = runs.latest_checkpoint(BEST_DIR)
tensors = load_file(checkpoint / "tensors.safetensors")
state = runs.read_json(checkpoint / "state.json")
print(f"{BEST_DIR.name}'s checkpoint {checkpoint.name}: {len(tensors)} tensors "
      f"({sum(t.numel() for t in tensors.values()):,} numbers: "
      f"weights and Adam's two states) "
      f"and state.json with {sorted(state['state'])}")

# %% [markdown]
# Lightning's `.ckpt` files and many checkpoints on the hub are pickles: load them with
# `weights_only=True` (lesson 03 does), and prefer `.safetensors` files where a model offers
# them. Some formats cannot avoid pickle: PyTorch's distributed checkpoints (lesson 04's fsdp, tp
# and pp stages) read their `.metadata` file with it, and DeepSpeed's ZeRO states (lesson 05)
# load with `weights_only=False`. For those, what matters is *who could have written the file*.
# Every stage creates its run directory readable by you alone, writes `manifest.json` (the
# SHA-256 of every file) into each checkpoint it publishes, and on `--resume` refuses, in one
# line, a checkpoint that another user owns or could write; one whose files no longer match the
# manifest is never loaded (the resume warns and takes the checkpoint before it). The same rule
# runs through MLflow below: the kit logs its registered model *as code* (a Python file MLflow's
# own loaders import), and `registry load` reads only its weights and JSON files.
#
# ## The model registry
#
# Tracking records every run; the **registry** names the models worth using. A registered model
# (`kit-std`) has numbered *versions*, each made from one run's files, and **aliases** that point
# at versions: `champion` for the one in use, `challenger` for the one being tested. Whoever
# loads `models:/kit-std@champion` (an evaluation job, a demo, a serving container) gets the new
# model when the alias moves, without changing any code, and every version leads back to the run
# that made it: its parameters, metrics, commit and data.
#
# The kit registers Hugging Face model directories. A std run becomes one with
# `python -m coursekit export-hf RUN_DIR OUT_DIR` (lesson 05), and
# `python -m coursekit registry register RUN_DIR --name kit-std --alias champion --model-dir OUT_DIR`
# logs it into the run's own MLflow run. The same two steps in Python, for the best run:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# Say here: lineage from a registered model back to the data and code.
# :::

# %% tags=["demo"]
hf_dir = RUNS / "hf-champion"
exported = hfexport.export(BEST_DIR, hf_dir)
# MLflow's notes and advice on type hints
with contextlib.redirect_stderr(io.StringIO()):
    store, version = registry.register(BEST_DIR, "kit-std", "champion",
                                       model_dir=hf_dir)
    champion = registry.load("kit-std@champion", STORE)
entry = client.get_model_version_by_alias("kit-std", "champion")
print(f"{BEST_DIR.name} at step {exported['step']} -> "
      f"registered model kit-std version {version}, "
      f"alias champion")
print(f"the version leads back to run {entry.run_id[:12]} "
      f"({client.get_run(entry.run_id).info.run_name}), "
      f"the best run: {entry.run_id == BEST}")
prompts = ["The", "def"]
for prompt, completion in zip(prompts,
                              champion.predict(prompts, params={"max_new_tokens": 8})):
    print(f"{prompt!r} -> {completion!r}")

# %% [markdown]
# Twelve steps teach the model little beyond the commonest tokens; the point is the path, which
# is the same for lesson 05's fine-tuned models (`registry register RUN_DIR` takes the
# fine-tuning run's merged `model/` by default). Promoting another version is one call,
# `client.set_registered_model_alias("kit-std", "champion", new_version)`, and from a shell
# `python -m coursekit registry load kit-std@champion --store STORE --prompt "The"`.
#
# *End of part 1. Part 2, monitoring and profiling a job, can follow after a break or in the next
# session.*
#
# ## Monitoring a job: utilisation and memory
#
# A training job that uses 40% of its GPUs wastes 60% of its allocation. Two numbers tell most of
# the story: **utilisation** (the share of time a kernel was running) and *memory used*. Low
# utilisation means the GPU waits: for data, for communication, for Python or for small kernels.
# Memory near the limit means the next larger batch runs out of memory; memory far below it means
# room for a larger microbatch.
#
# On a GPU node, sample them in the background of the batch file, next to the training step, as
# the kit's generated GPU batch files do (here a generic cluster's):

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *High utilisation means an efficient run.* Utilisation is the share of time a kernel
# ran, not how well it ran; the profiler's self and total times say where the time goes.
# :::

# %% tags=["demo"]
std_batch_file = (KIT_ROOT / "batchfiles" / "generic" / "batch-std-1n1g.sh").read_text()
print("\n".join(line for line in std_batch_file.splitlines()
                if line.startswith(("nvidia-smi", "monitor", "trap 'kill", "srun",
                                    "    "))))

# %% [markdown]
# On AMD GPUs, `rocm-smi --showuse --showmemuse --csv` in a `while true; do ...; sleep 5; done`
# loop does the same. The generated files sample every 10 s, into `RUN_DIR/gpu-<job id>.csv`. To
# look at a running job by hand, `srun --jobid <job id> --overlap nvidia-smi` runs it inside the
# job's allocation, on its node (`--pty bash` instead gives a shell there).
#
# Lightning measures from inside the training loop: the `DeviceStatsMonitor` callback logs, at
# every step, to the trainer's logger (MLflow included), the GPU memory PyTorch's allocator holds
# (`torch.cuda.memory_stats`: allocated, reserved and peak bytes, not the utilisation) and, with
# `cpu_stats=True` or on a CPU, the machine's CPU and memory use through `psutil`:
#
# ```python
# from lightning.pytorch.callbacks import DeviceStatsMonitor
#
# trainer = L.Trainer(callbacks=[DeviceStatsMonitor(cpu_stats=True)], logger=mlflow_logger, ...)
# ```
#
# On a CPU the same questions go to the operating system. `psutil` sampled both runs above from
# the notebook: the CPU time the process used, as a percentage of one core (up to 100% times
# its threads), and its resident memory (RSS).

# %% tags=["demo"]
fig, (cpu_ax, memory_ax) = plt.subplots(1, 2, figsize=(10, 3.5), layout="constrained")
for name, samples in usage.items():
    seconds = [s for s, _, _ in samples]
    cpu_ax.plot(seconds, [c for _, c, _ in samples], label=name)
    memory_ax.plot(seconds, [rss / 2**20 for _, _, rss in samples], label=name)
cpu_ax.axhline(100 * psutil.cpu_count(), color="grey", linestyle=":", label="all cores")
cpu_ax.set_ylabel("CPU (% of one core)")
memory_ax.set_ylabel("resident memory (MiB)")
for ax in (cpu_ax, memory_ax):
    ax.set_xlabel("seconds since start")
    ax.legend()
fig.suptitle("two training processes side by side, sampled every 0.25 s with psutil")
plt.show()
for name, samples in usage.items():
    cpu, peak = (statistics.mean(c for _, c, _ in samples),
                 max(rss for _, _, rss in samples))
    print(f"{name}: {samples[-1][0]:.1f} s, mean CPU {cpu:.0f}% of one core "
          f"({THREADS} thread(s) "
          f"for PyTorch), peak memory {peak / 2**20:,.0f} MiB")

# %% [markdown]
# Each process keeps near its share of the machine, `OMP_NUM_THREADS` cores (less where other
# work shares the machine); a dip means it waited instead of computing, for the disk, the
# network, a database or another process. Most of so short a run is start-up: Python importing
# PyTorch and MLflow, which is also most of the memory. Memory grows in steps (the imports, then
# the model, then Adam's two states at the first update) and then stays flat: that is what a
# healthy run looks like. Memory that keeps rising step after step is a leak, such as a list
# that keeps every step's loss tensor, and with it the whole graph behind it. A GPU run's
# `nvidia-smi` memory column tells the same about the device.
#
# The run's own measure of speed is its logged throughput. The first steps of a run are slow
# (memory is allocated, caches warm up, on a GPU kernels are chosen and `torch.compile` compiles),
# so they must not enter an average.
#
# **Exercise 3.** Write `throughput_stats(history, skip=2)`: `history` is the list that
# `client.get_metric_history(run_id, "tok_per_s")` returns, MLflow `Metric`s with `.step` and
# `.value`, in any order. Leave out the `skip` earliest steps and return a dictionary with the
# number of steps kept (`"steps"`) and the `"mean"`, `"median"`, `"min"` and `"max"` of the
# values kept.

# %% nbgrader={"grade": false, "grade_id": "throughput_stats", "locked": false, "schema_version": 3, "solution": true, "task": false}
def throughput_stats(history, skip=2):
    ### BEGIN SOLUTION
    values = [m.value for m in sorted(history, key=lambda m: m.step)][skip:]
    return {"steps": len(values), "mean": statistics.mean(values),
            "median": statistics.median(values), "min": min(values),
            "max": max(values)}
    ### END SOLUTION


# %% tags=["demo"]
rows = ["| run | steps kept | mean tok/s | median | min | max |",
        "|---|---|---|---|---|---|"]
for name, run_dir in run_dirs.items():
    stats = throughput_stats(client.get_metric_history(
        runs.read_json(run_dir / "tracking.json")["run_id"], "tok_per_s"))
    rows.append(f"| {name} | {stats['steps']} | " + " | ".join(
        f"{stats[key]:,.0f}" for key in ("mean", "median", "min", "max")) + " |")
display(Markdown("\n".join(rows)))

# %% nbgrader={"grade": true, "grade_id": "throughput_stats_tests", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
from mlflow.entities import Metric  # noqa: E402

# tok/s of steps 1 to 5: the first ones are slow
logged = [120.0, 950.0, 1010.0, 990.0, 1030.0]
stats = throughput_stats([Metric("tok_per_s", value, 0, step)
                          for step, value in enumerate(logged, start=1)])
assert stats["steps"] == 3
assert abs(stats["mean"] - statistics.mean(logged[2:])) < 1e-9
assert stats["min"] == min(logged[2:]) and stats["max"] == max(logged[2:])
### BEGIN HIDDEN TESTS
shuffled = [Metric("tok_per_s", value, 0, step) for step, value in
            ((3, 300.0), (1, 10.0), (4, 200.0), (2, 100.0))]
assert throughput_stats(shuffled, skip=1) == {"steps": 3, "mean": 200.0,
                                              "median": 200.0, "min": 100.0,
                                              "max": 300.0}
assert throughput_stats(shuffled, skip=0)["median"] == 150.0
assert throughput_stats(shuffled)["min"] == 200.0
assert stats["median"] == statistics.median(logged[2:])
### END HIDDEN TESTS

# %% [markdown]
# ## Profiling a few steps
#
# Utilisation says *that* time is lost; a **profiler** says *where*. `torch.profiler` records
# every operator PyTorch runs on the CPU and, with `ProfilerActivity.CUDA`, every GPU kernel,
# with its start, duration, and optionally input shapes and memory. Profiling is slow and its
# files are large, so profile a handful of steps after a warm-up, never a whole run.
#
# Here: the std stage's model and optimiser, imported from the stage script as in lesson 01, one
# warm-up step outside the profiler, then three profiled steps. `record_function` labels
# stretches of code (forward, backward, optimiser) so that they are easy to find in the trace;
# `prof.step()` marks where each step ends.

# %%
std = stages.load("std")  # solutions/train_gpt2_std.py, imported as a module
tiny = presets.get_preset("tiny")
# the stages' choice: the first GPU there is, else the CPU
device = distributed.device_for(0)
torch.manual_seed(0)
config = gpt.GPTConfig(vocab_size=tiny.vocab_size, block_size=tiny.seq_len,
                       n_layer=tiny.n_layer, n_head=tiny.n_head, n_embd=tiny.n_embd)
model = gpt.GPT(config).to(device)  # solutions/gpt.py, the model every stage trains
optimizer = std.configure_optimizer(model, tiny.lr, tiny.weight_decay, device)
# 2 samples per step: quick
loader = std.TokenShardLoader(DATA, "train", 2, tiny.seq_len)


def train_step():
    x, y = (t.to(device) for t in loader.next_batch())
    with record_function("forward"):
        loss = gpt.cross_entropy(model(x), y)
    with record_function("backward"):
        loss.backward()
    with record_function("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


train_step()  # warm-up: first-call costs (allocations, lazy initialisation) stay out
activities = ([ProfilerActivity.CPU]
              + ([ProfilerActivity.CUDA] if device.type == "cuda" else []))
# no start and stop notes from the profiler's C++ library
os.environ["KINETO_LOG_LEVEL"] = "6"
with profile(activities=activities, record_shapes=True) as prof:
    for _ in range(3):
        train_step()
        prof.step()
sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
print(prof.key_averages().table(sort_by=sort_by, row_limit=10,
                                max_name_column_width=36))

# %% [markdown]
# Each row is one operator, summed over the three steps. *Self* time is spent in the operator
# itself; *total* (CPU total) includes the operators it called: `aten::linear` calls
# `aten::addmm`, and the labels `forward`, `backward` and `optimizer` contain everything under
# them. Sort by self time to find what to speed up. In this tiny model most of the time goes to
# the output head: a $64 \to 50{,}304$ matrix product for every token (`aten::mm`, forward and
# backward) and the cross-entropy's softmax over those 50,304 logits (`aten::_log_softmax` and its
# backward); the blocks' own products (`aten::addmm`) are small beside it. AdamW on a CPU updates
# one parameter tensor at a time (`aten::sqrt`, `aten::div`, ... dozens of calls per step); on a
# GPU the stage uses the fused version, one kernel for all of them. Lesson 01's MFU said how much
# of the peak a run reaches; this table says which operators take the time.
#
# **Exercise 4.** Write `top_ops(prof, n)`: the `n` operators with the most self CPU time, largest
# first, as a list of `(name, milliseconds)` pairs. `prof.key_averages()` holds one entry per
# operator, with its name in `.key` and its self CPU time, in microseconds, in
# `.self_cpu_time_total`.

# %% nbgrader={"grade": false, "grade_id": "top_ops", "locked": false, "schema_version": 3, "solution": true, "task": false}
def top_ops(prof, n):
    ### BEGIN SOLUTION
    averages = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total,
                      reverse=True)
    return [(e.key, e.self_cpu_time_total / 1000) for e in averages[:n]]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "top_ops_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
top = top_ops(prof, 5)
averages = prof.key_averages()
biggest = max(averages, key=lambda e: e.self_cpu_time_total)
assert len(top) == 5 and [ms for _, ms in top] == sorted((ms for _, ms in top),
                                                         reverse=True)
assert (top[0][0] == biggest.key
        and abs(top[0][1] - biggest.self_cpu_time_total / 1000) < 1e-9)
### BEGIN HIDDEN TESTS
by_name = {e.key: e.self_cpu_time_total / 1000 for e in averages}
assert all(abs(by_name[name] - ms) < 1e-9 for name, ms in top)
assert all(ms <= top[-1][1] for name, ms in by_name.items() if name not in dict(top))
assert (top_ops(prof, 1) == top[:1]
        and len(top_ops(prof, len(averages) + 5)) == len(averages))
### END HIDDEN TESTS

# %% [markdown]
# ### Reading a trace
#
# The table sums; the **trace** shows the timeline. `prof.export_chrome_trace` writes it as JSON
# in Chrome's trace-event format:

# %% tags=["demo"]
trace = RUNS / "trace.json"
prof.export_chrome_trace(str(trace))
events = json.loads(trace.read_text())["traceEvents"]
# the record_function labels, as the CPU ran them (a GPU trace has them on the streams
# too)
labelled = [e for e in events if e.get("cat") == "user_annotation"
            and e["name"] in ("forward", "backward", "optimizer")]
# every step's parts
assert {e["name"] for e in labelled} == {"forward", "backward", "optimizer"}
print(f"exported Chrome trace {trace}: {trace.stat().st_size / 2**20:.1f} MiB, "
      f"{len(events):,} events")
for label in ("forward", "backward", "optimizer"):
    durations = [e["dur"] / 1000 for e in labelled if e["name"] == label]
    print(f"  {label:9s} " + ", ".join(f"{ms:.1f}" for ms in durations) + " ms")

# %% [markdown]
# Open the file in **Perfetto** (<https://ui.perfetto.dev>, "Open trace file": the page runs in
# your browser and reads the file locally, nothing is uploaded), or at `chrome://tracing` in
# Chrome. From a cluster, copy it to your laptop first (`scp` through the login node) or open it
# from Open OnDemand's file browser. Then:
#
# - each *row* is a thread (and, on a GPU, each CUDA stream); time runs left to right. `W` and
#   `S` zoom, `A` and `D` move; click a block for its name, duration and input shapes;
# - `ProfilerStep#N` blocks are the steps, and inside them your `forward`, `backward` and
#   `optimizer` labels with the operators they ran, nested by what called what;
# - on a GPU, the CPU rows *launch* kernels and the stream rows *run* them, linked by arrows.
#   A healthy run keeps the stream row full while the CPU runs ahead. *Gaps* in the stream row
#   are lost time: a `.item()` or `print` of a GPU value that makes the CPU wait, a data loader
#   that cannot keep up, many tiny kernels (fuse them with `torch.compile`), or, in lessons 02
#   and 04, communication that does not overlap computation (NCCL kernels on their own stream).
#
# In a real run, profile a few steps in the middle, not the start, with a schedule, and write one
# trace per rank:
#
# ```python
# from torch.profiler import schedule, tensorboard_trace_handler
#
# with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
#              schedule=schedule(skip_first=100, wait=1, warmup=2, active=3, repeat=1),
#              on_trace_ready=tensorboard_trace_handler(f"{run_dir}/profile")) as prof:
#     for step in range(max_steps):
#         train_step()
#         prof.step()
# ```

# %% [markdown]
# ## Key points
#
# - `--track mlflow` logs every stage's parameters, per-step metrics, system tags (devices, world
#   size, versions, Slurm job), git commit, data manifest, installed packages and artifacts, from
#   rank 0, to `MLFLOW_TRACKING_URI` or to `mlflow.db` beside the run directory;
#   `--track tensorboard` writes event files instead.
# - `mlflow.search_runs` gives a DataFrame of runs (params, last metrics, tags) to filter, sort and
#   tabulate; `MlflowClient` gives metric histories, artifacts and the registry.
# - MLflow's plain server has no login; the kit's (`coursekit mlflow-server`,
#   `batch-mlflow-ui.sh`) lets in its owner alone, with a password. Run it on `127.0.0.1` of a
#   compute node and reach it through an SSH tunnel, or through Open OnDemand's proxy.
# - Reproducibility needs seeds, deterministic kernels on GPUs (`use_deterministic_algorithms`,
#   `CUBLAS_WORKSPACE_CONFIG`), the environment, the commit and the exact data; a different
#   number of processes changes the order of sums, and so the last digits.
# - A data manifest (sha256 per file) names the data a run saw; `verify-data` catches a changed
#   shard before a job trains on it.
# - A pickle can run code when it is loaded: keep `torch.load(weights_only=True)`, and store
#   weights as safetensors (tensors only, JSON for the rest).
# - The registry names models: versions made from runs, aliases such as `champion` that consumers
#   load and you move.
# - Watch utilisation and memory during a job (`nvidia-smi`/`rocm-smi` sampling, Lightning's
#   `DeviceStatsMonitor`, `psutil` on a CPU); profile a few warm steps with `torch.profiler` and
#   read the table (self time) and the trace (gaps).
