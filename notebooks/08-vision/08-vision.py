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
# # 08 · Computer vision at scale: keeping the GPUs fed
#
# **Questions.** This lesson answers
# - Why do GPUs training on images so often wait for data?
# - Which stage of the input pipeline is the slowest, and how many workers does it need?
# - How should images be stored and dealt out on a parallel file system?
#
# **Objectives.** After this lesson you can
# - name the stages that bring an image from disk to a GPU (read, decode, augment, copy) and
#   time each of them, and the training step they feed;
# - find the slowest stage from those times, and predict the images a second that a number of
#   loader workers deliver;
# - say why a parallel file system wants a few large shards rather than a file per image, and
#   count the files each layout opens;
# - deal the data to processes and loader workers: `DistributedSampler` with `set_epoch` for
#   files, WebDataset's split by node and by worker for shards;
# - move augmentation from the loader's CPU workers to the device, and say what that saves;
# - train a ResNet with DDP on 1 and 2 processes, and read from its metrics whether a step waited
#   for its data;
# - say why training with very large batches needs warm-up and layer-wise learning rates (LARS,
#   LAMB), and compute LARS's trust ratios.
#
# **Prerequisites.** Lesson 02: DDP, `torchrun`, the global batch and the learning rate that
# scales with it. Lesson 01: run directories and `metrics.jsonl`.
#
# **Time.** About 65 minutes: reading, the exercises, and waiting for the cells on a laptop's CPU.
# The time is an estimate; the instructor guide says how it is made.
#
# Until now the data was text, tokenised once, and a batch was a slice of a memory-mapped array:
# reading it cost nothing. Images are different. Each is a compressed file that must be read,
# decoded into pixels and randomly changed (augmented) every time it is used, and a GPU trains on
# thousands a second. The first thing many people meet on a cluster with an image data set is a
# GPU that waits: for JPEG decoding on too few CPU cores, or for a parallel file system that
# chokes on a million small files. This lesson measures where the time goes.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch
import webdataset as wds
from IPython.display import Markdown, display

from coursekit import KIT_ROOT, images, launch, pipeline, runs, stages, training
from solutions.resnet import ResNet

# %% [markdown]
# The set-up: the standard library's modules the lesson uses, the kit's images (drawn once,
# in seconds), the lesson's stage script, the device, and a fresh folder for everything the
# lesson writes.

# %%
import collections
import io
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

DATA = KIT_ROOT / "data" / "shapes"
if not (DATA / "meta.json").exists():  # the kit's images: drawn in seconds, once
    images.prepare(DATA, files=True)
META = images.read_meta(DATA)
# the lesson's stage
stage = stages.load_script(KIT_ROOT / "solutions" / "train_resnet_ddp.py")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RUNS = Path("runs")  # what this lesson writes
shutil.rmtree(RUNS, ignore_errors=True)
RUNS.mkdir()
torch.manual_seed(0)
print(f"{len(META['classes'])} classes, {META['size']} x {META['size']} pixels, "
      f"{META['splits']['train']['images']:,} training and "
      f"{META['splits']['val']['images']:,} "
      f"validation images; device: {DEVICE}")

# %% [markdown]
# ## The images
#
# The kit draws its own data set (`python -m coursekit images prepare`): ten classes of shapes at
# a random size, place, angle and colour on a noisy background. Each image comes from its own
# seed, so the set is the same bytes on every machine, it owes nothing to anyone's licence, and
# it needs no download. On a cluster the same command reads a real data set in ImageNet's folder
# layout (`--source`), and the README says how to get CIFAR-10 or ImageNet onto it. The images are
# stored as JPEG files, as real data sets are: small on disk, and work for a CPU to decode.

# %% tags=["demo"]
train_files = stage.ImageFiles(DATA, "train")
fig, axes = plt.subplots(2, 10, figsize=(10, 2.4), layout="constrained")
shown = collections.defaultdict(int)
for path, label in train_files.rows:
    if shown[label] < 2:
        ax = axes[shown[label], label]
        ax.imshow(stage.decode(train_files.folder / path).permute(1, 2, 0).numpy())
        ax.set_axis_off()
        if shown[label] == 0:
            ax.set_title(META["classes"][label], fontsize=8)
        shown[label] += 1
    if sum(shown.values()) == 20:
        break
plt.show()

