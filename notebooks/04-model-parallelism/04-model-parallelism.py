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
# # 04 · Model parallelism: FSDP, tensor and pipeline parallelism
#
# **Questions.** This lesson answers
# - Where does training memory go, and what if the model does not fit one GPU?
# - What do FSDP, tensor and pipeline parallelism each split, and what do they send?
# - Which strategy, or mix, suits a given model and machine?
#
# **Objectives.** After this lesson you can
# - add up the memory of training (parameters, gradients, optimiser state, activations) in bytes
#   per parameter, and say which part outgrows a GPU first;
# - say what DDP, ZeRO-1/2/3 (FSDP), tensor parallelism (TP) and pipeline parallelism (PP) each
#   split across the GPUs, and what each sends over the network;
# - turn the DDP script into the FSDP2 script, and that into the tensor-parallel and the pipeline
#   scripts, hunk by hunk, and check your copies: each applies its parallelism to one model;
# - predict the bytes each rank holds and compare them with what the runs measure;
# - trade memory for time with activation checkpointing, and measure the trade;
# - compute a pipeline's bubble $(p-1)/(m+p-1)$ and measure it against the number of
#   microbatches;
# - choose a strategy, or a combination, from a model's size and a batch's shape.
#
# **Prerequisites.** Lesson 02: ranks, all-reduce, the global batch, `torchrun`.
#
# **Time.** About 3 hours, in three parts (the end of each is marked): about 45 minutes for
# memory and FSDP, 25 for tensor and pipeline parallelism, and over 2 hours for the lab: the
# conversions of the stage scripts, most of it typing the diffs' lines, then exercise 4. The
# times are estimates of reading, the exercises, and waiting for the cells on a laptop's CPU; the
# instructor guide says how they are made.

# %%
import matplotlib.pyplot as plt
import psutil
import torch
from IPython.display import Markdown, display

from coursekit import (KIT_ROOT, data, diffs, exercise, memory, presets, runs, stages,
                       widgets)
from coursekit.launch import torchrun
from solutions import gpt

# %% [markdown]
# The set-up: the standard library's modules the lesson uses, the offline corpus, the model
# sizes of the tiny preset and of GPT-2 124M, and your working copies of the scripts.

# %%
import ctypes
import ctypes.util
import gc
import json
import shutil
import subprocess
import time
from pathlib import Path

DATA = KIT_ROOT / "data" / "builtin"
if not (DATA / "meta.json").exists():  # the offline corpus: built in seconds, once
    data.prepare_builtin(DATA)
tiny = presets.get_preset("tiny")
TINY, GPT2 = (memory.Model.from_preset(tiny),
              memory.Model.from_preset(presets.get_preset("gpt2-124m")))
GPUS = torch.cuda.device_count()
print(f"torch {torch.__version__}; GPUs visible: {GPUS}")
LESSON = "04-model-parallelism"
# your working copies, next to this notebook: one per diff of the lesson
FSDP_COPY, TP_COPY, PP_COPY = (Path(name).resolve() for name in
                               ("train_gpt2.py", "train_gpt2_tp.py",
                                "train_gpt2_pp.py"))

# %% [markdown]
# ## When one GPU is not enough
#
# Training keeps four things in memory:
#
# $$\text{memory} = \underbrace{\text{parameters} + \text{gradients} + \text{optimiser state}}_{\text{grow with the model}} + \underbrace{\text{activations}}_{\text{grow with batch} \times \text{sequence}}$$
#
# With AdamW the optimiser keeps two numbers per parameter (the running mean and variance of the
# gradient), in fp32. Per parameter, in bytes:
#
# | precision | parameters | gradients | Adam $m, v$ | total |
# |---|---|---|---|---|
# | fp32 | 4 | 4 | 8 | *16* |
# | bf16 mixed | 4 (fp32 master) + 2 (bf16 copy) | 4 (reduced in fp32) | 8 | *18* |
#
# This is the kit's accounting for PyTorch's autocast, which its stages use: the parameters stay
# fp32 and serve as the master copy, their gradients are fp32, and forward and backward use a
# 16-bit copy of each weight. The ZeRO paper and DeepSpeed count *16* bytes for mixed precision
# instead: 2 (16-bit parameters) + 2 (16-bit gradients) + 12 (fp32 master copy, $m$ and $v$),
# because there the 16-bit weights are the model and the gradients are 16-bit. Same optimiser
# state, different bookkeeping of the copies and gradients; compare like with like.
#
# Mixed precision saves activation memory and time, not parameter memory: the fp32 master weights
# and the optimiser stay. GPT-2 124M needs about 2 GB for these three parts, which is nothing on
# an 80 GB GPU; a 7-billion-parameter model needs about 126 GB, which fits no single GPU.
#
# **Which 16 bits.** bf16 keeps fp32's 8 exponent bits and drops mantissa bits: it covers the
# same range of magnitudes, coarser. fp16 has 5 exponent bits: more precision, but numbers
# below about $6 \times 10^{-8}$ become 0, and many gradients are that small. GPUs from NVIDIA's
# Ampere (A100) and AMD's MI100 on compute in bf16; older ones (V100, T4) only in fp16, where
# PyTorch emulates bf16 slowly. There the stages (`--precision auto`) train in fp16 with **loss
# scaling**: the loss is multiplied by a large factor $S$ (65,536 to start) before backward, so
# every gradient is $S$ times larger and clears fp16's floor; before the optimiser step the
# gradients are divided by $S$ again (`torch.amp.GradScaler`: `scale`, `unscale_`, `step`,
# `update`). A step whose gradients overflowed to inf or NaN is skipped and $S$ halved; after
# 2,000 clean steps $S$ doubles. Under FSDP every rank must skip together, so the stages use the
# sharded scaler, which all-reduces the overflow flag.
#
# **Activations** are what forward keeps for backward: about $40\,b\,T\,d$ *bytes* per block
# in 16-bit training, for a micro-batch of $b$ samples of $T$ tokens and width $d$ (Korthikanti et
# al., 2022, count $34\,sbh$ with flash attention; here the LayerNorms' inputs stay fp32, and q, k
# and v each keep their own 16-bit copy of their input), $64\,b\,T\,d$ in fp32, plus the logits,
# $b \times T \times$ vocabulary values. The loss turns them into fp32 a chunk of tokens at a time,
# so as backward starts only their gradients join them (2 more bytes per logit in 16-bit, and one
# chunk's fp32 work; `logit_grads` in the calculator below): with GPT-2's 50,304-word
# vocabulary, nearly as much as the twelve blocks' activations. None of this depends
# on the number of parameters, and data parallelism never splits it: only a smaller micro-batch,
# **activation checkpointing** (keep each block's input, recompute the rest in backward) or a
# model-parallel split makes it smaller.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *Everyone counts bytes per parameter the same way.* The kit counts 18 for bf16 mixed
# with autocast, ZeRO's paper 16; ask which copy each byte is.
# :::

