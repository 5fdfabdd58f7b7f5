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
# # 01 · A GPT on one GPU
#
# **Questions.** This lesson answers
# - What is a GPT made of, and where do its parameters sit?
# - What happens in one training step, and how many tokens does it see?
# - How many samples go through the device at once, and how many passes make a step?
# - How well does a run use the device it is given?
#
# **Objectives.** After this lesson you can
# - use the words of the course precisely: vocabulary, data set, sample, microbatch, minibatch,
#   step, epoch, and do the arithmetic that links them;
# - find every part of GPT-2 in `solutions/gpt.py` and count its parameters;
# - train it, inside the notebook and as a script, and read the run's `metrics.jsonl`;
# - generate text from a checkpoint;
# - choose the microbatch and `grad_accum` for a device from two measured peaks;
# - compute the model FLOPs utilisation (MFU) of a run and say what limits it.
#
# **Prerequisites.** Lessons 00 and 00b (PyTorch tensors, `nn.Module` and a training loop).
#
# **Time.** About 60 minutes: reading, the exercises, and waiting for the cells on a laptop's CPU.
# The time is an estimate; the instructor guide says how it is made.

# %%
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from IPython.display import display

from coursekit import KIT_ROOT, data, memory, perf, presets, runs, widgets

# %% [markdown]
# The set-up: the offline corpus the lesson trains on (built once, in seconds), and the run
# length, the lesson's one knob.

# %%
DATA = KIT_ROOT / "data" / "builtin"
if not (DATA / "meta.json").exists():  # the offline corpus: built in seconds, once
    data.prepare_builtin(DATA)
meta = data.read_meta(DATA)
print(json.dumps({split: info["tokens"] for split, info in meta["splits"].items()}),
      meta["description"])
# Run length, the one knob of this lesson: the short runs take seconds on a laptop's CPU
# and show the same things; with a GPU the longer ones are as quick. Set it to True or
# False to choose.
LONGER_RUNS = torch.cuda.is_available()

# %% [markdown]
# ## The words of the course
#
# - **Vocabulary**: the tokens the model knows. GPT-2's tokenizer has 50,257 (byte-pair pieces of
#   words, plus `<|endoftext|>`); the model pads its table to 50,304, a multiple of 128 that GPUs
#   multiply faster.
# - **Data set**: the training text as one long stream of token ids. Here: Python's own
#   documentation, about 770,000 tokens; on a cluster, FineWeb-Edu's 10 billion.
# - **Sample**: one sequence of $T$ tokens (the context length). The model predicts every next
#   token, so a sample is $T$ predictions.
# - **Microbatch**: $B$ samples that go through one forward and backward pass together. Its size
#   is limited by memory.
# - **Minibatch**: the samples behind one optimiser **step**. Gradients of `grad_accum`
#   microbatches are added up before the step, so minibatch = $B$ × `grad_accum` (× the number of
#   GPUs, from lesson 02).
# - **Epoch**: one pass over the data set.
#
# The identity that ties them: *tokens = steps × B × grad_accum × T*.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *Gradient accumulation changes what is learned.* Spot it when trainees expect
# different losses at the same global batch. It is the same sum of gradients, in more
# passes.
# :::

# %%
encoding = data.gpt2_encoding()
sentence = "Return the number of items in a container."
ids = encoding.encode_ordinary(sentence)
print(ids)
print([encoding.decode([i]) for i in ids])

# %% [markdown]
# **Exercise 1.** Write `tokens_per_step(micro_batch, grad_accum, seq_len)`, then
# `steps_per_epoch(dataset_tokens, micro_batch, grad_accum, seq_len)` (whole steps only). GPT-2
# 124M takes 524,288 tokens per step with $B = 64$ and $T = 1024$: `grad_accum` 8 on one GPU.

# %% nbgrader={"grade": false, "grade_id": "tokens_per_step", "locked": false, "schema_version": 3, "solution": true, "task": false}
def tokens_per_step(micro_batch, grad_accum, seq_len):
    ### BEGIN SOLUTION
    return micro_batch * grad_accum * seq_len
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "tokens_per_step_tests", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
assert tokens_per_step(64, 8, 1024) == 524_288
### BEGIN HIDDEN TESTS
from coursekit import exercise, scaling

with exercise.own_work(scaling.tokens_per_step, scaling.steps_per_epoch):
    assert tokens_per_step(4, 2, 128) == 1024
    assert tokens_per_step(1, 1, 1) == 1
### END HIDDEN TESTS