# %% [markdown]
# ## Two layouts on disk
#
# The same encoded images are written twice (`images prepare --files`; without it, shards only):
#
# - one file per image, `files/train/<class>/<n>.jpg`, found through an index
#   (`files/train/index.csv`): what a data set looks like when you download it, and a file each
#   against the quota most sites set on file counts as well as bytes;
# - **shards**: the images in order inside a few large tar files, `shards/train-000000.tar`, ...,
#   in the layout of the **WebDataset** library: each image's bytes next to its label, under the
#   same key.
#
# On a laptop's disk either layout reads fast. A cluster's **parallel file system** (Lustre, GPFS) does:
# its data servers stream large files fast to many nodes at once, but every file that is opened
# costs a request to a metadata server that all users of the cluster share. A job that opens a
# million small files an epoch, from many nodes, is slow itself and slows everyone else down;
# sites ask for data sets in large files for that reason. Let us count what each layout opens to
# deliver the same 512 images, reading in this process (no loader workers, whose opens we would not
# see).

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *Shards make reading faster on any disk.* On a local SSD the per-file layout can be
#   the faster one (`benchmarks/input_pipeline.py` measures both); the gain is in file
#   opens on a shared parallel file system, which the lesson counts.
# - Say here: your site's file system and its advice on many small files (quotas on
#   inodes are common); node-local SSDs as a staging area for a job's shards.
# :::

# %%
def batches_of(layout, workers=0, batch_size=64, augment="device"):
    """The stage's training batches for one process, as its command-line flags would
    make them."""
    args = stage.parse_args(["--data", str(DATA), "--layout", layout, "--workers",
                             str(workers), "--batch-size", str(batch_size), "--augment",
                             augment, "--out", str(RUNS / "unused")])
    return stage.make_batches(args, rank=0, world_size=1, device=DEVICE)


# %% tags=["demo"]
opened = {}
for layout in ("files", "shards"):
    stream = iter(batches_of(layout))
    with pipeline.files_opened() as paths:
        for _ in range(512 // 64):
            next(stream)
    del stream  # stops its loader
    opened[layout] = collections.Counter(Path(p).suffix for p in paths
                                         if Path(p).is_relative_to(DATA))
    print(f"{layout:6s}: 512 images, files opened: "
          + ", ".join(f"{n:,} {suffix}" for suffix, n in opened[layout].items()))
sizes = {layout: sum(p.stat().st_size for p in (DATA / layout).rglob("*")
                     if p.is_file())
         for layout in ("files", "shards")}
print(f"on disk: files {sizes['files'] / 1e6:.1f} MB in "
      f"{sum(1 for _ in (DATA / 'files').rglob('*.jpg')):,} files; shards "
      f"{sizes['shards'] / 1e6:.1f} MB in "
      f"{len(list((DATA / 'shards').glob('*.tar')))} files")

# %% [markdown]
# (The `.json` is the data set's `meta.json`, which lists the shards.) The shards stream: a few
# opens, then sequential reads, which is what parallel file systems and object stores are built
# for; the loader opened a second shard because its shuffle buffer holds 1,000 images. The price is
# random access: a tar file is read from the start, so the order of the images is shuffled only
# within that buffer, and a process cannot pick any image it likes. The shards are also larger:
# tar gives every member a 512-byte header and pads it to a multiple of 512 bytes, which more than
# doubles images as small as these and adds about 1% to ImageNet's, of about 110 kB each.

# %% [markdown]
# ## Dealing the data to processes and workers
#
# With $N$ processes, each must train on its own share of every epoch.
#
# - *Files*: `DistributedSampler` deals the indices: it shuffles all of them with a seed that
#   is the same on every process, then gives process $r$ every $N$-th from position $r$. Call
#   `sampler.set_epoch(epoch)` at each new epoch, or every epoch is shuffled the same way. The
#   loader's workers then share the process's indices between them, batch by batch.
# - *Shards*: whole shards are dealt instead. WebDataset's `split_by_node` gives process $r$
#   every $N$-th shard from $r$, and `split_by_worker` gives loader worker $w$ of $W$ every $W$-th
#   of those from $w$. Every reader needs at least one shard of its own, so a data set needs at
#   least processes $\times$ workers shards (the stage refuses fewer in one line), and many more
#   for every reader to get about the same number of images.
#
# **Exercise 1.** Write `shards_for_reader(shards, rank, world_size, worker, workers)`: the shards
# (a sublist of `shards`, in their order) that loader worker `worker` of `workers` in process
# `rank` of `world_size` reads, as `split_by_node` then `split_by_worker` deal them.

# %% nbgrader={"grade": false, "grade_id": "shards_for_reader", "locked": false, "schema_version": 3, "solution": true, "task": false}
def shards_for_reader(shards, rank, world_size, worker, workers):
    ### BEGIN SOLUTION
    return list(shards)[rank::world_size][worker::workers]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "shards_for_reader_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
SHARDS = [f"train-{i:06d}.tar" for i in range(8)]
assert shards_for_reader(SHARDS, 0, 1, 0, 1) == SHARDS
assert shards_for_reader(SHARDS, 1, 2, 0, 1) == SHARDS[1::2]
assert shards_for_reader(SHARDS, 0, 2, 1, 2) == ["train-000002.tar", "train-000006.tar"]
### BEGIN HIDDEN TESTS
def dealt_by_webdataset(shards, rank, world_size, worker, workers):
    """What WebDataset's own splitters deal, told the reader's place through the
    variables they read."""
    saved = os.environ.copy()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), WORKER=str(worker),
                      NUM_WORKERS=str(workers))
    try:
        return list(wds.split_by_worker(wds.split_by_node(iter(shards))))
    finally:
        os.environ.clear()
        os.environ.update(saved)