# %%
for name, model in (("tiny", TINY), ("GPT-2 124M", GPT2),
                    ("GPT-2 1.5B", widgets.MODELS["GPT-2 1.5B"]),
                    ("7B shape", widgets.MODELS["7B shape"])):
    ddp = memory.per_rank_bytes(model, "ddp", 1, "bf16-mixed", micro_batch=8,
                                seq_len=1024)
    states = ddp["params"] + ddp["grads"] + ddp["optimizer"]
    print(f"{name:11s} {model.parameters / 1e9:6.2f} B parameters: "
          f"params + grads + Adam "
          f"{states / 1e9:7.1f} GB, activations (8 x 1024 tokens) "
          f"{ddp['activations'] / 1e9:6.1f} GB")

# %% [markdown]
# ## What each strategy splits, and what it sends
#
# $N$ GPUs can share the work in different ways. The **ZeRO** stages (Rajbhandari et al., 2020)
# keep data parallelism (every rank runs the whole model on its own samples) but stop every rank
# from storing everything:
#
# | strategy | split across the $N$ ranks | sent per step, per rank | where it shines |
# |---|---|---|---|
# | DDP | nothing | all-reduce of the gradients ($\approx 2\times$ their size) | the model fits: simplest, fastest |
# | ZeRO-1 | optimiser state | reduce-scatter gradients, all-gather parameters ($\approx 2\times$) | optimiser state is the biggest part |
# | ZeRO-2 | + gradients | the same | |
# | **FSDP** (ZeRO-3) | + parameters: every rank holds $1/N$ of everything | all-gather each block's parameters in forward *and* backward, reduce-scatter gradients ($\approx 3\times$) | the model does not fit; the default choice |
# | **tensor parallel** (TP) | every matrix, by columns or rows; with sequence parallelism, the activations too | all-reduces (or all-gather + reduce-scatter) of activations, twice per block, forward and backward | one layer or its activations are too big; inside a node (NVLink) |
# | **pipeline parallel** (PP) | consecutive blocks: stage $s$ holds blocks of its own | each microbatch's activations, sent to the next stage (and gradients back) | many nodes on a slow network; very deep models |
#
# FSDP cuts only the parameter, gradient and optimiser memory. TP with sequence parallelism
# splits the activations as well: each rank computes a part of every layer and keeps its part of
# each activation. PP does not, although each stage holds only some blocks: under 1F1B (part 2)
# the first of $p$ stages keeps $p$ microbatches in flight, each with the activations of its
# $L/p$ blocks, so $L$ blocks' worth of one microbatch, as much as an unsplit rank. The kit's
# memory model shows it for GPT-2 124M (micro-batch 8 of 1,024 tokens, bf16):

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *FSDP cuts activation memory.* Spot it in out-of-memory errors at long sequences on
# many GPUs. FSDP shards parameters, gradients and optimiser state; activations need
# checkpointing, or TP with sequence parallelism. Not PP: under 1F1B its first stage
# keeps as many activations as an unsplit rank (`coursekit.memory.pipeline_stage_bytes`
# shows it).
# :::

# %% tags=["demo"]
for ranks in (1, 2, 4):
    held = {strategy: memory.per_rank_bytes(GPT2, strategy, ranks, "bf16-mixed", 8,
                                            1024)["activations"]
            for strategy in ("fsdp", "tp")}
    held["pp, first stage"] = memory.pipeline_stage_bytes(GPT2, ranks, "bf16-mixed", 8,
                                                          1024)[0]["activations"]
    print(f"{ranks} ranks, activations per rank: "
          + ", ".join(f"{name} {value / 1e9:.2f} GB" for name, value in held.items()))

# %% [markdown]
# Large trainings combine them: **2-D** (FSDP across nodes × TP inside a node) or **3-D** (with
# PP), and checkpoint activations where they still do not fit.
#
# **Exercise 1.** Write `bytes_per_rank(n_params, strategy, world_size)`: a dictionary with the
# fp32 bytes of `"params"`, `"grads"` and `"optimizer"` (Adam's two states) that one of
# `world_size` ranks holds under `"ddp"`, `"zero1"`, `"zero2"` or `"fsdp"`.

# %% nbgrader={"grade": false, "grade_id": "zero_bytes", "locked": false, "schema_version": 3, "solution": true, "task": false}
def bytes_per_rank(n_params, strategy, world_size):
    ### BEGIN SOLUTION
    level = ["ddp", "zero1", "zero2", "fsdp"].index(strategy)
    share = lambda sharded: 1 / world_size if sharded else 1  # noqa: E731
    return {"params": 4 * n_params * share(level >= 3),
            "grads": 4 * n_params * share(level >= 2),
            "optimizer": 8 * n_params * share(level >= 1)}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "zero_bytes_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