# %% nbgrader={"grade": false, "grade_id": "steps_per_epoch", "locked": false, "schema_version": 3, "solution": true, "task": false}
def steps_per_epoch(dataset_tokens, micro_batch, grad_accum, seq_len):
    ### BEGIN SOLUTION
    return dataset_tokens // (micro_batch * grad_accum * seq_len)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "steps_per_epoch_tests", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
assert steps_per_epoch(10_000_000_000, 64, 8, 1024) == 19_073
### BEGIN HIDDEN TESTS
from coursekit import exercise, scaling

with exercise.own_work(scaling.tokens_per_step, scaling.steps_per_epoch):
    assert steps_per_epoch(1023, 4, 2, 128) == 0
    assert steps_per_epoch(725_882, 4, 2, 128) == 708
### END HIDDEN TESTS

# %%
tiny = presets.get_preset("tiny")
accum = tiny.batch_tokens // (tiny.micro_batch * tiny.seq_len)
print(f"tiny preset: B={tiny.micro_batch}, T={tiny.seq_len}, grad_accum={accum} -> "
      f"{tokens_per_step(tiny.micro_batch, accum, tiny.seq_len):,} tokens per step, "
      f"""{steps_per_epoch(meta['splits']['train']['tokens'], tiny.micro_batch, accum,
                           tiny.seq_len)} steps per epoch""")

# %% [markdown]
# The batch calculator does this arithmetic for any shape; it starts at GPT-2 124M's batch on
# FineWeb-Edu. Try 8 processes: which `grad_accum` keeps 524,288 tokens per step, and how many
# steps is an epoch of this lesson's corpus (type its training tokens into "data tokens")?

# %% tags=["demo"]
widgets.batch_calculator()

# %% [markdown]
# ## The model, walked through
#
# The model is `solutions/gpt.py`, written once: every stage of the course trains it unchanged,
# and each later lesson applies its parallelism to it from outside (lesson 02 wraps it, lesson 04
# shards, splits and slices it). Open it next to this notebook: it reads top to bottom. Three
# choices in it look ahead to lesson 04, and change nothing in what the model computes:
#
# - q, k and v are three $d \times d$ projections where GPT-2 has one $d \times 3d$ matrix,
#   `c_attn`. They start with the very numbers GPT-2's fused matrix would (a test checks it), and
#   `coursekit export-hf` fuses them back for Hugging Face.
# - The blocks are kept by their index (`transformer.h["3"]`), so that a pipeline stage can keep
#   some of them under their own names.
# - `forward` returns the logits; the loss is `cross_entropy(model(x), y)`, computed beside it.
#
# The script that trains it, `solutions/train_gpt2_std.py`, is the one every later lesson
# changes: its data, optimiser, schedule, checkpoints and loop. What no lesson is about (the
# command line and its presets, the stop signal, the run's banner) it takes from `coursekit`.
# We import their parts here rather than copy them.
#
# - `wte`: the token embedding, a $V \times d$ table (one row of $d$ numbers per token);
#   `wpe`: the position embedding, $T \times d$. Their sum enters the **residual stream**.
# - $L$ **blocks**, each LayerNorm → causal self-attention → add, then LayerNorm → MLP → add.
#   Attention lets each position read from earlier ones (`is_causal=True` hides later ones); the
#   MLP ($d \to 4d \to d$) works on each position alone.
# - A last LayerNorm and the **language-model head**, a $d \times V$ matrix that turns each
#   position's vector into a score (logit) for every token. GPT-2 *ties* it to `wte`: the same
#   matrix reads tokens in and writes them out.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *A tied embedding counts twice.* Spot it in parameter counts near 163 M for GPT-2
# small.
# :::

# %%
from coursekit import stages

from solutions import gpt

std = stages.load("std")  # solutions/train_gpt2_std.py, imported as a module

torch.manual_seed(1337)
config = gpt.GPTConfig(vocab_size=tiny.vocab_size, block_size=tiny.seq_len,
                       n_layer=tiny.n_layer, n_head=tiny.n_head, n_embd=tiny.n_embd)
model = gpt.GPT(config)
print(model)
print(f"{sum(p.numel() for p in model.parameters()):,} parameters")

# %% [markdown]
# **Exercise 2.** A checkpoint says what model it holds only through its tensors' names and
# shapes. Write `describe_checkpoint(shapes)`: `shapes` maps each name of a GPT's
# `state_dict()` to its shape, as `{name: tuple(t.shape) for name, t in
# model.state_dict().items()}` gives them (try it on the model above). Return
# `(n_layer, n_embd, vocab_size, block_size, parameters)`: the model's sizes (the vocabulary as
# its embedding has it) and its number of parameters, as `model.parameters()` counts them.