for count, world_size, workers in [(8, 2, 2), (12, 3, 2), (7, 2, 3), (5, 1, 4),
                                   (16, 4, 1)]:
    shards = [f"s{i}" for i in range(count)]
    readers = [shards_for_reader(shards, r, world_size, w, workers)
               for r in range(world_size) for w in range(workers)]
    assert readers == [dealt_by_webdataset(shards, r, world_size, w, workers)
                       for r in range(world_size) for w in range(workers)]
    assert (sorted(s for reader in readers for s in reader)
            == sorted(shards))  # each once
assert shards_for_reader(tuple(SHARDS), 1, 2, 0, 2) == ["train-000001.tar",
                                                        "train-000005.tar"]
### END HIDDEN TESTS

# %% [markdown]
# ## Where the time goes
#
# One training step of an image classifier does this to a batch:
#
# 1. read each image's bytes (a file, or the next member of a tar stream);
# 2. decode the JPEG into pixels (Pillow, on a CPU core);
# 3. augment: random shifts, turns, scalings and colour changes, so that the model never sees
#    the same image twice (Kornia: the same code on a CPU or a GPU);
# 4. collate the images into one tensor, and copy it to the device;
# 5. compute: forward, backward (with DDP's all-reduce) and the optimiser's step.
#
# Steps 1-3 (and collating) run in the `DataLoader`: in the training process itself with
# `num_workers=0`, or in worker processes that prepare the next batches while the GPU computes
# the current one. Let us time each stage on one batch of 64, in this process, nothing else
# running. The model is the kit's ResNet-18 (`solutions/resnet.py`, the same layout as
# torchvision's `resnet18`), a quarter as wide so that a laptop computes a step in a blink. Its
# BatchNorm layers carry buffers (running means and variances), so under DDP more than gradients
# travel: DDP broadcasts rank 0's buffers before every forward (lesson 02). Each rank normalises
# with its own batch's statistics; `torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)` makes
# them the whole minibatch's, at the cost of collectives in every BatchNorm layer, forward and
# backward. It matters when each GPU's batch is small (a few images, as with large images or
# models), where one rank's statistics are noisy; the kit's stage, with 128 images per rank by
# default (`--batch-size`), keeps plain BatchNorm.
#
# torchvision is what clusters use for the model (`--model torchvision-resnet18`), and its v2
# transforms augment tensors on a GPU. Its wheels on the package registry are built against
# CUDA's torch, though, and with a CPU-only torch they fail to import (`operator torchvision::nms
# does not exist`): the kit defines its own ResNet and augments with Kornia, so that this lesson
# runs anywhere. On a cluster, install torchvision from the same index as the torch you use, for
# the same build (CUDA or ROCm) and the release made for that torch version: for a CUDA 12.8
# build, `pip install torchvision --index-url https://download.pytorch.org/whl/cu128`, for a ROCm
# build the index of its ROCm version (`.../whl/rocm<version>`). Or take the one in the site's
# PyTorch module or container. A torchvision built for another torch, or another build of it,
# fails to import the same way.

# %%
BATCH = 64
WIDTH = 16  # channels of the first stage: ResNet-18 has 64
batch_rows = train_files.rows[:BATCH]
encoded = [(train_files.folder / path).read_bytes() for path, _ in batch_rows]
pixels = [stage.decode(io.BytesIO(data)) for data in encoded]
labels = torch.tensor([label for _, label in batch_rows])
model = stage.make_model("kit", len(META["classes"]), WIDTH, META["size"])
model = model.to(DEVICE, memory_format=torch.channels_last)
optimizer = stage.configure_optimizer(model, 0.1, 5e-4)
precision = training.prepare_device(DEVICE)
on_cpu, on_device = stage.AugmentOnCpu(), stage.augmentation().to(DEVICE)