assert bytes_per_rank(1000, "ddp", 4) == {"params": 4000, "grads": 4000,
                                          "optimizer": 8000}
assert bytes_per_rank(1000, "fsdp", 4) == {"params": 1000, "grads": 1000,
                                           "optimizer": 2000}
### BEGIN HIDDEN TESTS
expected = {strategy: memory.per_rank_bytes(GPT2, strategy, 16)
            for strategy in memory.DATA_PARALLEL}
with exercise.own_work(memory.per_rank_bytes, memory.data_parallel_bytes,
                       memory.replicated_bytes):
    assert bytes_per_rank(1000, "zero1", 8) == {"params": 4000,
                                                "grads": 4000, "optimizer": 1000}
    assert bytes_per_rank(1000, "zero2", 2) == {"params": 4000,
                                                "grads": 2000, "optimizer": 4000}
    for strategy in memory.DATA_PARALLEL:
        got = bytes_per_rank(GPT2.parameters, strategy, 16)
        assert all(abs(got[part] - expected[strategy][part]) < 1e-3
                   for part in got), strategy
### END HIDDEN TESTS

# %% [markdown]
# ### A memory calculator
#
# Move the controls: which strategy, how many ranks and which micro-batch make a model fit on
# 40, 64, 80 or 141 GB devices (a tenth of each is left to the CUDA context, the allocator and
# communication buffers)? Try the 7B shape on one GPU with DDP, then FSDP on 8, then activation
# checkpointing; then GPT-2 124M at a sequence of 8,192 tokens. The numbers come from
# `coursekit.memory`, the arithmetic above.

# %% tags=["demo"]
widgets.memory_calculator()

# %% [markdown]
# **Exercise 2.** Write `smallest_world_size(model, strategy, device_gb, micro_batch, seq_len)`:
# the smallest number of ranks, from 1 to 1,024, on which `memory.per_rank_bytes(model,
# strategy, ranks, "bf16-mixed", micro_batch, seq_len)` fits a device of `device_gb` GB
# (`memory.fits`), or `None` if none does. For `"pp"` the ranks cannot outnumber the blocks.

# %% nbgrader={"grade": false, "grade_id": "smallest_world", "locked": false, "schema_version": 3, "solution": true, "task": false}
def smallest_world_size(model, strategy, device_gb, micro_batch, seq_len):
    ### BEGIN SOLUTION
    largest = model.n_layer if strategy == "pp" else 1024
    for ranks in range(1, largest + 1):
        total = memory.per_rank_bytes(model, strategy, ranks, "bf16-mixed", micro_batch,
                                      seq_len)["total"]
        if memory.fits(total)[device_gb]:
            return ranks
    return None
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "smallest_world_tests", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
assert smallest_world_size(GPT2, "fsdp", 80, 8, 1024) == 1
seven_b = widgets.MODELS["7B shape"]
# DDP never splits the model
assert smallest_world_size(seven_b, "ddp", 80, 1, 4096) is None
### BEGIN HIDDEN TESTS
assert smallest_world_size(seven_b, "fsdp", 80, 1, 4096) == 3
# activations do not shrink
assert smallest_world_size(seven_b, "fsdp", 40, 1, 4096) == 9
assert smallest_world_size(seven_b, "tp", 40, 1, 4096) == 5  # activations split too
assert smallest_world_size(seven_b, "pp", 40, 1, 4096) == 11
assert smallest_world_size(widgets.MODELS["70B shape"], "pp", 40, 1, 4096) is None
### END HIDDEN TESTS

# %% [markdown]
# ## From `train_gpt2_ddp.py` to `train_gpt2_fsdp.py`, hunk by hunk
#
# FSDP2 (`torch.distributed.fsdp.fully_shard`) turns each parameter into a **DTensor** sharded
# along its first dimension over a **device mesh** of the $N$ ranks. `fully_shard(block)` makes
# one block a unit: just before the block runs, its shards are **all-gathered** into whole
# parameters, and freed again after; in backward they are gathered once more, and the gradients
# are **reduce-scattered** so that each rank keeps the gradient of its own shard. The optimiser
# then updates only local shards. Sharding every block, then the root (the embeddings and final
# norm), means few blocks' parameters are whole at a time: the block that runs, and the one whose
# all-gather FSDP2 has already started (it *prefetches*), so that the communication overlaps the
# compute. In forward that is the next block: its all-gather runs on a stream of its own while
# the current block computes. In backward it is the block before, the next to run backward:
# FSDP2 issues its all-gather, in the reverse of forward's order, before the current block's
# gradients are computed. The stage keeps these defaults; `set_modules_to_forward_prefetch` and
# `set_modules_to_backward_prefetch` prefetch more blocks, at the cost of more whole blocks in
# memory ([PyTorch's FSDP notes](https://docs.pytorch.org/docs/stable/notes/fsdp.html), and the
# [pull request that added them](https://github.com/pytorch/pytorch/pull/128884)).
#
# The model is the same `solutions/gpt.py` as in every stage: FSDP is applied to it from outside.
# The diff `diffs/ddp-fsdp.patch`:
#
# 1. the docstring; 2. imports: `torch.distributed.checkpoint` (DCP), `fully_shard`, the mesh;
# 3. `apply_activation_checkpointing` and `apply_fsdp`: shard every block, then the root; bf16
#    gathers on GPUs (`MixedPrecisionPolicy`), optional CPU offload;
# 4–5. checkpoints: *every* rank writes its shards in parallel with DCP, rank 0 publishes the
#    checkpoint; the optimiser state is kept under the parameters' names; loading reshards, so a
#    checkpoint of 2 ranks resumes on 1 or 4;
# 6. the new flags; 7. `apply_fsdp` over a mesh of the $N$ ranks replaces the DDP wrapper;
# 8. `set_requires_gradient_sync` replaces `no_sync`; the gradient norm of a sharded model is a
#    DTensor, whole after `full_tensor()`;
# 9. every rank saves (its shards) and generates (forward needs every rank's shards); each
#    rank's memory report (`coursekit.memory.report`: the bytes of its shards, and its peak).