# %% nbgrader={"grade": false, "grade_id": "describe_checkpoint", "locked": false, "schema_version": 3, "solution": true, "task": false}
def describe_checkpoint(shapes):
    ### BEGIN SOLUTION
    vocab_size, n_embd = shapes["transformer.wte.weight"]
    block_size = shapes["transformer.wpe.weight"][0]
    blocks = {name.split(".")[2] for name in shapes
              if name.startswith("transformer.h.")}
    n_layer = len(blocks)
    # the head is tied to the token embedding: one matrix, listed under both names
    parameters = sum(math.prod(shape) for name, shape in shapes.items()
                     if name != "lm_head.weight")
    return n_layer, n_embd, vocab_size, block_size, parameters
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "describe_checkpoint_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
sizes = (config.n_layer, config.n_embd, config.vocab_size, config.block_size)
assert describe_checkpoint(shapes)[:4] == sizes
### BEGIN HIDDEN TESTS
from coursekit import exercise, memory


def checkpoint_of(**sizes):
    """The state_dict shapes of a GPT of ``sizes``, and its parameter count."""
    with torch.device("meta"):  # no memory, no values: the shapes alone
        made = gpt.GPT(gpt.GPTConfig(**sizes))
    return ({name: tuple(t.shape) for name, t in made.state_dict().items()},
            sum(p.numel() for p in made.parameters()))


small, _ = checkpoint_of(vocab_size=50257, block_size=1024, n_layer=12, n_head=12,
                         n_embd=768)
odd, odd_count = checkpoint_of(vocab_size=1000, block_size=48, n_layer=3, n_head=2,
                               n_embd=40)
with exercise.own_work(memory.Model.parameters.fget, memory.Model.block_parameters.fget,
                       memory.Model.embedding_parameters.fget):
    assert describe_checkpoint(small) == (12, 768, 50257, 1024, 124_439_808), (
        "the head and the token embedding are one matrix (weight tying): count it once")
    assert describe_checkpoint(odd) == (3, 40, 1000, 48, odd_count)
    backwards = dict(reversed(odd.items()))  # any order of names
    assert describe_checkpoint(backwards) == (3, 40, 1000, 48, odd_count)
    assert describe_checkpoint(shapes)[4] == sum(p.numel() for p in model.parameters())
### END HIDDEN TESTS

# %% [markdown]
# ## Training inside the notebook
#
# A short run of the tiny preset with the script's own parts: its data loader, optimiser and
# learning-rate schedule. The loss starts near $\ln V = \ln 50304 \approx 10.8$ (a uniform guess)
# and falls as the model learns which tokens are common and which follow which. The plot updates
# as it trains.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *The loss at step 0 means something is wrong.* A loss near ln(50,257), about 10.8,
#   is what a model that knows nothing gives.
# - Say here that the tiny preset and `gpt2-124m` are the same code at different sizes.
# :::

# %% tags=["demo"]
from IPython.display import display

train_loader = std.TokenShardLoader(DATA, "train", tiny.micro_batch, tiny.seq_len)
optimizer = std.configure_optimizer(model, tiny.lr, tiny.weight_decay,
                                    torch.device("cpu"))
steps, losses = (40 if LONGER_RUNS else 20), []
fig, ax = plt.subplots(figsize=(6, 3.5))
handle = display(fig, display_id=True)
for step in range(steps):
    lr = std.learning_rate(step, tiny.lr, warmup_steps=4, max_steps=steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad()
    for _ in range(accum):
        x, y = train_loader.next_batch()
        loss = gpt.cross_entropy(model(x), y)
        (loss / accum).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), tiny.grad_clip)
    optimizer.step()
    losses.append(loss.item())
    if (step + 1) % 5 == 0:
        ax.clear()
        ax.plot(range(1, len(losses) + 1), losses)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        handle.update(fig)
plt.close(fig)
print(f"loss {losses[0]:.2f} -> {losses[-1]:.2f} in {steps} steps")

# %% [markdown]
# ## Training with the script
#
# Real runs are scripts, not notebook cells: they run for hours, in batch jobs, on many GPUs. The
# notebook starts the script as a subprocess and reads what it leaves in its run directory. Every
# step prints one line and appends the same numbers to `metrics.jsonl`.

# %% tags=["demo"]
import shutil