# %% tags=["demo"]
batch = torch.stack(pixels)
moved = batch.pin_memory() if DEVICE.type == "cuda" else batch
inputs = stage.to_inputs(moved, DEVICE, on_device)
timings = {  # ms for the batch: the fastest of 3 runs of each stage
    "read": pipeline.milliseconds(lambda: [(train_files.folder / p).read_bytes()
                                           for p, _ in batch_rows], 3),
    "decode": pipeline.milliseconds(lambda: [stage.decode(io.BytesIO(d))
                                             for d in encoded], 3),
    "augment, per image (CPU)": pipeline.milliseconds(
        lambda: [on_cpu(p) for p in pixels], 3),
    "collate": pipeline.milliseconds(lambda: torch.stack(pixels), 3),
    "copy to the device": pipeline.milliseconds(
        lambda: moved.to(DEVICE, non_blocking=True), 3),
    "augment, the batch (device)": pipeline.milliseconds(
        lambda: stage.to_inputs(moved, DEVICE, on_device), 3),
    "compute (forward, backward, step)": pipeline.milliseconds(
        lambda: stage.train_step(model, optimizer, precision, inputs,
                                 labels.to(DEVICE)), 3),
}
rows = "\n".join(f"| {name} | {ms:.1f} | {BATCH / ms * 1000:,.0f} |"
                 for name, ms in timings.items())
display(Markdown("| stage | ms per batch of 64 | images/s if it were the only stage |\n"
                 f"|---|---:|---:|\n{rows}"))
cpu_side = ["read", "decode", "augment, per image (CPU)", "collate"]
slowest_cpu = max(cpu_side, key=timings.get)
print(f"The slowest stage here is '{max(timings, key=timings.get)}'. "
      f"Of the loader's stages, "
      f"'{slowest_cpu}' takes "
      f"{timings[slowest_cpu] / sum(timings[s] for s in cpu_side):.0%} of "
      f"their time; augmenting the batch on the device takes "
      f"""{timings['augment, the batch (device)']
           / timings['augment, per image (CPU)']:.0%} of """
      "augmenting image by image on the CPU.")

# %% [markdown]
# The table is this machine's, printed as measured: read it before the prose below, which says
# how to read any such table rather than what this one holds.
#
# Each stage, were it the only one, would allow the images a second of its last column; the
# pipeline runs no faster than its slowest stage, the **bottleneck**. On a GPU the compute row
# shrinks by one to two orders of magnitude while the CPU rows stay where they are, so a pipeline
# that keeps up on a laptop can starve a GPU. Compare the two augmentation rows, the same
# transformations of the same 64 images: one at a time, every small tensor pays the overheads
# of each operation (a function call, a kernel launch on a GPU) that a batch pays once.
#
# **Loader workers** run the CPU stages of different batches side by side, each in its own
# process, while the training process copies and computes. With `workers` $= 0$ the training
# process does everything in turn; with $W \ge 1$ workers (on enough cores), the loader delivers a
# batch every $t_\text{loader} / W$, and the training process needs $t_\text{main}$ per batch, so
#
# $$\text{images/s} = \frac{B}{t_\text{loader} + t_\text{main}} \text{ for } W = 0, \qquad
# \frac{B}{\max(t_\text{loader} / W,\ t_\text{main})} \text{ for } W \ge 1.$$
#
# Here $t_\text{loader}$ is the sum of the loader's stages (read, decode, CPU augmentation,
# collate) and $t_\text{main}$ the sum of the training process's (copy, device augmentation,
# compute), each per batch.

# %%
def predicted_images_per_s(loader_ms, main_ms, batch_size, workers):
    """Images a second by the model above, from the loader's and the training process's
    milliseconds per batch."""
    if workers == 0:
        return batch_size / (loader_ms + main_ms) * 1000
    return batch_size / max(loader_ms / workers, main_ms) * 1000


# %% [markdown]
# **Exercise 2.** Plan a node's loader from a table of stage timings like the one above. Write
# `plan_loader(timings, loader_stages, cores)`. `timings` maps each stage to its milliseconds
# per batch; `loader_stages` names the stages the loader's workers run, and the others are the
# training process's; the training process keeps one of the `cores` and the workers may have
# the rest. Return `(stage, workers)`: the loader's stage to speed up first, and the fewest
# workers with which the loader keeps up with the training process (one more would not raise
# images/s), or `None` for workers if the cores left are not enough for that.

# %% nbgrader={"grade": false, "grade_id": "plan_loader", "locked": false, "schema_version": 3, "solution": true, "task": false}
def plan_loader(timings, loader_stages, cores):
    ### BEGIN SOLUTION
    loader_ms = sum(timings[stage] for stage in loader_stages)
    main_ms = sum(ms for stage, ms in timings.items() if stage not in loader_stages)
    workers = max(1, math.ceil(loader_ms / main_ms))
    slowest = max(loader_stages, key=timings.get)
    return slowest, workers if workers <= cores - 1 else None
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "plan_loader_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
assert plan_loader({"decode": 20, "collate": 4, "compute": 10}, ["decode", "collate"],
                   cores=8) == ("decode", 3), (
    "the loader's slowest stage, and the fewest workers whose images keep up with the "
    "training process")