# %% tags=["demo"]
working_copy = diffs.start_working_copy(LESSON, FSDP_COPY)
patch_text = diffs.patch_path(diffs.step_for_lesson(LESSON)).read_text()
added, removed = diffs.counts(patch_text)
print(f"{working_copy.name}: {len(working_copy.read_text().splitlines())} lines; "
      f"the patch adds {added} and removes {removed}")
for hunk in diffs.hunks(LESSON):
    display(Markdown(f"**hunk {hunk.number}**\n```diff\n{hunk.text}\n```"))

# %% [markdown]
# Edit `train_gpt2.py` in this folder one hunk at a time, then run the next cell (or
# `python -m coursekit diffs status --lesson 04-model-parallelism` in a terminal): every hunk is
# reported *applied*, *not yet applied* or *conflicting*, with the lines that differ.
# `python -m coursekit diffs apply --lesson 04-model-parallelism --hunk N` applies one for you.

# %% tags=["demo"]
print(diffs.report(LESSON, diffs.status(LESSON, FSDP_COPY)))

# %% [markdown]
# ## FSDP on 2 and 4 processes: the same model, a share of the memory each
#
# The runs below use the finished scripts in `solutions/`. Each rank of the FSDP stage writes
# `memory.json`: the bytes of the parameter, gradient and optimiser shards it holds, and its peak
# memory (the CUDA allocator's on a GPU, the process's resident set on a CPU). With fewer GPUs
# than processes the runs use CPU processes and gloo.

# %% tags=["demo"]
RUNS = Path("runs")


# With 4 GPUs, every run below trains on GPUs, the small model (the tiny one would leave
# them idle); with fewer, CPU processes train the tiny one, so that all runs compare
# alike.
RUN_PRESET = "small" if GPUS >= 4 else "tiny"
RUN_MODEL = memory.Model.from_preset(presets.get_preset(RUN_PRESET))


def launch(stage, processes, name, *flags, steps=6, preset=RUN_PRESET):
    """Run a stage script on `processes` processes (GPUs if there are enough, else CPU
    ones) and return (metrics, the per-rank memory report or None)."""
    out = RUNS / name
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time the cell runs
    device = "auto" if GPUS >= processes else "cpu"
    script = KIT_ROOT / "solutions" / f"train_gpt2_{stage}.py"
    command = [*torchrun(processes), str(script), "--preset", preset,
               "--device", device, "--data", str(DATA), "--out", str(out),
               "--max-steps", str(steps), "--eval-interval", str(steps),
               "--sample-tokens", "0", *map(str, flags)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    report = out / "memory.json"
    return runs.read_metrics(out), runs.read_json(report) if report.exists() else None


ddp_run, _ = launch("ddp", 2, "ddp-2")
fsdp_runs = {n: launch("fsdp", n, f"fsdp-{n}",
                       *(["--micro-batch", 1] if n == 4 else []))
             for n in (2, 4)}
for n, (metrics, _) in fsdp_runs.items():
    gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(metrics, ddp_run))
    print(f"fsdp on {n} processes: largest loss difference from ddp on 2 over "
          f"{len(metrics)} steps: {gap:.1e}")

# %% [markdown]
# Now the prediction against the measurement. `coursekit.memory` predicts each rank's bytes from
# the model's shape alone; the runs report the bytes of the tensors each rank really holds.

# %% tags=["demo"]
MiB = 2**20
rows = ["| processes | part | predicted MiB per rank | measured MiB (each rank) |",
        "|---|---|---|---|"]
for n, (_, reports) in fsdp_runs.items():
    predicted = memory.per_rank_bytes(RUN_MODEL, "fsdp", n)
    for part in ("params", "grads", "optimizer"):
        measured = ", ".join(f"{r[part] / MiB:.2f}" for r in reports)
        rows.append(f"| {n} | {part} | {predicted[part] / MiB:.2f} | {measured} |")
    peaks = ", ".join(f"{r['peak'] / MiB:.0f}" for r in reports)
    rows.append(f"| {n} | peak ({reports[0]['peak_kind']}) | | {peaks} |")
display(Markdown("\n".join(rows)))
off = max(abs(r[part] / memory.per_rank_bytes(RUN_MODEL, "fsdp", n)[part] - 1)
          for n, (_, reports) in fsdp_runs.items() for r in reports
          for part in ("params", "grads", "optimizer"))
print(f"largest difference between a rank's shard and the prediction: {off:.2%}")
assert off < 0.01  # FSDP's padding only

# %% [markdown]
# The shards agree with the arithmetic to within FSDP's padding (each parameter's first
# dimension is rounded up to a multiple of $N$). The peak is much larger than the shards: on a
# CPU it counts the whole Python process (PyTorch itself, the data, the gathered blocks and the
# activations), and for the tiny model the logits ($b \times T \times 50{,}304$ floats, and their
# gradient) dwarf the weights. On a GPU, with a large model, the shards are the big part.
#
# ### Activation checkpointing: memory for time
#
# With `--activation-checkpointing` each block keeps only its input in forward, and runs its
# forward again during backward: about a third more block compute for much less activation
# memory. The process's peak says little about activations (it holds everything else too), so
# we measure them directly, in this notebook: the memory a forward pass leaves behind for
# backward (the GPU allocator's count on a GPU; on a CPU the process's resident memory, after
# handing freed memory back to the system), with and without checkpointing, on the `small`
# preset's shape (6 blocks, 384 wide, 256-token samples), and the time of forward + backward.

