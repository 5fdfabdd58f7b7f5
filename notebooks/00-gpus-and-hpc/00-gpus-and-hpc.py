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
# # 00 · GPUs, nodes and clusters
#
# **Questions.** This lesson answers
# - What is inside a GPU node, and how do many nodes make a cluster?
# - How fast is my device, measured, against its peak?
# - How much faster can $N$ GPUs make a job, and what stops them?
# - How do I get GPUs on a shared cluster: a batch job, or a JupyterLab session?
#
# **Objectives.** After this lesson you can
# - describe how a cluster is built from nodes, and a node from CPUs and GPUs;
# - measure the FLOP/s your device reaches on a matrix multiplication and compare it with its peak;
# - name what a GPU is built of (SMs, tensor cores, HBM), measure your device's memory bandwidth,
#   and tell from an operation's arithmetic intensity whether memory or compute limits it;
# - say how the GPUs of a node are linked to each other and to the network, and read
#   `nvidia-smi topo -m`;
# - compute speedup and parallel efficiency, and predict the limit Amdahl's law sets;
# - read a Slurm batch file, submit it, and name the `SLURM_*` variables a job sees;
# - start a JupyterLab session with GPUs from Open OnDemand.
#
# **Prerequisites.** Python and a little NumPy; no GPU needed.
#
# **Time.** About 50 minutes: reading, the exercises, and waiting for the cells on a laptop's CPU.
# The time is an estimate; the instructor guide says how it is made.

# %% [markdown]
# ## GPUs, nodes and clusters
#
# A **cluster** is many computers (**nodes**) joined by a fast network (InfiniBand, Slingshot,
# RoCE). A **GPU node** holds one or two CPUs with dozens of cores, hundreds of GB of memory and,
# typically, 4 or 8 GPUs linked to each other by NVLink or Infinity Fabric (hundreds of GB/s) and
# to other nodes by the network (tens of GB/s per GPU). You do not log in to the compute nodes: you
# log in to a **login node** and ask the **scheduler** (Slurm) for resources; it starts your
# **job** on compute nodes when they are free.
#
# A GPU is a throughput machine: thousands of simple cores and matrix units ("tensor cores") that
# do the same operation on many numbers at once. Training a neural network is mostly matrix
# multiplication, which is why GPUs are used: an NVIDIA H100 SXM does at most about 989
# **TFLOP/s** (10¹² floating-point operations per second) in bf16 on dense matrices, by
# [NVIDIA's H100 datasheet](https://www.nvidia.com/en-us/data-center/h100/) (it prints 1,979, a
# figure for matrices with 2:4 sparsity, twice the dense rate; the PCIe card does less), a laptop
# CPU a fraction of one (this lesson measures yours).
#
# First, what does this kernel see? (Its paths and devices are the machine's that runs it: the
# book leaves the output out, so run the cell yourself.)

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *The login node is for computing.* Spot it in `top` on the login node during the
# lesson.
# :::

# %% tags=["demo", "remove-output"]
from coursekit import envcheck

print(envcheck.report(envcheck.collect()))

# %% [markdown]
# ## FLOP/s: measuring your device
#
# Multiplying an $n \times m$ matrix by an $m \times k$ one takes $n k$ dot products of length
# $m$: $m$ multiplications and $m$ additions each, so $2nmk$ floating-point operations (FLOPs). For
# square $n \times n$ matrices that is $2n^3$.
#
# **Exercise 1.** Write `achieved_tflops(n, seconds)`: the TFLOP/s of one $n \times n$ by
# $n \times n$ matrix multiplication that took `seconds`.

# %% nbgrader={"grade": false, "grade_id": "achieved_tflops", "locked": false, "schema_version": 3, "solution": true, "task": false}
def achieved_tflops(n, seconds):
    ### BEGIN SOLUTION
    return 2 * n**3 / seconds / 1e12
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "achieved_tflops_tests", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
assert abs(achieved_tflops(1000, 1.0) - 0.002) < 1e-12
assert abs(achieved_tflops(8192, 0.00111) - 990.6) < 0.1  # an H100 at its bf16 peak