### BEGIN HIDDEN TESTS
node = {"read": 2, "decode": 30, "augment": 12, "collate": 1, "copy": 1, "compute": 10}
cpu_stages = ["read", "decode", "augment", "collate"]
assert plan_loader(node, cpu_stages, cores=8) == ("decode", 5)  # 45 ms against 11
assert plan_loader(node, cpu_stages, cores=6) == ("decode", 5)  # one for the training
assert plan_loader(node, cpu_stages, cores=5) == ("decode", None)
assert plan_loader(node, cpu_stages, cores=1) == ("decode", None)  # none for a worker
# the loader is not where the time goes: one worker keeps up
assert plan_loader({**node, "compute": 200}, cpu_stages, cores=8) == ("decode", 1)
# the slowest of the loader's stages, not of all of them
assert plan_loader({**node, "augment": 40}, ["read", "decode", "collate"],
                   cores=16) == ("decode", 1)  # 33 ms against 51
assert plan_loader({"read": 30, "compute": 10}, ["read"], cores=4) == ("read", 3)
# the model's answer: with that many workers, one more gains nothing, one fewer loses
for table, loader in ((node, cpu_stages), ({"a": 7, "b": 5, "c": 3}, ["a", "b"])):
    _, w = plan_loader(table, loader, cores=64)
    loader_ms = sum(table[s] for s in loader)
    main_ms = sum(table.values()) - loader_ms
    rate = [predicted_images_per_s(loader_ms, main_ms, 64, n)
            for n in (w - 1, w, w + 1)]
    assert rate[1] == rate[2] and (w == 1 or rate[0] < rate[1])
### END HIDDEN TESTS

# %% [markdown]
# The plan for this lesson's measurements. The stage augments on the device by default, so its
# loader reads, decodes and collates; the training process copies, augments and computes. Then
# the same table with the compute fifty times faster, as a GPU would make it, and the CPU rows
# as they are.

# %% tags=["demo"]
cores = len(os.sched_getaffinity(0))
loader_side = ["read", "decode", "collate"]
main_side = ["copy to the device", "augment, the batch (device)",
             "compute (forward, backward, step)"]
here = {stage: timings[stage] for stage in loader_side + main_side}
with_a_gpu = {**here, main_side[-1]: here[main_side[-1]] / 50}
for name, table in (("here", here), ("with a GPU's compute", with_a_gpu)):
    slowest, workers = plan_loader(table, loader_side, cores)
    print(f"{name}: speed up '{slowest}' first; " + (
        f"{workers} loader worker(s) keep up" if workers
        else f"the {cores - 1} core(s) left for workers are too few to keep up"))

# %% [markdown]
# Now measure the real loader: the stage's `DataLoader` with 0, 1 and 2 workers, augmenting on the
# CPU in the workers (`--augment cpu`, the slow way, so that the workers have work to share), the
# training process doing only the copy (no model), and compare with the model's prediction from
# the timings above. On a laptop with two cores, two workers and the training process share them.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *More loader workers are always faster.* Past the cores the job was given, workers
#   take turns; past the slowest stage's share they add nothing (exercise 2's model).
# - Say here: what the kit's batch files give each GPU in cores and loader workers.
# :::

# %% tags=["demo"]
loader_ms = sum(timings[s] for s in cpu_side)
copy_ms = timings["copy to the device"]
WORKERS = [0, 1, 2]
measured = {}
for workers in WORKERS:
    loader = batches_of("files", workers, BATCH, augment="cpu")
    measured[workers] = pipeline.samples_per_second(
        loader, batches=6, work=lambda x, y: x.to(DEVICE, non_blocking=True))
    del loader
predicted = {w: predicted_images_per_s(loader_ms, copy_ms, BATCH, w) for w in WORKERS}
display(Markdown("| loader workers | predicted images/s | measured images/s |\n"
                 "|---:|---:|---:|\n"
                 + "\n".join(f"| {w} | {predicted[w]:,.0f} | {measured[w]:,.0f} |"
                             for w in WORKERS)))
print(f"{cores} core(s) here. From 0 to {WORKERS[-1]} workers the loader went "
      f"{measured[WORKERS[-1]] / measured[0]:.1f}x as fast (predicted: "
      f"{predicted[WORKERS[-1]] / predicted[0]:.1f}x).")