# %% tags=["demo"]
fsdp = stages.load("fsdp")  # the stage script, for its apply_activation_checkpointing
small = presets.get_preset("small")
SMALL = memory.Model.from_preset(small)
device = torch.device("cuda" if GPUS else "cpu")
release_freed_memory = getattr(ctypes.CDLL(ctypes.util.find_library("c")),
                               "malloc_trim", None)


def memory_in_use():
    gc.collect()
    if device.type == "cuda":
        return torch.cuda.memory_allocated()
    # glibc keeps freed pages; give them back so RSS counts live tensors
    if release_freed_memory:
        release_freed_memory(0)
    return psutil.Process().memory_info().rss


MICRO_BATCH = 4  # samples of 256 tokens: enough for the activations to stand out


def activations_and_time(checkpointing, micro_batch=MICRO_BATCH):
    """(bytes that forward keeps for backward, seconds of forward + backward)."""
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=small.vocab_size, block_size=small.seq_len,
                                  n_layer=small.n_layer, n_head=small.n_head,
                                  n_embd=small.n_embd)).to(device)
    if checkpointing:
        fsdp.apply_activation_checkpointing(model)
    x = torch.randint(0, data.EOT_TOKEN, (micro_batch, small.seq_len), device=device)
    # a first pass allocates gradients, warms up
    gpt.cross_entropy(model(x), x).backward()
    before = memory_in_use()
    start = time.perf_counter()
    loss = gpt.cross_entropy(model(x), x)
    held = memory_in_use() - before
    loss.backward()
    return held, time.perf_counter() - start


trade = {}
for checkpointing in (False, True):
    held, seconds = activations_and_time(checkpointing)
    predicted = memory.activation_bytes(SMALL, MICRO_BATCH, small.seq_len, "fp32",
                                        checkpointing)
    trade[checkpointing] = (held, seconds)
    print(f"{'checkpointing' if checkpointing else 'plain':14s} "
          f"forward keeps {held / MiB:5.0f} MiB "
          f"(predicted {predicted / MiB:5.0f} MiB, {predicted / held - 1:+.0%}) | "
          f"forward + backward {seconds * 1000:5.0f} ms")
(plain_held, plain_s), (ckpt_held, ckpt_s) = trade.values()
print(f"checkpointing: {ckpt_s / plain_s:.2f}x the time for "
      f"{1 - ckpt_held / plain_held:.0%} "
      f"less activation memory")

# %% [markdown]
# Each line gives the prediction of `coursekit.memory` and how far it is from what forward really
# keeps: a few lines of arithmetic, against the allocator. Most of what checkpointing leaves is
# the logits ($4 \times 256 \times 50{,}304$ floats, which the loss keeps), untouched by checkpointing
# the blocks. The time it costs is on the last line: on this small model the output
# head, which is not recomputed, does most of the arithmetic, while on GPT-2-sized blocks
# recomputing them adds about a third to forward and backward.
#
# *End of part 1. Part 2, tensor and pipeline parallelism, and choosing a strategy, can follow
# after a break or in the next session.*
#
# ## Tensor parallelism: splitting every matrix
#
# A linear layer $Y = XW$ can be split two ways over $N$ ranks (Shoeybi et al., 2019, Megatron-LM):
#
# - **column-wise**: rank $r$ holds columns $W_{:,r}$ and computes $Y_{:,r} = X W_{:,r}$; every
#   rank needs the whole input $X$, and each ends with a slice of the output;
# - **row-wise**: rank $r$ holds rows $W_{r,:}$ and a slice of the input, computes a partial
#   product, and the partial products are *summed* across ranks (an all-reduce).
#
# A transformer block pairs them: q, k, v and the MLP's first layer column-wise (each rank gets
# whole attention heads and a slice of the hidden layer), the two output projections row-wise. So
# each block needs one all-reduce in attention and one in the MLP, in forward and again in
# backward. **Sequence parallelism** splits the LayerNorms and residual additions along the
# sequence instead, turning each all-reduce into a reduce-scatter plus an all-gather, the same
# traffic, with activations split $N$ ways everywhere.
#
# This traffic sits on the critical path of every layer, which is why TP stays inside a node,
# on NVLink, and FSDP goes across nodes. `solutions/train_gpt2_tp.py` does both: `--tp N` ranks
# per tensor-parallel group (default: the processes of a node), FSDP over the groups. It trains
# the same model: q, k and v are separate projections there for this lesson, since a column-wise
# split of GPT-2's fused `c_attn` would hand rank 0 all of q and half of k.
#
# ### From `train_gpt2_fsdp.py` to `train_gpt2_tp.py`, hunk by hunk
#
# The diff `diffs/fsdp-tp.patch`:
#
# 1. the docstring; 2. imports: the layouts (`Replicate`, `Shard`) and the tensor-parallel styles;
# 3. `apply_tp`, the plan: a dictionary from module names to `ColwiseParallel`, `RowwiseParallel`
#    and `SequenceParallel`, applied with `parallelize_module`; embeddings split over the
#    vocabulary, the logits left split for the loss; the tied matrix tied again;
# 4. evaluation computes the loss of vocabulary-split logits under `loss_parallel()`;
# 5. `--tp`, and the sizes it must divide; sampling through the split model (the context padded
#    for sequence parallelism, the logits gathered);
# 6. a 2-D device mesh, `dp` × `tp`: TP inside each group first, then FSDP across the groups
#    (`apply_fsdp` is unchanged, on the `dp` dimension); the ranks of a TP group read the same
#    microbatch, so data parallelism counts `dp`, not the processes;
# 7. the training step's loss, and its backward, under `loss_parallel()`;
# 8. the sample goes through the split model.
#
# Your working copy for this diff is `train_gpt2_tp.py`, started from the FSDP stage (with its
# own status: `python -m coursekit diffs status --lesson 04-model-parallelism --stage tp`).

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *Tensor parallelism works across nodes.* It all-reduces activations twice per block;
# it belongs inside a node's NVLink.
# :::