# %% [markdown]
# Now measure. Small matrices cannot keep the device busy (the time goes into launching work and
# moving data), large ones can: watch the achieved FLOP/s rise with $n$ and level off near the
# device's peak. The peak of a GPU comes from its datasheet; for a CPU we estimate it as
# cores × clock × FLOPs per cycle of its vector units.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *The datasheet's peak is what a GPU does.* Spot it when a measured matmul rate
#   "looks broken". A large matmul reaches most of the peak; a training step reaches
#   much less (MFU, lesson 01).
# - Say here: FLOP/s as the currency of the course.
# :::

# %% tags=["demo"]
import time

import matplotlib.pyplot as plt
import torch

from coursekit import perf

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32


def time_matmul(n, repeats=5):
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device == "cuda":
        # GPU work is asynchronous: wait before reading the clock
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


sizes = [128, 256, 512, 1024, 2048] + ([4096, 8192] if device == "cuda" else [])
tflops = [achieved_tflops(n, time_matmul(n)) for n in sizes]
peak = (perf.table_peak_flops(perf.device_name(device)) if device == "cuda"
        else perf.cpu_peak_estimate())
for n, t in zip(sizes, tflops):
    print(f"n = {n:5d}: {t:8.3f} TFLOP/s"
          + (f" = {100 * t * 1e12 / peak:5.1f}% of peak" if peak else ""))

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(sizes, tflops, "o-", label=f"measured on {perf.device_name(device)}")
if peak:
    ax.axhline(peak / 1e12, color="grey", linestyle="--", label="peak")
ax.set_xscale("log", base=2)
ax.set_xlabel("matrix size n")
ax.set_ylabel("TFLOP/s")
ax.legend()
plt.show()

# %% [markdown]
# ## Inside a GPU: compute, memory, and the roofline
#
# An NVIDIA H100 (SXM) is 132 **streaming multiprocessors** (SMs), each with its own schedulers,
# registers, a fast on-chip memory and 4 **tensor cores**: units that multiply small matrix tiles
# in one instruction, where most of the 989 TFLOP/s come from (the other cores do element-wise
# work at a fraction of that). Beside the chip sits 80 GB of **HBM** (high-bandwidth memory),
# read and written at 3.35 TB/s; every tensor of a training run lives there. These are vendors'
# figures, not measurements: the H100 SXM's from NVIDIA's datasheet (and, for the SMs, its Hopper
# architecture whitepaper); an A100 80GB SXM has 108 SMs, 312 dense bf16 TFLOP/s and 2.0 TB/s
# by NVIDIA's A100 datasheet, an AMD MI250X 3.2 TB/s for its two dies by AMD's.
#
# Whether an operation is limited by compute or by memory depends on its **arithmetic
# intensity**: the FLOPs it does per byte it moves between memory and the chip. An $n \times n$
# matrix product does $2n^3$ FLOPs on $3n^2$ numbers (two read, one written): at 4 bytes a
# number, $n/6$ FLOP per byte, more the larger $n$. Adding two tensors does 1 FLOP per 12 bytes,
# whatever their size. The **roofline** model says what an operation of intensity $I$ can reach:
#
# $$\text{FLOP/s} \le \min(\text{peak FLOP/s},\; I \times \text{memory bandwidth})$$
#
# Below the "ridge", $I$ = peak / bandwidth (about 300 FLOP per byte on an H100 in bf16), an
# operation waits for memory whatever the tensor cores could do: element-wise operations,
# normalisations and small matrix products are memory-bound, which is why fusing them (lesson 01's
# `torch.compile`) pays. Measure both roofs of your device, and place two operations under them:

# %% tags=["demo"]
def timed(work, repeats):
    """Seconds one ``work()`` takes, waiting for the device before reading the clock."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        work()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def copy_bandwidth(megabytes=256 if device == "cuda" else 64, repeats=5):
    """Bytes a second this device moves copying a large tensor (read once, written
    once)."""
    numbers = megabytes * 2**20 // 4
    source = torch.empty(numbers, device=device, dtype=torch.float32).normal_()
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up
    seconds = timed(lambda: target.copy_(source), repeats)
    return 2 * source.nbytes / seconds


bandwidth = copy_bandwidth()
x, y, total = (torch.randn(2**24, device=device) for _ in range(3))
# x + y: one FLOP for 12 bytes moved
add_flops = x.numel() / timed(lambda: torch.add(x, y, out=total), 5)
matmul_intensity = [n / (6 if dtype == torch.float32 else 3) for n in sizes]
roof = peak or max(tflops) * 1e12  # no known peak: the best matrix product stands in
print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s, compute roof {roof / 1e12:.2f} "
      f"TFLOP/s: the ridge at {roof / bandwidth:.0f} FLOP per byte")
print(f"x + y: {add_flops / 1e9:.2f} GFLOP/s at 1/12 FLOP per byte; the best matrix "
      f"product: {max(tflops) * 1e3:.0f} GFLOP/s")
assert add_flops < max(tflops) * 1e12 / 10  # memory-bound, far below

# and the ridge
intensities = sorted([2.0**k for k in range(-5, 13)] + [roof / bandwidth])
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(intensities, [min(roof, i * bandwidth) / 1e12 for i in intensities], "k-",
        label="roofline: min(peak, I x bandwidth)")
ax.plot(matmul_intensity, tflops, "o", label="n x n matrix products (above)")
ax.plot([1 / 12], [add_flops / 1e12], "s", label="x + y")
ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity I (FLOP per byte)",
       ylabel="TFLOP/s", title=f"roofline of {perf.device_name(device)}")
ax.legend()
plt.show()

# %% [markdown]
# Between GPUs the roofs are links. Inside a node, **NVLink** (NVIDIA; 900 GB/s per H100 across
# its links) or AMD's Infinity Fabric joins the GPUs directly; between nodes each GPU reaches the
# others over the network at tens of GB/s (400 Gb/s InfiniBand NDR is 50 GB/s a port, Slingshot
# 25 GB/s a NIC). That gap of one or two orders of magnitude decides, from lesson 02 on, which
# traffic may cross nodes. On a GPU node, `nvidia-smi topo -m` (or `rocm-smi --showtopo` on AMD)
# prints the matrix of how each pair of GPUs, and each GPU and network card, is connected: `NV18`
# is 18 NVLinks, `SYS` or `NODE` a path through the CPUs (slower), and the `NIC` rows say which
# network card is nearest each GPU. Run it in a GPU session:

# %% tags=["cluster", "demo", "remove-output"]
import shutil
import subprocess

topology = shutil.which("nvidia-smi") or shutil.which("rocm-smi")
if topology:
    flags = ["topo", "-m"] if topology.endswith("nvidia-smi") else ["--showtopo"]
    print(subprocess.run([topology, *flags], capture_output=True, text=True).stdout)
else:
    print("No GPU tools here: on a GPU node, `nvidia-smi topo -m` prints how GPUs "
          "link.")

# %% [markdown]
# ## Speedup and parallel efficiency
#
# If a job takes $T_1$ on one processor and $T_p$ on $p$ processors, the **speedup** is
# $S_p = T_1 / T_p$ and the **parallel efficiency** is $E_p = S_p / p$. A job that takes 80 hours
# on 1 GPU and 22 hours on 4 has a speedup of 3.64 and an efficiency of 91%: 9% of the four GPUs'
# time went into communication, waiting, or work that was not split.

# %%
def speedup(t1, tp):
    return t1 / tp


def efficiency(t1, tp, p):
    return speedup(t1, tp) / p


# %% [markdown]
# ## Amdahl's law
#
# Suppose a fraction $s$ of the work cannot be parallelised (reading the data, a serial
# optimiser step, logging). With $p$ processors the time is $T_p = T_1 (s + (1 - s)/p)$, so
#
# $$S_p = \frac{1}{s + (1-s)/p} \quad\xrightarrow{p \to \infty}\quad \frac{1}{s}.$$
#
# Even 5% serial work caps the speedup at 20, however many GPUs you buy.

# %%
def amdahl_speedup(serial_fraction, p):
    return 1 / (serial_fraction + (1 - serial_fraction) / p)


# %% [markdown]
# **Exercise 2.** How many GPUs should a job ask for? A job took `t1` hours on one GPU and `tp`
# hours on `p` GPUs. Assume that it scales by Amdahl's law, with the serial fraction that
# explains that pair of times. Write `most_gpus(t1, tp, p, min_efficiency)`: the largest number
# of GPUs at which its parallel efficiency would still be at least `min_efficiency`, at least 1
# (one GPU is always fully used), or `None` if the times show no serial part (the measurement
# then sets no limit). For the 80 h / 22 h example and 80% it is 8.

# %% nbgrader={"grade": false, "grade_id": "most_gpus", "locked": false, "schema_version": 3, "solution": true, "task": false}
def most_gpus(t1, tp, p, min_efficiency):
    ### BEGIN SOLUTION
    # Amdahl solved for s: tp / t1 = s + (1 - s) / p (the Karp-Flatt metric)
    serial = (tp / t1 - 1 / p) / (1 - 1 / p)
    if serial <= 0:
        return None
    # efficiency on n GPUs: 1 / (n s + 1 - s) >= min_efficiency, solved for n
    return max(1, int((1 / min_efficiency - 1 + serial) / serial))
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "most_gpus_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
assert most_gpus(80, 22, 4, 0.8) == 8
### BEGIN HIDDEN TESTS
from coursekit import exercise, scaling


def predicted_efficiency(t1, tp, p, n):
    return scaling.amdahl_speedup(scaling.karp_flatt(t1, tp, p), n) / n


cases = [(80, 22, 4, 0.45), (100, 25, 16, 0.49), (100, 30, 8, 0.7), (9, 5, 2, 0.65),
         (1000, 40, 64, 0.3)]
with exercise.own_work(scaling.amdahl_speedup, scaling.karp_flatt):
    answers = [most_gpus(*case) for case in cases]
    assert most_gpus(10, 2.5, 4, 0.9) is None  # linear: no serial part shows
    assert most_gpus(60, 60, 8, 0.6) == 1  # no speedup at all: one GPU
    assert most_gpus(100, 25, 16, 0.49) == 6  # s = 0.2
for (t1, tp, p, least), n in zip(cases, answers):
    at_most, one_more = (predicted_efficiency(t1, tp, p, m) for m in (n, n + 1))
    assert at_most >= least > one_more
### END HIDDEN TESTS

# %% tags=["demo"]
import numpy as np

gpus = np.arange(1, 257)
fig, ax = plt.subplots(figsize=(6, 3.5))
for s in (0.0, 0.01, 0.05, 0.1):
    ax.plot(gpus, amdahl_speedup(s, gpus), label=f"serial fraction {s:.0%}")
ax.plot([4], [speedup(80, 22)], "ko", label="80 h -> 22 h on 4")
ax.set_xscale("log", base=2)
ax.set_yscale("log", base=2)
ax.set_xlabel("processors p")
ax.set_ylabel("speedup")
ax.legend()
plt.show()

# %% [markdown]
# The kit's scaling calculator does the same arithmetic with sliders. Given measured times (here
# the example's 80 h on 1 GPU and 22 h on 4), it starts at the serial fraction that explains them,
# as your `most_gpus` does, and draws Amdahl's curve through the measurement. Move the sliders: on
# how many GPUs does the efficiency drop under 50%?

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *More GPUs make it proportionally faster.* Spot it when trainees predict a 4x speedup
# on 4 GPUs before measuring anything. Amdahl's curve and the measured speedup answer
# it.
# :::

# %% tags=["demo"]
from coursekit import widgets

widgets.scaling_calculator({1: 80, 4: 22})

# %% [markdown]
# ## Slurm: asking for GPUs
#
# On a cluster you describe a job in a **batch file**: a shell script whose `#SBATCH` comment
# lines are options for the scheduler, then the commands to run.
#
# | command | what it does |
# |---|---|
# | `sbatch job.sh` | queue the batch file; prints the job id |
# | `squeue --me` | your queued and running jobs |
# | `srun CMD` | inside a job: start `CMD` once per task, on the allocated nodes |
# | `scancel ID` | cancel a job |
# | `sinfo` | partitions and the state of their nodes |
#
# Inside the job, Slurm tells each task where it is through environment variables:
# `SLURM_JOB_ID`, `SLURM_JOB_NODELIST` (e.g. `gpu[01-02]`), `SLURM_NNODES`, `SLURM_NTASKS`,
# `SLURM_PROCID` (this task's global rank), `SLURM_LOCALID` (its rank on the node),
# `SLURM_NODEID`, `SLURM_CPUS_PER_TASK` and, with GPUs, `SLURM_GPUS_ON_NODE`. The distributed
# lessons turn exactly these into PyTorch's `RANK`, `WORLD_SIZE` and `LOCAL_RANK`.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# Say here: the queue as a shared resource, and why jobs should ask for what they use.
# :::

# %% [markdown]
# Here is a real one: the batch file the kit generates for the ddp stage on 2 nodes of 4 GPUs
# of a generic cluster (`batchfiles/generic/batch-ddp-2n4g.sh`, from the same generator as the
# files the kit's tests run on a small Slurm cluster). The `#SBATCH` lines ask for the resources. `srun` then starts one
# `torchrun` per node, and the **rendezvous** options tell the `torchrun`s where to meet (the
# allocation's first host and a port): without them each would wait for the others as node 0,
# and the job would hang. Lesson 02 explains the rest.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *Tasks, nodes and GPUs are the same number.* Spot it in batch files with one task
#   and four GPUs running one process. Read `--nodes`, `--ntasks-per-node` and
#   `--gpus-per-node` together.
# - Say here: why a 2-node job needs a rendezvous (the generated batch file, line by
#   line).
# :::

# %%
from coursekit import KIT_ROOT

example_batch_file = (KIT_ROOT / "batchfiles" / "generic"
                      / "batch-ddp-2n4g.sh").read_text()
print(example_batch_file)

# %% [markdown]
# **Exercise 3.** Write `total_gpus(batch_file)`: how many GPUs the batch file asks for, from its
# `--nodes` (or `-N`) line and its GPUs per node. Sites ask for those in different forms, and
# the kit's own site profiles use them: `--gpus-per-node=4`, `--gpus-per-node=a100:4` (with a GPU
# type), or as a generic resource, `--gres=gpu:4` or `--gres=gpu:a100:4` (Leonardo's form).
# Options may be written `--nodes=2` or `--nodes 2`; a missing `--nodes` means one node. Only
# `#SBATCH` lines count.

# %% nbgrader={"grade": false, "grade_id": "total_gpus", "locked": false, "schema_version": 3, "solution": true, "task": false}
def total_gpus(batch_file):
    ### BEGIN SOLUTION
    options = {}
    for line in batch_file.splitlines():
        if line.startswith("#SBATCH"):
            words = line[len("#SBATCH"):].replace("=", " ").split()
            options.update(zip(words[::2], words[1::2]))
    nodes = int(options.get("--nodes", options.get("-N", 1)))
    gpus = options.get("--gpus-per-node")
    if gpus is None:  # --gres=gpu[:type]:count[,other resources]
        gpus = next((g for g in options.get("--gres", "").split(",")
                     if g.startswith("gpu:")), "0")
    # the count is the last field: "a100:4" -> 4
    return nodes * int(gpus.rsplit(":", 1)[-1])
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "total_gpus_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
assert total_gpus(example_batch_file) == 8
assert total_gpus("#!/bin/bash\n#SBATCH --gpus-per-node=4\nsrun hostname\n") == 4
assert total_gpus((KIT_ROOT / "batchfiles" / "leonardo"
                   / "batch-ddp-2n4g.sh").read_text()) == 8
### BEGIN HIDDEN TESTS
assert total_gpus("#!/bin/bash\n#SBATCH -N 3\n#SBATCH --gpus-per-node 2\n") == 6
assert total_gpus("#!/bin/bash\n#SBATCH --nodes 16\n#SBATCH --gpus-per-node=8\n"
                  "# --nodes=99\n") == 128
assert total_gpus("#!/bin/bash\n#SBATCH --nodes=2\n") == 0
assert total_gpus("#!/bin/bash\n#SBATCH --nodes=2\n"
                  "#SBATCH --gpus-per-node=a100:4\n") == 8
assert total_gpus("#!/bin/bash\n#SBATCH --gres=gpu:a100:2\n") == 2
assert total_gpus("#!/bin/bash\n#SBATCH -N 4\n#SBATCH --gres=nvme:1,gpu:4\n") == 16
### END HIDDEN TESTS

# %% [markdown]
# What does Slurm say about the session you are in? On a laptop there is no Slurm, and the cell
# says so; inside an Open OnDemand JupyterLab the kernel runs in a job and sees its variables.
# (The book leaves this cell's output out: built on a cluster, it would list the builder's jobs.)

# %% tags=["cluster", "demo", "remove-output"]
import os
import shutil
import subprocess

slurm_variables = {k: v for k, v in sorted(os.environ.items())
                   if k.startswith("SLURM_")}
if slurm_variables:
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NTASKS",
                 "SLURM_CPUS_PER_TASK", "SLURM_GPUS_ON_NODE"):
        print(f"{name:22s} {slurm_variables.get(name, '-')}")
else:
    print("This kernel is not inside a Slurm job.")
if shutil.which("squeue"):
    print(subprocess.run(["squeue", "--me"], capture_output=True, text=True).stdout)
else:
    print("No Slurm commands here: on a cluster, `squeue --me` would list your jobs.")

# %% [markdown]
# ## JupyterLab from Open OnDemand
#
# Most HPC centres run [Open OnDemand](https://openondemand.org), a web portal to the cluster.
# To start this course's JupyterLab:
#
# 1. Log in to your centre's Open OnDemand address with your cluster account.
# 2. Choose *Interactive Apps → JupyterLab* (or the course's own app, if your instructor
#    installed it).
# 3. Fill in the form: account/project, partition, number of hours, number of GPUs (1-4), and the
#    course environment or kernel ("GPT course").
# 4. *Launch*. The request waits in the Slurm queue like any job; when it starts, press
#    *Connect to Jupyter*.
# 5. Open this notebook and check that the first cell lists your GPUs.
#
# The session *is* a Slurm job: it ends when its time is up, and anything larger than the
# session's GPUs goes through `sbatch` from a terminal in JupyterLab.

# %% [markdown]
# ## Key points
#
# - A cluster is nodes joined by a network; a GPU node has several GPUs joined by a faster link.
#   You reach compute nodes through the Slurm scheduler, not by logging in.
# - Training is matrix multiplication: $2n^3$ FLOPs for an $n \times n$ product. Large matrices
#   get close to the device's peak FLOP/s, small ones do not.
# - Speedup $S_p = T_1/T_p$, efficiency $E_p = S_p/p$; Amdahl's law caps the speedup at
#   $1/s$ for a serial fraction $s$.
# - A batch file is a shell script with `#SBATCH` options; `sbatch` queues it, `srun` starts its
#   tasks, and each task learns its place from `SLURM_*` variables.