# %% [markdown]
# Where the measurement falls short of the prediction, something the model leaves out is in the
# way: the cores (two workers and the training process on two cores take turns), starting the
# workers, and handing each batch from a worker to the training process (through shared memory).
# On a GPU node, give each GPU's process its share of the cores (`--cpus-per-task`) and a worker
# for most of them: the kit's batch files start `cores - 1` workers, at most 16, with
# `pin_memory=True`. Pinned memory and `.to(device, non_blocking=True)` free the CPU thread:
# the call returns before the copy is done, and the process goes on to queue the step's kernels.
# They do not make the copy overlap the previous step's compute: the stage copies on the default
# CUDA stream, where it waits behind that step's kernels. Overlap needs the copy of the next
# batch on a second stream while this one computes (a *prefetcher*), or a loader that does it
# for you: NVIDIA DALI decodes, augments and copies on the GPU in a pipeline of its own, and is
# worth it when the CPU cores, not the copy, are what a node lacks. At this lesson's sizes the
# copy is a small part of a step (the table above).
#
# ## Augmentation on the device
#
# Per-image augmentation in the workers has two costs on a GPU node: CPU time, of which there is
# little per GPU (often 8 to 16 cores for a GPU that trains on thousands of images a second), and
# four times the bytes to copy, since the workers hand over floats instead of the decoded `uint8`
# pixels. `--augment device` (the stage's default) copies the `uint8` batch and augments all of it
# at once on the GPU with Kornia, where it takes a small fraction of a step. The same
# measurement as above, with the augmentation moved:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *Augmenting on the GPU costs training time.* It takes a small fraction of a step there
# and frees the CPU cores that decode.
# :::

# %% tags=["demo"]
moved_rate = {}
for augment in ("cpu", "device"):
    loader = batches_of("files", 1, BATCH, augment=augment)
    moved_rate[augment] = pipeline.samples_per_second(
        loader, batches=6, work=lambda x, y: stage.to_inputs(x, DEVICE, on_device))
    del loader
print(f"1 worker, augmenting in the worker: {moved_rate['cpu']:,.0f} images/s; "
      f"decoding in the "
      f"worker and augmenting the batch on the device ({DEVICE.type}): "
      f"{moved_rate['device']:,.0f} images/s, "
      f"{moved_rate['device'] / moved_rate['cpu']:.1f}x.")

# %% [markdown]
# (With the augmentation on the CPU, `to_inputs` finds floats and only normalises them; with it on
# the device, it augments the `uint8` batch first.) On a CPU-only machine, "the device" is the same
# cores, so the gain comes from batching alone; on a GPU node the augmentation leaves the CPU
# altogether.
#
# ## The stage: DDP on 1 and 2 processes
#
# `solutions/train_resnet_ddp.py` puts it together: a ResNet under DDP, fed from either layout
# (`--layout files|shards`), `--workers` loader processes with pinned memory and prefetching, the
# augmentation on the device, `channels_last` memory (the layout GPU convolutions run fastest in)
# and the device's precision (bf16 where the hardware has it, fp16 with a gradient scaler where it
# has not). Its run directory is the GPT stages': `metrics.jsonl` with images/s and `wait_ms`, the
# time each step waited for its batch, checkpoints, `--resume`, and a checkpoint on SIGUSR1
# before a time limit. A resumed run goes on with the very batch it stopped before, in either
# layout.
#
# Two short runs from the shards at the same global batch of 64 images a step: one process with
# all of it, and two with 32 each (strong scaling, as in lesson 02). They do not train exactly the
# same model, as lesson 02's GPT runs did: batch normalisation computes its statistics over each
# process's own images, and each process draws its own augmentations.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *A slow run needs more GPUs.* If `wait_ms` is a large part of `ms`, the GPUs already
# wait for data; more of them wait too.
# :::