# %% tags=["demo"]
tp_copy = diffs.start_working_copy(LESSON, TP_COPY, stage="tp")
for hunk in diffs.hunks(LESSON, stage="tp"):
    display(Markdown(f"**hunk {hunk.number}**\n```diff\n{hunk.text}\n```"))
print(diffs.report(LESSON, diffs.status(LESSON, tp_copy, stage="tp")).splitlines()[-1])

# %% tags=["demo"]
tp_run, tp_reports = launch("tp", 2, "tp-2", "--tp", 2)
print(f"tp on 2 processes: largest loss difference from ddp over {len(tp_run)} steps: "
      f"{max(abs(a['loss'] - b['loss']) for a, b in zip(tp_run, ddp_run)):.1e}")
predicted = 4 * RUN_MODEL.tensor_parallel_parameters(2)
measured = ", ".join(f"{r['params'] / MiB:.2f}" for r in tp_reports)
print(f"parameters per rank: predicted {predicted / MiB:.2f} MiB, "
      f"measured {measured} MiB")

# %% [markdown]
# ## Pipeline parallelism and its bubble
#
# Pipeline parallelism gives each of $p$ ranks a **stage**: a run of consecutive blocks. A
# microbatch flows forward through the stages, then its gradient flows back. With one microbatch
# only one stage works at a time. Splitting the minibatch into $m$ microbatches lets the stages
# work on different microbatches at once; still, at the start of a step the later stages wait
# for their first input, and at the end the earlier stages wait for their last gradient. That
# idle time is the **bubble**. With every stage taking the same time $t$ per microbatch, a step
# takes $(m + p - 1)\,t$ instead of $m\,t$, so the idle fraction is
#
# $$\text{bubble} = \frac{p - 1}{m + p - 1}.$$
#
# Two schedules are offered by `solutions/train_gpt2_pp.py` (`--schedule`), both from
# `torch.distributed.pipelining`: **GPipe** runs all forwards, then all backwards (it keeps
# the activations of all $m$ microbatches); **1F1B** alternates one forward and one backward
# once the pipeline is full, with the same bubble but at most $p$ microbatches' activations in
# flight. More microbatches shrink the bubble, but smaller microbatches use a GPU less well.
#
# %%
def bubble_fraction(stages, microbatches):
    return (stages - 1) / (microbatches + stages - 1)


# %% [markdown]
# **Exercise 3.** Choose the number of microbatches. Say a stage takes `overhead + samples *
# per_sample` seconds for a microbatch of `samples` samples: a fixed cost each time (a send and
# a receive, the kernels of a small product) and a cost per sample. The minibatch's `batch`
# samples are split evenly, so the number of microbatches $m$ divides `batch`, and a step
# takes $m + p - 1$ microbatch times. Write `best_microbatches(stages, batch, overhead,
# per_sample)`: the $m$ with the shortest step, the fewest if several tie.

# %% nbgrader={"grade": false, "grade_id": "best_microbatches", "locked": false, "schema_version": 3, "solution": true, "task": false}
def best_microbatches(stages, batch, overhead, per_sample):
    ### BEGIN SOLUTION
    def step_time(m):
        return (m + stages - 1) * (overhead + batch / m * per_sample)

    return min((m for m in range(1, batch + 1) if batch % m == 0), key=step_time)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "best_microbatches_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
assert best_microbatches(4, 32, 0.0, 1.0) == 32  # no fixed cost: the smallest bubble
### BEGIN HIDDEN TESTS
assert best_microbatches(1, 32, 0.5, 1.0) == 1, (
    "one stage has no bubble to fill: every microbatch more only adds its fixed cost")
assert best_microbatches(4, 32, 1.0, 0.1) == 4  # 12.6 s; 2: 13.0 s, 8: 15.4 s
assert best_microbatches(2, 12, 0.2, 0.3) == 4  # 3 and 6 come within 0.1 s
assert best_microbatches(4, 24, 0.5, 0.25) == 6  # a divisor, not the formula's 5.5
assert best_microbatches(8, 64, 10.0, 0.01) == 1  # the fixed cost outweighs the bubble
assert best_microbatches(2, 6, 1.0, 1.0) == 2  # 2 and 3 tie at 12 s
### END HIDDEN TESTS