# on a GPU, a model big enough to keep it busy: the tiny one would leave it idle most of
# the time
SCRIPT_PRESET = "small" if torch.cuda.is_available() else "tiny"
run_dir = Path("runs") / f"std-{SCRIPT_PRESET}-lesson01"
# a fresh demonstration run each time the cell runs
shutil.rmtree(run_dir, ignore_errors=True)
script_steps = 60 if LONGER_RUNS else 30
command = [sys.executable, str(KIT_ROOT / "solutions" / "train_gpt2_std.py"),
           "--preset", SCRIPT_PRESET, "--data", str(DATA), "--out", str(run_dir),
           "--max-steps", str(script_steps), "--eval-interval", str(script_steps // 3)]
# the script's printed lines, beside its run directory
log = run_dir.with_suffix(".log")
log.parent.mkdir(exist_ok=True)
start = time.perf_counter()
with open(log, "w") as output:
    process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    # redraws from metrics.jsonl while the run goes on
    monitor = widgets.TrainingMonitor(run_dir)
    display(monitor.widget)
    exit_code = monitor.follow(process)
lines = log.read_text().splitlines()
if exit_code != 0:
    raise RuntimeError("the training script failed:\n" + "\n".join(lines[-20:]))
print("\n".join(lines[:8] + ["..."] + lines[-3:]))
print(f"({time.perf_counter() - start:.0f} s)")

# %% [markdown]
# The widget above is the kit's live monitor: `TrainingMonitor(run_dir).follow(process)` follows
# a local process, `follow(job_id=...)` a Slurm job (the run directory is on the shared disk).
# Below, the same numbers read back once the run has ended.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# Say in the next section, on generating text: sampling with temperature and top-k.
# :::

# %% tags=["demo"]
metrics = runs.read_metrics(run_dir)
validation = [r for r in metrics if "val_loss" in r]
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot([r["step"] for r in metrics], [r["loss"] for r in metrics],
        label="training loss")
ax.plot([r["step"] for r in validation], [r["val_loss"] for r in validation], "o-",
        label="validation loss")
ax.set_xlabel("step")
ax.set_ylabel("loss")
ax.legend()
plt.show()

# %% [markdown]
# ## Generating text
#
# The model gives a score for every token of the vocabulary; generation turns scores into
# probabilities (softmax, sharpened or flattened by a **temperature**), keeps only the `top_k`
# most likely tokens, draws one, appends it, and repeats.
#
# **Exercise 3.** Write `top_k_filter(logits, k)`: a copy of the 1-D tensor `logits` in which every
# entry that is not among the `k` largest is `-inf` (so its probability after softmax is zero).

# %% nbgrader={"grade": false, "grade_id": "top_k", "locked": false, "schema_version": 3, "solution": true, "task": false}
def top_k_filter(logits, k):
    ### BEGIN SOLUTION
    kth_largest = torch.topk(logits, k).values[-1]
    return torch.where(logits < kth_largest, torch.full_like(logits, -float("inf")),
                       logits)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "top_k_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
scores = torch.tensor([1.0, 5.0, 3.0, -2.0, 4.0])
assert top_k_filter(scores, 2).tolist() == [-float("inf"), 5.0, -float("inf"),
                                            -float("inf"), 4.0]
# the input is unchanged
assert torch.equal(scores, torch.tensor([1.0, 5.0, 3.0, -2.0, 4.0]))
### BEGIN HIDDEN TESTS
assert top_k_filter(scores, 5).tolist() == scores.tolist()
assert (torch.softmax(top_k_filter(scores, 1), dim=0).tolist()
        == [0.0, 1.0, 0.0, 0.0, 0.0])
### END HIDDEN TESTS

# %% tags=["demo"]
step, state = runs.load_checkpoint(run_dir)
# the run's
trained = gpt.GPT(gpt.GPTConfig(**runs.read_json(run_dir / "config.json")["model"]))
trained.load_state_dict(state["model"])
trained.eval()
prompt = torch.tensor([encoding.encode_ordinary("Return the")])
for temperature in (0.5, 1.0):
    generator = torch.Generator().manual_seed(0)
    tokens = trained.generate(prompt, 30, temperature=temperature,
                              generator=generator)[0].tolist()
    print(f"temperature {temperature}: "
          f"{encoding.decode([t for t in tokens if t < data.EOT_TOKEN])!r}")

# %% [markdown]
# ## How big a microbatch?
#
# The recipe sets the global batch (GPT-2: 524,288 tokens a step); the device sets the
# microbatch, the most samples whose memory fits. A training process's peak memory is a part
# paid once (weights, gradients, optimiser state) plus $B$ times one sample's activations, so two
# measurements tell both: the peak at $B = 1$ and at $B = 2$. The cell below measures them for
# this lesson's model: its parameters, gradients and AdamW's state, plus the most tensor bytes a
# forward and backward allocated at once (on a GPU, what `torch.cuda.max_memory_allocated`
# counts).

# %% tags=["demo"]
def peak_bytes(micro_batch):
    """The model's state plus the activations of one forward and backward of
    `micro_batch` samples, at their peak."""
    held = memory.measured(model, optimizer, torch.device("cpu"))
    x = torch.randint(0, data.EOT_TOKEN, (micro_batch, tiny.seq_len))
    with memory.allocated_peak() as activations:
        gpt.cross_entropy(model(x), x).backward()
    optimizer.zero_grad(set_to_none=False)  # no step: the weights stay as trained
    return held["params"] + held["grads"] + held["optimizer"] + activations["peak"]


measured_peaks = {b: peak_bytes(b) for b in (1, 2)}
for b, peak in measured_peaks.items():
    print(f"B = {b}: peak {peak / 2**20:.1f} MiB")

# %% [markdown]
# **Exercise 4: the microbatch and grad_accum for a device.** Write
# `plan_batch(peak_at_1, peak_at_2, budget, global_tokens, seq_len)`: `(micro_batch,
# grad_accum)` for a device that gives training `budget` bytes, where `peak_at_1` and
# `peak_at_2` are the peaks measured at one and two samples. Take the largest microbatch that
# fits, such that whole microbatches make up the global batch of `global_tokens` tokens
# (`seq_len` each); `None` if not even one sample fits.

# %% nbgrader={"grade": false, "grade_id": "plan_batch", "locked": false, "schema_version": 3, "solution": true, "task": false}
def plan_batch(peak_at_1, peak_at_2, budget, global_tokens, seq_len):
    ### BEGIN SOLUTION
    per_sample = peak_at_2 - peak_at_1
    once = peak_at_1 - per_sample
    if peak_at_1 > budget:
        return None
    samples = global_tokens // seq_len
    fitting = min(samples, (budget - once) // per_sample)
    micro_batch = max(b for b in range(1, fitting + 1) if samples % b == 0)
    return micro_batch, samples // micro_batch
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "plan_batch_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
assert plan_batch(2, 4, 13, 64 * 1024, 1024) == (4, 16)
### BEGIN HIDDEN TESTS
assert plan_batch(100, 150, 400, 48 * 512, 512)[0] in (6, 7), (
    "weights, gradients and optimiser state are paid once, not once a sample")
assert plan_batch(100, 150, 400, 48 * 512, 512) == (6, 8), (
    "whole microbatches make up the global batch: grad_accum is a whole number")
assert plan_batch(10, 12, 9, 64 * 1024, 1024) is None  # not one sample fits
assert plan_batch(10, 12, 10, 64 * 1024, 1024) == (1, 64)  # exactly one
assert plan_batch(10, 11, 1000, 8 * 1024, 1024) == (8, 1)  # the whole batch at once
assert plan_batch(5, 8, 27, 36 * 256, 256) == (6, 6)  # 8 fit; 36 = 6 x 6
### END HIDDEN TESTS

# %% [markdown]
# Your plan for this lesson's model (8 samples a step), were 256 or 512 MiB all a device gave it,
# and for GPT-2 124M in bf16 at its 524,288 tokens a step on 40 and 80 GB GPUs (peaks from
# `coursekit.memory`, the arithmetic of lesson 04, with a tenth of the GPU left to the CUDA
# context and the allocator):

# %% tags=["demo"]
for mib in (256, 512):
    plan = plan_batch(*measured_peaks.values(), mib * 2**20, tiny.batch_tokens,
                      tiny.seq_len)
    print(f"this model with {mib} MiB: (micro_batch, grad_accum) = {plan}")
gpt2 = memory.Model.from_preset(presets.get_preset("gpt2-124m"))
gpt2_peaks = [int(memory.per_rank_bytes(gpt2, "ddp", 1, "bf16-mixed", b, 1024)["total"])
              for b in (1, 2)]
for gb in (40, 80):
    plan = plan_batch(*gpt2_peaks, int(0.9 * gb * 1e9), 524_288, 1024)
    print(f"GPT-2 124M on {gb} GB: (micro_batch, grad_accum) = {plan}")

# %% [markdown]
# After a few dozen steps on a laptop the model has learned common words and punctuation, not
# meaning. The kit's `gpt2-124m` preset trains GPT-2 124M for 19,073 steps of 524,288 tokens
# (10B tokens of FineWeb-Edu), the recipe of Karpathy's build-nanogpt. How long that takes on
# real GPUs is a reported figure, not one this kit measured: Karpathy's llm.c trained the same
# model on 10B tokens of FineWeb (18,865 steps of 524,288 tokens, about 300 ms each) in about 90
# minutes on one node of eight A100 80GB SXM GPUs, and puts one GPU at "~4-24 hours depending
# on the GPU" ([llm.c discussion #481](https://github.com/karpathy/llm.c/discussions/481),
# `scripts/run_gpt2_124M.sh`). llm.c is hand-written C/CUDA, which its README puts about 7%
# ahead of PyTorch nightly.
#
# ## Model FLOPs utilisation (MFU)
#
# Training one token costs about $6N + 12LTd$ FLOPs. Each of the $N$ weights used in matrix
# products does one multiply-add (2 FLOPs) in the forward pass. The backward pass does two
# multiply-adds per weight, 4 FLOPs: one for the gradient of the layer's input (to pass back to the
# layer before) and one for the gradient of the weight itself. Forward 2 + backward 4 = 6 FLOPs
# per weight and token; attention adds its $T \times T$ products, $12LTd$ in all. MFU is the fraction of the device's peak those FLOPs
# use: $\text{MFU} = \text{tokens/s} \times \text{FLOPs per token} / \text{peak FLOP/s}$.
#
# `perf.flops_per_token` is that count; the cell below uses it.

# %% tags=["demo"]
config_json = runs.read_json(run_dir / "config.json")
median_tokens_per_s = sorted(r["tok_per_s"] for r in metrics)[len(metrics) // 2]
fpt = perf.flops_per_token(config.n_layer, config.n_embd, config.block_size,
                           config.vocab_size)
print(f"{fpt / 1e6:.1f} MFLOP per token x {median_tokens_per_s:,.0f} tokens/s = "
      f"{fpt * median_tokens_per_s / 1e9:.1f} GFLOP/s of "
      f"{config_json['peak_flops'] / 1e9:.0f} "
      f"({config_json['peak_source']}) -> MFU "
      f"{fpt * median_tokens_per_s / config_json['peak_flops']:.0%}")

# %% [markdown]
# What keeps MFU below 100%:
# - **Small matrices.** The tiny model's $64 \times 64$ products cannot fill a device (lesson 00's
#   benchmark); GPT-2's $768 \times 3072$ ones do much better.
# - **Memory-bound operations.** LayerNorm, GELU, softmax and the optimiser move many bytes per
#   FLOP; `torch.compile` fuses them, and flash attention avoids writing the $T \times T$ matrix.
# - **Precision.** Tensor cores reach their peak in bf16; fp32 matmuls run at a fraction of it.
# - *Everything outside the GPU*: Python overhead, data loading, logging and, from lesson 02 on,
#   communication between GPUs.
#
# For an idea of what to aim at (a reported figure, not a measurement of this kit): llm.c, with
# its hand-written kernels, reports up to about 60% MFU for GPT-2 124M on A100s
# ([discussion #481](https://github.com/karpathy/llm.c/discussions/481)): a mark for a
# well-tuned run, not a promise for any script. The self-test (`coursekit selftest`) measures
# your stages' MFU on your nodes.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *100% in `nvidia-smi` means the GPU is used well.* It means a kernel was running;
#   MFU says how much of the peak those kernels used.
# - Say here: the six FLOPs per parameter and token, and where each comes from.
# :::

# %% [markdown]
# ## Key points
#
# - tokens = steps × microbatch × grad_accum × T (× GPUs); an epoch is one pass over the data set.
# - GPT-2 is embeddings, $L$ identical blocks of attention and MLP around a residual stream, and a
#   head tied to the token embedding: 124M parameters at 12 × 768.
# - Real training runs as a script; notebooks launch it and read its `metrics.jsonl` and
#   checkpoints.
# - Peak memory is a part paid once (weights, gradients, optimiser state) plus the
#   activations of each sample: the microbatch is the most samples that fit, and
#   `grad_accum` microbatches make up the global batch.
# - A language model generates by sampling one token at a time from its softmax, shaped by
#   temperature and top-k.
# - MFU = tokens/s × (6N + 12LTd) / peak FLOP/s; it measures how well the run uses the hardware.