# %% tags=["demo"]
STEPS, GLOBAL_BATCH = 120, 64
RUN_FLAGS = ["--data", str(DATA), "--layout", "shards", "--workers", "1", "--width",
             "8", "--lr", "0.05", "--max-steps", str(STEPS), "--eval-interval",
             str(STEPS // 3), "--ckpt-interval", str(STEPS)]
NPROC = 2
# ranks cannot share a GPU
RUN_DEVICE = "auto" if torch.cuda.device_count() >= NPROC else "cpu"


def train(name, processes):
    """The stage on `processes` processes (torchrun for more than one), GLOBAL_BATCH
    images a step between them; its metrics."""
    out = RUNS / name
    launcher = launch.torchrun(processes) if processes > 1 else [sys.executable]
    command = [*launcher, str(KIT_ROOT / "solutions" / "train_resnet_ddp.py"),
               *RUN_FLAGS, "--batch-size", str(GLOBAL_BATCH // processes),
               "--device", RUN_DEVICE if processes > 1 else DEVICE.type, "--out",
               str(out)]
    result = subprocess.run(command, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    lines = result.stdout.splitlines()
    print("\n  ".join([f"{processes} process(es):", lines[0], lines[-1]]))
    return runs.read_metrics(out)


one, two = train("ddp-1", 1), train(f"ddp-{NPROC}", NPROC)

# %% tags=["demo"]
def median(metrics, key, skip=5):
    """The median over the steps after the first few (start-up, the workers' first
    batches)."""
    return float(np.median([r[key] for r in metrics[skip:]]))


fig, ax = plt.subplots(figsize=(6, 3.5))
for name, metrics in (("1 process", one), (f"{NPROC} processes", two)):
    ax.plot([r["step"] for r in metrics], [r["loss"] for r in metrics], label=name)
ax.set(xlabel="step", ylabel="training loss",
       title=f"ResNet on the shapes: {GLOBAL_BATCH} images a step")
ax.legend()
plt.show()
for name, metrics in (("1 process", one), (f"{NPROC} processes", two)):
    accuracy = ", ".join(f"{r['val_acc']:.0%} at step {r['step']}" for r in metrics
                         if "val_acc" in r)
    print(f"{name}: {median(metrics, 'images_per_s'):,.0f} images/s, a step "
          f"{median(metrics, 'ms'):.0f} ms of which "
          f"{median(metrics, 'wait_ms'):.1f} ms waiting "
          f"for its batch; validation accuracy {accuracy} (chance: "
          f"{1 / len(META['classes']):.0%})")
# What this shows is checked too (the kit's tests run the lesson under nbval): the 2
# processes, each reading its own shards with its loader worker and augmenting on the
# device, learned the shapes well above chance, timed every step, and kept the last
# step's checkpoint.
assert [r["step"] for r in two] == list(range(1, STEPS + 1))
assert two[-1]["val_acc"] > 0.3, two[-1]
assert all(r["images_per_s"] > 0 and 0 <= r["wait_ms"] <= r["ms"] for r in two)
assert runs.read_json(RUNS / f"ddp-{NPROC}" / "config.json")["world_size"] == NPROC
assert runs.load_checkpoint(RUNS / f"ddp-{NPROC}")[0] == STEPS

# %% [markdown]
# `wait_ms` is the number to watch on a cluster: a step that waits for its batch is a GPU that
# idles, and no amount of GPUs fixes it. When it is more than a few percent of `ms`, add workers
# (and the cores for them), move the augmentation to the device, or store the data as shards on a
# file system that streams them. The other half of a step is DDP's all-reduce, which lesson 02
# measured; on a CPU the two processes also share the same cores, so their images a second tell
# little about a GPU node.
#
# On a cluster, `batchfiles/<site>/batch-images.sh` prepares the images (the real sites' profiles
# draw the shapes at ImageNet's 224 pixels, as shards only; point it at ImageNet itself with
# `--source`) and `batch-resnet-<N>n<G>g.sh` trains on them, with a loader worker per core.
#
# ## Large batches: warm-up and layer-wise learning rates
#
# Data parallelism grows the global batch with the GPUs: 256 GPUs at 128 images each is a batch of
# 32,768 ImageNet images, 40 steps an epoch. Lesson 02's **linear scaling rule** (Goyal et al.
# 2017: the learning rate in proportion to the batch, $0.1 \times B / 256$ for ResNet-50 with SGD)
# with a **warm-up** from a small rate over the first epochs trained ResNet-50 at a batch of 8,192
# as well as at 256. Beyond that it fails: at the start of training, a rate as large as
# $0.1 \times 32768/256 = 12.8$ makes some layers' updates larger than their weights.
#
# **LARS** (layer-wise adaptive rate scaling, You et al. 2017) gives every layer its own rate, in
# proportion to its **trust ratio**
#
# $$\text{trust} = \eta\, \frac{\lVert w \rVert}{\lVert \nabla w \rVert + \lambda \lVert w \rVert},$$
#
# with $\eta$ a small constant (0.001) and $\lambda$ the weight decay, so that each layer's update
# is a set fraction of its weights whatever the scale of its gradient. **LAMB** (You et al. 2019)
# does the same for Adam's update, and trained BERT with batches of 64k. How different are the
# ratios of a network's layers? Exercise 3 computes them.
#
# **Exercise 3.** Write `trust_ratios(model, weight_decay, eta=0.001)`: a dictionary from the name
# of each parameter that has a gradient (`model.named_parameters()`, in that order) to its trust
# ratio as a Python float, the norms being the 2-norms of the whole tensor. A parameter whose
# weights or gradient are all zero gets 1.0 (LARS leaves its rate alone).

# %% nbgrader={"grade": false, "grade_id": "trust_ratios", "locked": false, "schema_version": 3, "solution": true, "task": false}
def trust_ratios(model, weight_decay, eta=0.001):
    ### BEGIN SOLUTION
    ratios = {}
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            continue
        w, g = parameter.detach().norm().item(), parameter.grad.detach().norm().item()
        ratios[name] = eta * w / (g + weight_decay * w) if w > 0 and g > 0 else 1.0
    return ratios
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "trust_ratios_tests", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
layer = torch.nn.Linear(2, 1)
with torch.no_grad():
    layer.weight.copy_(torch.tensor([[3.0, 4.0]]))  # norm 5
    layer.bias.zero_()
layer.weight.grad = torch.tensor([[0.0, 2.0]])  # norm 2
layer.bias.grad = torch.tensor([1.0])
ratios = trust_ratios(layer, weight_decay=0.0)
assert list(ratios) == ["weight", "bias"] and all(isinstance(r, float)
                                                  for r in ratios.values())
assert abs(ratios["weight"] - 0.001 * 5 / 2) < 1e-12
assert ratios["bias"] == 1.0  # its weights are zero
### BEGIN HIDDEN TESTS
assert abs(trust_ratios(layer, 0.1, eta=0.01)["weight"]
           - 0.01 * 5 / (2 + 0.5)) < 1e-12
layer.weight.grad = torch.zeros(1, 2)
assert trust_ratios(layer, 0.1)["weight"] == 1.0  # no gradient to scale by
torch.manual_seed(808)  # the hidden tests' own network
net = ResNet(3, width=4)
net(torch.randn(2, 3, 8, 8)).sum().backward()
net.head[2].bias.grad = None  # a parameter without a gradient is left out
got = trust_ratios(net, 5e-4)
# the batch norms' biases start at zero: ratio 1.0
norms = {name: (p.norm().item(), p.grad.norm().item())
         for name, p in net.named_parameters()
         if p.grad is not None}
expected = {name: 0.001 * w / (g + 5e-4 * w) if w > 0 and g > 0 else 1.0
            for name, (w, g) in norms.items()}
assert list(got) == list(expected) and "head.2.bias" not in got
assert all(abs(got[name] - expected[name]) <= 1e-9 * expected[name]
           for name in expected)
### END HIDDEN TESTS

# %% [markdown]
# The trust ratios of the weights of the convolutions and of the final linear layer, in the order
# the data flows through them, on one batch of training images: for a ResNet as it starts
# (where warm-up and LARS matter most), and for the one the 2-process run trained.

# %% tags=["demo"]
def weight_ratios(network, pixels, labels):
    """Trust ratios of the convolution and linear weights, after a backward pass of one
    batch."""
    network.zero_grad()
    torch.nn.functional.cross_entropy(network(stage.to_inputs(pixels, "cpu", None)),
                                      labels).backward()
    weights = {name for name, p in network.named_parameters() if p.dim() >= 2}
    return {name: r for name, r in trust_ratios(network, 5e-4).items()
            if name in weights}


x, y = next(iter(batches_of("files", 0, 64)))
torch.manual_seed(0)
networks = {"at initialisation": stage.make_model("kit", len(META["classes"]), 8,
                                                  META["size"]),
            f"after {STEPS} steps": stage.make_model("kit", len(META["classes"]), 8,
                                                     META["size"])}
networks[f"after {STEPS} steps"].load_state_dict(
    runs.load_checkpoint(RUNS / f"ddp-{NPROC}")[1]["model"])
fig, ax = plt.subplots(figsize=(7, 3.2))
for when, network in networks.items():
    ratios = weight_ratios(network, x, y)
    ax.semilogy(range(len(ratios)), list(ratios.values()), "o-", label=when)
    low, high = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
    print(f"{when}: {len(ratios)} weights, trust ratios from {ratios[low]:.2g} ({low}) "
          f"to "
          f"{ratios[high]:.2g} ({high}), a factor of {ratios[high] / ratios[low]:.0f}")
ax.set(xlabel="layer, input to output", ylabel="trust ratio (log scale)",
       title="LARS trust ratios of the ResNet's weights")
ax.legend()
plt.show()


# %% [markdown]
# One learning rate for all of these layers is a compromise: the rate that keeps the layer with the
# smallest ratio stable moves the others much less than they could move. LARS and LAMB replace
# the compromise with a rate per layer; warm-up covers the first steps, when gradients are large
# and the weights still random. Neither is needed at the batches of this course: reach for them,
# and re-tune, only when a run's global batch outgrows what linear scaling and warm-up hold.

# %% [markdown]
# ## Key points
#
# - An image takes five stages to reach the model: read, decode, augment, collate and copy, then
#   compute. Time each on one batch: the slowest bounds the images a second, and on a GPU it is
#   rarely the compute.
# - `DataLoader` workers run the CPU stages side by side with training; with $W$ workers,
#   images/s $\approx B / \max(t_\text{loader}/W, t_\text{main})$ until the cores run out. Give
#   each GPU's process its cores and a worker for most of them, and `pin_memory=True`.
# - A parallel file system pays per file opened: store an image data set as large shards
#   (WebDataset tar files) that stream, not a million small files.
# - Deal the data: `DistributedSampler` with `set_epoch` for files; whole shards per process and
#   per worker (`split_by_node`, `split_by_worker`) for shards, at least processes $\times$ workers
#   of them.
# - Augment on the device, a batch at a time (Kornia, torchvision v2): it frees the CPU and copies
#   `uint8` pixels, a quarter of the bytes of floats.
# - `wait_ms` against `ms` in `metrics.jsonl` tells whether a step waited for its data.
# - Very large batches need warm-up and layer-wise rates (LARS for SGD, LAMB for Adam): the
#   layers' trust ratios differ widely, most of all at the start of training.