# %% [markdown]
# ### From `train_gpt2_fsdp.py` to `train_gpt2_pp.py`, hunk by hunk
#
# The pipeline stage starts from the FSDP stage too, and trains the same model: each rank builds
# the whole model from the same seed and deletes what its stage does not hold. The model's
# blocks are kept by index, so a stage's blocks keep their names (and its checkpoints stay
# readable); the first stage keeps the embeddings, the last the final norm and the head. The
# diff `diffs/fsdp-pp.patch`:
#
# 1. the docstring; 2. imports: `PipelineStage` and torch's two schedules;
# 3. the stage's share of the model: `stage_blocks` (an even split of the blocks), `keep_stage`;
#    weight tying across stages (the first stage's embedding and the last stage's head are two
#    copies of one matrix: their gradients are summed), the gradient norm over every stage, and
#    `run_pipeline`, which feeds a minibatch to the schedule; these replace `apply_fsdp` and
#    `forward_backward`, and evaluation runs the schedule's forward-only pass;
# 4. `--schedule` (GPipe or 1F1B) instead of `--cpu-offload`: a stage holds its parameters whole;
# 5. the checks a pipeline needs (a block per stage, a microbatch per stage for 1F1B); the
#    stage and its schedule, whose `loss_fn` is the model's `cross_entropy` on the last stage;
#    the microbatches of a step are the schedule's $m$ (what `grad_accum` was), and every stage
#    reads the whole minibatch;
# 6. the step: one call to the schedule, then the tied gradients, the norm, the optimiser;
# 7. evaluation through the schedule; 8. the sample, through the stages in turn.
#
# Your working copy for it is `train_gpt2_pp.py` (`--stage pp`).

# %% tags=["demo"]
pp_copy = diffs.start_working_copy(LESSON, PP_COPY, stage="pp")
for hunk in diffs.hunks(LESSON, stage="pp"):
    display(Markdown(f"**hunk {hunk.number}**\n```diff\n{hunk.text}\n```"))
print(diffs.report(LESSON, diffs.status(LESSON, pp_copy, stage="pp")).splitlines()[-1])

# %% [markdown]
# First the pipeline stage itself, on 2 processes: each process holds a stage, the tied
# embedding and output matrix live on both the first and the last stage (their gradients are
# summed after backward, so the copies stay equal), and the losses must equal the DDP run's.

# %% tags=["demo"]
pp_run, pp_reports = launch("pp", 2, "pp-2", "--schedule", "1f1b")
print(f"pp on 2 processes (1F1B): largest loss difference from ddp over "
      f"{len(pp_run)} steps: "
      f"{max(abs(a['loss'] - b['loss']) for a, b in zip(pp_run, ddp_run)):.1e}")
for rank, (report, n) in enumerate(zip(pp_reports,
                                       RUN_MODEL.pipeline_stage_parameters(2))):
    print(f"stage {rank}: parameters predicted {4 * n / MiB:.2f} MiB, measured "
          f"{report['params'] / MiB:.2f} MiB")

# %% [markdown]
# Both stages hold about half of the bytes, but not half of the work. The tiny model's output
# head (the CPU runs') multiplies every token by a $64 \times 50{,}304$ matrix, about 12 times the
# work of all four blocks together (the small model's, on 4 GPUs, 1.6 times the work of its six),
# and it sits on the last stage: the first stage waits most of the time. That is
# *imbalance*, the first thing a real pipeline split must fix (by giving the last stage fewer
# blocks), and it would hide the bubble completely.
#
# To see the bubble itself, `bubble_demo.py` next to this notebook builds a pipeline of equal
# stages: 8 identical layers, cut into one stage per process, trained with GPipe on 512
# samples per step split into $m$ microbatches. It times the same steps on *one* process (one
# stage: no bubble) and on *two* (two stages), each process computing with one thread. With
# no bubble and no communication, two stages would take half the time of one; the measured idle
# fraction is what is left: $1 - (t_1 / 2) / t_2$.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *More pipeline stages shrink the bubble.* Spot it in exercise 3's first attempts. More
# microbatches do.
# :::

# %% tags=["demo"]
# from any working folder
DEMO = KIT_ROOT / "notebooks" / "04-model-parallelism" / "bubble_demo.py"
MICROBATCHES = [1, 2, 4, 8, 16]
STAGES = 2


def demo_step_ms(processes):
    """{microbatches: median ms per step} of the demo on `processes` stages."""
    result = subprocess.run([*torchrun(processes), str(DEMO), *map(str, MICROBATCHES)],
                            capture_output=True, text=True, check=True)
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    return {line["microbatches"]: line["step_ms"] for line in lines}


one, two = demo_step_ms(1), demo_step_ms(STAGES)
bubble = {m: (bubble_fraction(STAGES, m), 1 - (one[m] / STAGES) / two[m])
          for m in MICROBATCHES}
for m, (predicted, measured) in bubble.items():
    print(f"m = {m:2d}: one stage {one[m]:5.0f} ms, two stages {two[m]:5.0f} ms -> "
          f"bubble predicted {predicted:.2f}, measured {measured:.2f}")
least = min(MICROBATCHES, key=lambda m: bubble[m][1])
print(f"with one microbatch the measurement is {abs(bubble[1][1] - bubble[1][0]):.2f} "
      f"from the prediction; the idle time is least at m = {least}"
      + (f" and grows again up to m = {MICROBATCHES[-1]}"
         if least < MICROBATCHES[-1] else ""))

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(MICROBATCHES, [bubble[m][0] for m in MICROBATCHES], "o-",
        label="predicted (p-1)/(m+p-1)")
ax.plot(MICROBATCHES, [bubble[m][1] for m in MICROBATCHES], "s--",
        label="measured 1 - (t1/p)/tp")
ax.set_xscale("log", base=2)
ax.set_xlabel("microbatches m")
ax.set_ylabel("idle fraction")
ax.set_title(f"pipeline of {STAGES} equal stages, GPipe")
ax.legend()
plt.show()

# %% [markdown]
# With one microbatch one stage always waits for the other: the last line says how far the
# measurement lands from the predicted half. Look for the idle time to fall over the first few
# microbatches, as predicted. Two processes on two cores measure noisily when anything else runs
# beside them (the kit's tests execute this lesson beside other tests, and have seen the idle
# time at 2 microbatches above that at 1); run the cell again on an idle machine, or a GPU node,
# before you draw a conclusion. Where the measured idle time grows again with more microbatches (the last line says
# from where), fixed costs are showing: each microbatch is a send and a receive between processes
# and a smaller matrix product, costs the formula leaves out. On GPUs the same
# trade holds at a larger scale: enough microbatches to hide the bubble, few enough that each
# still keeps a GPU busy.
#
# ## Choosing a strategy
#
# 1. *It fits on one GPU* with a useful micro-batch (the calculator says so): DDP. Nothing is
#    faster, and everything else is harder to debug.
# 2. *The parameters, gradients and optimiser state do not fit*: FSDP (ZeRO-3). It costs about
#    1.5× DDP's traffic and hides most of it behind compute; ZeRO-1/2 if only the optimiser or
#    gradients are the problem.
# 3. *Activations do not fit* even at micro-batch 1 (long sequences): activation
#    checkpointing first, then TP with sequence parallelism (or context parallelism) inside a node.
# 4. *Thousands of GPUs, or a slow network between nodes*: add TP inside nodes (2-D) and PP
#    across groups of nodes (3-D); PP sends only activations at stage boundaries, which a slow
#    network can carry, but needs many microbatches per step to keep its bubble small.
#
# ## Under Slurm
#
# `batchfiles/<site>/batch-fsdp-*.sh`, `batch-tp-*.sh` and `batch-pp-*.sh` start these stages
# on one or more nodes exactly like the DDP stage: `srun torchrun` with one torchrun per node. A
# pre-empted job writes a DCP checkpoint and its requeued run resumes from it; the FSDP stage's
# checkpoints also resume on another number of GPUs.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# Say here: choosing a strategy from the memory arithmetic, not from fashion; 2-D and
# 3-D parallelism as combinations of the same three ideas.
# :::

# %% [markdown]
# *End of part 2. Part 3, the lab below, is the longest: do it in a lab session or as homework.*
#
# ## Lab: the three conversions, then one piece of FSDP from its specification

# %% [markdown] tags=["practice"]
# **The three conversions, your practice.** Make every hunk of the three diffs in your working
# copies, in the editor: `train_gpt2.py` (DDP to FSDP), `train_gpt2_tp.py` and `train_gpt2_pp.py`
# (FSDP to TP and to PP), until each report above has nothing left. The conversions are not
# graded, since applying hunks takes no understanding of them; exercise 4 is, and it is the step
# at the heart of the FSDP stage.

# %% [markdown]
# **Exercise 4: shard a model.** Write `shard_model(model, mesh)` with FSDP2's `fully_shard`, for
# a model that is a token embedding (`model.embed`), a stack of blocks (`model.blocks`, an
# `nn.ModuleList`) and an output head (`model.head`), as GPT-2 is. Every rank must keep a share of
# every parameter; while the model runs forward, at most the block that runs and the one FSDP
# prefetches may hold their whole weights; and training on $N$ ranks must give the model that one
# process trains on all their batches. Return the model. Your function may use `torch` and
# `fully_shard`; the FSDP stage's `apply_fsdp` is refused. The test runs it on 2 processes
# (`coursekit/fsdp_shard_check.py`): each rank shards a model of 4 blocks, counts the blocks
# whose weights are whole as each block runs, and takes 2 steps on a batch of its own.

# %% nbgrader={"grade": false, "grade_id": "shard_model", "locked": false, "schema_version": 3, "solution": true, "task": false}
from torch.distributed.fsdp import fully_shard  # noqa: E402


def shard_model(model, mesh):
    ### BEGIN SOLUTION
    # one unit per block: gathered just before it runs, freed after
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    # the root's unit holds what no block does (embedding, head) and manages the others
    fully_shard(model, mesh=mesh)
    return model
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "shard_model_tests", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# coursekit.fsdp_shard_check's result, on 2 processes
result = exercise.run_checker("coursekit.fsdp_shard_check", shard_model)
print(result)
assert result["error"] is None, result["error"]
assert result["largest_difference"] < 1e-6, (
    "the model differs from that of one process on every rank's batches: a parameter "
    "outside every unit (the embedding, the head) is never averaged over the ranks")
### BEGIN HIDDEN TESTS
blocks = {f"blocks.{i}" for i in range(result["blocks"])}
assert blocks <= set(result["units"]), (
    "every block its own unit: one unit for the whole model gathers every block's "
    "weights at once, and its peak is the whole model")
assert "(the whole model)" in result["units"], \
    "the root (the embedding and the head) is a unit too"
assert result["most_blocks_gathered"] <= 2, result
### END HIDDEN TESTS

# %% [markdown]
# ## Key points
#
# - Training memory = parameters + gradients + optimiser state (16 bytes per parameter with
#   Adam in fp32, 18 with PyTorch's bf16 autocast, 16 in ZeRO's mixed-precision accounting) +
#   activations (growing with micro-batch ×
#   sequence, not with the number of GPUs in data parallelism).
# - ZeRO-1/2/3 split the optimiser state, then the gradients, then the parameters over the
#   data-parallel ranks; FSDP2's `fully_shard` is ZeRO-3, gathering one block's parameters at a
#   time, and its DCP checkpoints resume on any number of ranks.
# - Tensor parallelism splits every matrix (column-wise then row-wise) and the activations, at
#   the price of collectives inside every block: keep it inside a node.
# - Pipeline parallelism splits the layers; its bubble $(p-1)/(m+p-1)$ shrinks with more
#   microbatches; 1F1B keeps fewer activations in flight than GPipe.
# - Activation checkpointing trades about a third more compute for much less activation memory.
# - The model is written once, free of parallelism; each strategy is applied to it from outside
#   (`fully_shard`, a TP plan, a pipeline split), so each stage is a small diff on the last.
# - Predict with the arithmetic, then measure: per-rank bytes and step times tell you whether a
#   strategy did what you paid for.
