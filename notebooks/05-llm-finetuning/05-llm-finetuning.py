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
# # 05 · Fine-tuning a language model with LoRA
#
# **Questions.** This lesson answers
# - How can a model with billions of weights be adapted by training a few million?
# - How is an instruction-following model trained, and how do I tell that it learned?
# - Which Accelerate configuration fits my model on my GPUs?
#
# **Objectives.** After this lesson you can
# - say what full fine-tuning, adapters and LoRA each train, and what each saves in memory;
# - write a LoRA layer, $y = Wx + \frac{\alpha}{r} BAx$, and check it against PEFT's;
# - count LoRA's trainable parameters from the shapes of the adapted matrices;
# - build instruction-tuning examples: a prompt template, and labels that teach only the answer;
# - fine-tune a pretrained model with Accelerate, and judge it before and after by validation
#   loss and exact match;
# - read the Accelerate configs (DDP, FSDP, DeepSpeed ZeRO-2 and ZeRO-3), and choose among them
#   and QLoRA from the memory a job needs;
# - merge an adapter into its base model, and check that nothing changed;
# - run the same script on a cluster with a model and data set from the Hugging Face hub.
#
# **Prerequisites.** Lesson 04: bytes per parameter, ZeRO stages and FSDP. Lesson 01: the GPT
# model and its loss.
#
# **Time.** About 65 minutes: reading, the exercises, and waiting for the cells on a laptop's CPU.
# The time is an estimate; the instructor guide says how it is made.

# %%
import sys

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as transformers_logging

from coursekit import KIT_ROOT, data, instruct, runs

sys.path.insert(0, str(KIT_ROOT / "solutions"))
# the lora stage: its template, tokenisation and LoRA set-up
import finetune_lora  # noqa: E402

# %% [markdown]
# The set-up: the other modules of the standard library the lesson uses, the base model and
# the instruction tasks (each built once), quieter libraries, and the lesson's one knob.

# %%
import copy
import json
import os
import shutil
import socket
import subprocess
import warnings
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

# lesson 01's tiny GPT, pretrained, in Hugging Face format
MODEL = KIT_ROOT / "models" / "kit-tiny"
TASKS = KIT_ROOT / "data" / "instruct"  # the offline instruction tasks
if not (TASKS / "meta.json").exists():  # built in a second, once (as `make book` does)
    instruct.prepare(TASKS)
# a few minutes, once: pretrain and export (`make book`)
if not (MODEL / "config.json").exists():
    corpus = KIT_ROOT / "data" / "builtin"
    if not (corpus / "meta.json").exists():
        data.prepare_builtin(corpus)
    base_run = KIT_ROOT / "runs" / "base-tiny"
    for command in (["solutions/train_gpt2_std.py", "--preset", "tiny", "--data",
                     corpus, "--out", base_run, "--sample-tokens", 0, "--resume"],
                    ["-m", "coursekit", "export-hf", base_run, MODEL, "--force",
                     "--untie"]):
        result = subprocess.run([sys.executable, *map(str, command)], cwd=KIT_ROOT,
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building {MODEL} failed:\n{result.stderr[-3000:]}")
# Notes on stderr would clutter the lesson, and nbgrader scores a test cell that writes
# to stderr as failed: drop transformers' deprecation notes and loading bars, and PEFT's
# note that it handles GPT-2's Conv1D layers (weights stored transposed) differently
# from nn.Linear ones.
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message="fan_in_fan_out is set to")
transformers_logging.disable_progress_bar()
print(f"torch {torch.__version__}; base model {MODEL.relative_to(KIT_ROOT)}; "
      f"tasks {TASKS.relative_to(KIT_ROOT)}")
# Evaluation length, the one knob of this lesson: on a laptop's CPU the fine-tuning run
# checks its answers less often and on fewer examples (same training); a GPU does the
# longer checks as quickly. Set it to True or False to choose.
LONGER_RUNS = torch.cuda.is_available()

# %% [markdown]
# ## Three ways to fine-tune
#
# A pretrained model has learnt language from a large corpus; **fine-tuning** teaches it a task
# from a few thousand examples. There are three common ways to do it.
#
# - **Full fine-tuning** trains every weight. It is the most expressive, and the most expensive:
#   every weight needs a gradient and Adam's two states, so memory is the same as pretraining
#   (16 bytes per parameter in fp32, lesson 04), and every fine-tuned copy is a whole model.
# - **Adapters** (Houlsby et al., 2019) freeze the model and insert small trainable bottleneck
#   layers (down-project, non-linearity, up-project) inside each block. Few weights train, but
#   the extra layers stay in the model and slow down every forward pass.
# - **LoRA**, low-rank adaptation (Hu et al., 2021), freezes every pretrained matrix $W$
#   ($d_\text{out} \times d_\text{in}$) and learns a low-rank update beside it:
#
# $$y = Wx + \frac{\alpha}{r}\, B A x, \qquad A \in \mathbb{R}^{r \times d_\text{in}},\quad
#   B \in \mathbb{R}^{d_\text{out} \times r},\quad r \ll \min(d_\text{in}, d_\text{out}).$$
#
# Only $A$ and $B$ train: $r\,(d_\text{in} + d_\text{out})$ numbers instead of
# $d_\text{in}\, d_\text{out}$, about 1% of a model at $r = 8$. $A$ starts random and $B$ starts
# at *zero*, so at step 0 the adapted model is exactly the pretrained one, and training moves
# away from it smoothly. The scale $\alpha / r$ keeps the size of the update about the same when
# you change $r$. After training, $BA$ can be added into $W$ (*merged*): the model is as fast
# as the original, and an adapter alone is a few megabytes, so one base model can serve many
# tasks.
#
# | | trains | memory per parameter (fp32, Adam) | inference cost | what you store per task |
# |---|---|---|---|---|
# | full | every weight | 16 bytes | unchanged | a whole model |
# | adapters | bottleneck layers | 4 bytes frozen, 16 per trainable | extra layers | the adapters |
# | LoRA | $A$ and $B$ beside chosen matrices | 4 bytes frozen, 16 per trainable | unchanged once merged | $A$ and $B$ |
#
# PEFT (Hugging Face's parameter-efficient fine-tuning library) wraps each chosen layer in a
# LoRA layer that keeps the original as `base_layer`. Here it wraps a small linear layer; at
# initialisation the wrapped layer computes exactly what the frozen one does.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# Say here: full fine-tuning, adapters and LoRA as a trade of memory for capacity.
# :::

# %%
torch.manual_seed(0)
frozen = torch.nn.Linear(16, 12)
# PEFT adapts a model in place: give it a copy, so `frozen` stays the plain layer
peft_net = get_peft_model(torch.nn.Sequential(OrderedDict(proj=copy.deepcopy(frozen))),
                          LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                     target_modules=["proj"]))
layer = peft_net.base_model.model.proj
x = torch.randn(5, 16)
print(f"lora_A {tuple(layer.lora_A['default'].weight.shape)}, lora_B "
      f"{tuple(layer.lora_B['default'].weight.shape)}, "
      f"scale alpha/r = {layer.scaling['default']}")
print(f"B is zero at the start: {bool((layer.lora_B['default'].weight == 0).all())}; "
      f"largest difference from the frozen layer: "
      f"{(layer(x) - frozen(x)).abs().max():.1e}")
peft_net.print_trainable_parameters()

# %% [markdown]
# **Exercise 1.** Write `lora_linear(x, linear, A, B, alpha, r)`: the output of the frozen
# `torch.nn.Linear` layer `linear` with the LoRA update $\frac{\alpha}{r} BAx$ added, for a batch
# `x` whose rows are inputs. The test sets PEFT's `lora_A` and `lora_B` to random matrices (a
# trained adapter, not the zero start) and compares your layer with PEFT's.

# %% nbgrader={"grade": false, "grade_id": "lora_linear", "locked": false, "schema_version": 3, "solution": true, "task": false}
def lora_linear(x, linear, A, B, alpha, r):
    ### BEGIN SOLUTION
    return linear(x) + (alpha / r) * (x @ A.T @ B.T)
    ### END SOLUTION


# %%
def peft_layer_with(linear, A, B, alpha):
    """PEFT's LoRA layer around a copy of `linear`, with A and B set to the given
    matrices."""
    net = get_peft_model(torch.nn.Sequential(OrderedDict(proj=copy.deepcopy(linear))),
                         LoraConfig(r=A.shape[0], lora_alpha=alpha, lora_dropout=0.0,
                                    target_modules=["proj"]))
    lora = net.base_model.model.proj
    with torch.no_grad():
        lora.lora_A["default"].weight.copy_(A)
        lora.lora_B["default"].weight.copy_(B)
    return lora


# %% nbgrader={"grade": true, "grade_id": "lora_linear_tests", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
torch.manual_seed(1)
A, B = torch.randn(4, 16), torch.randn(12, 4)
with torch.no_grad():
    expected = peft_layer_with(frozen, A, B, alpha=8)(x)
    got = lora_linear(x, frozen, A, B, alpha=8, r=4)
assert got.shape == (5, 12)
assert (got - expected).abs().max() < 1e-6
### BEGIN HIDDEN TESTS
with torch.no_grad():
    wide = torch.nn.Linear(32, 7)
    A1, B1, x1 = torch.randn(1, 32), torch.randn(7, 1), torch.randn(3, 32)
    expected = peft_layer_with(wide, A1, B1, 16)(x1)
    assert (lora_linear(x1, wide, A1, B1, 16, 1) - expected).abs().max() < 1e-5
    assert torch.equal(lora_linear(x1, wide, A1, torch.zeros(7, 1), 16, 1),
                       wide(x1))  # B = 0
### END HIDDEN TESTS

# %% [markdown]
# ## How many parameters does LoRA train?
#
# Each adapted $d_\text{in} \times d_\text{out}$ matrix adds $r\,(d_\text{in} + d_\text{out})$
# trainable numbers. In GPT-2 each block has four matrices worth adapting: the attention's
# fused query-key-value projection `c_attn` ($d \to 3d$), its output projection `c_proj`
# ($d \to d$), and the MLP's `c_fc` ($d \to 4d$) and `c_proj` ($4d \to d$).
#
# **Exercise 2.** Write `gpt2_adapted_shapes(n_layer, n_embd)`: the list of $(d_\text{in},
# d_\text{out})$ of these four matrices in every block; and `lora_parameters(shapes, r)`: the
# number of trainable parameters LoRA of rank `r` adds to matrices of those shapes. Each function
# has its own test; the second compares your count with PEFT's on GPT-2 124M, built from its
# configuration on PyTorch's `meta` device (shapes without values: no memory, no download).

# %% nbgrader={"grade": false, "grade_id": "lora_shapes", "locked": false, "schema_version": 3, "solution": true, "task": false}
def gpt2_adapted_shapes(n_layer, n_embd):
    ### BEGIN SOLUTION
    d = n_embd
    return [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * n_layer
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "lora_shapes_tests", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
assert len(gpt2_adapted_shapes(12, 768)) == 48
assert (768, 2304) in gpt2_adapted_shapes(12, 768)  # c_attn: d -> 3d
### BEGIN HIDDEN TESTS
for n_layer, n_embd in ((12, 768), (2, 128)):
    d = n_embd
    assert sorted(gpt2_adapted_shapes(n_layer, n_embd)) == \
        sorted([(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * n_layer)
### END HIDDEN TESTS


# %% nbgrader={"grade": false, "grade_id": "lora_count", "locked": false, "schema_version": 3, "solution": true, "task": false}
def lora_parameters(shapes, r):
    ### BEGIN SOLUTION
    return sum(r * (d_in + d_out) for d_in, d_out in shapes)
    ### END SOLUTION


# %%
def peft_count(config, r):
    """(trainable, total) parameters of GPT-2 with `config` and LoRA of rank r on its
    blocks' linear layers, set up by the lora stage's add_lora."""
    with torch.device("meta"):  # shapes only
        model = GPT2LMHeadModel(config)
    options = SimpleNamespace(lora_r=r, lora_alpha=2 * r, lora_dropout=0.0,
                              target_modules=["c_attn", "c_proj", "c_fc"])
    return finetune_lora.count_parameters(finetune_lora.add_lora(model, options))


GPT2_124M = GPT2Config()  # the hub's GPT-2 small: 12 blocks, 768 wide
trainable, total = peft_count(GPT2_124M, 8)
print(f"GPT-2 124M with LoRA r = 8: {trainable:,} trainable of {total:,} "
      f"({trainable / total:.2%})")

# %% nbgrader={"grade": true, "grade_id": "lora_count_tests", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
assert lora_parameters([(768, 2304)], 8) == 8 * (768 + 2304)
### BEGIN HIDDEN TESTS
# the blocks' matrices written out here, so that this cell does not depend on Exercise
# 2's first function
for config, r in ((GPT2_124M, 8), (GPT2_124M, 16),
                  (GPT2Config(n_layer=2, n_embd=128, n_head=4), 3)):
    d = config.n_embd
    shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * config.n_layer
    assert lora_parameters(shapes, r) == peft_count(config, r)[0]
assert lora_parameters([], 8) == 0
### END HIDDEN TESTS

# %% [markdown]
# ## Memory: what LoRA saves, and what ZeRO adds
#
# Per parameter, training in fp32 with Adam keeps 4 bytes of weight, 4 of gradient and 8 of
# optimiser state (lesson 04). LoRA changes who pays: a **frozen** parameter keeps only its 4
# bytes of weight; a **trainable** one pays all 16. The data-parallel strategies then split
# these parts over $N$ GPUs:
#
# | strategy | weights | gradients | Adam states |
# |---|---|---|---|
# | DDP | whole on every GPU | whole | whole |
# | ZeRO-2 | whole | $/N$ | $/N$ |
# | ZeRO-3, FSDP | $/N$ | $/N$ | $/N$ |
#
# (Activations come on top, as in lesson 04; LoRA does not shrink them, since backward still
# runs through every frozen layer.)
#
# Here is the table for two real shapes: GPT-2 124M, and a 7-billion-parameter Llama-style model
# (32 blocks, 4,096 wide, an MLP of 11,008, a vocabulary of 32,000; LoRA on its seven matrices
# per block), fine-tuned fully or with LoRA at $r = 16$, on one GPU or with ZeRO on 8.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *LoRA saves activation memory.* Backward still runs through every frozen layer; LoRA
#   saves gradients and optimiser state.
# - *ZeRO always helps.* With LoRA there is little left to shard: exercise 3 asks
#   trainees to choose from the memory.
# - Say here, ahead of the QLoRA section: QLoRA when the frozen weights themselves do
#   not fit.
# :::

# %% tags=["demo"]
def finetune_bytes_per_gpu(n_params, n_trainable, strategy, world_size):
    """fp32 bytes of weights, gradients and Adam states on one of ``world_size`` GPUs,
    for a model of ``n_params`` parameters of which ``n_trainable`` train."""
    weights_split = strategy == "zero3"
    training_split = strategy in ("zero2", "zero3")
    return {"params": 4 * n_params / (world_size if weights_split else 1),
            "grads": 4 * n_trainable / (world_size if training_split else 1),
            "optimizer": 8 * n_trainable / (world_size if training_split else 1)}


def llama_adapted_shapes(n_layer=32, d=4096, hidden=11008):
    """q, k, v, o projections, then the MLP's gate, up and down projections, in every
    block."""
    return ([(d, d)] * 4 + [(d, hidden), (d, hidden), (hidden, d)]) * n_layer


SEVEN_B = 6_738_415_616  # the parameters of that shape, embeddings included
shapes = {"GPT-2 124M": (total - trainable, gpt2_adapted_shapes(12, 768)),
          "7B": (SEVEN_B, llama_adapted_shapes())}
rows = ["| model | method | trainable | 1 GPU | ZeRO-2, 8 GPUs | ZeRO-3, 8 GPUs |",
        "|---|---|---|---|---|---|"]
for name, (n_params, adapted) in shapes.items():
    for method, n_trainable in (("full", n_params),
                                ("LoRA r=16", lora_parameters(adapted, 16))):
        # adapters are extra
        n_all = n_params if method == "full" else n_params + n_trainable
        gb = [sum(finetune_bytes_per_gpu(n_all, n_trainable, strategy, n).values())
              / 1e9
              for strategy, n in (("ddp", 1), ("zero2", 8), ("zero3", 8))]
        rows.append(f"| {name} | {method} | {n_trainable / 1e6:,.1f} M | "
                    + " | ".join(f"{g:,.1f} GB" for g in gb) + " |")
display(Markdown("\n".join(rows)))

# %% [markdown]
# Full fine-tuning of the 7B model needs over 100 GB on one GPU: no single GPU holds it, and
# ZeRO-2 still leaves every GPU a whole copy of the weights. LoRA removes almost all of the
# gradient and optimiser memory, so what is left is the frozen weights themselves: 27 GB in
# fp32, about half that in bf16. That is why, for LoRA, ZeRO-2 buys almost nothing (it splits
# parts that are already small), and ZeRO-3 or FSDP matters only when the frozen base model
# does not fit on one GPU. For most LoRA runs up to a few billion parameters, plain DDP is the
# right choice: the fastest, and the gradients it all-reduces are only the adapters'.
#
# ## Instruction data: the prompt template and the labels
#
# Instruction tuning teaches a model to answer requests. Each example has an instruction, an
# optional input and the output, in the **Alpaca** schema. The kit's offline task set (built by
# `python -m coursekit instruct prepare`) asks two questions a tiny model can learn on a CPU: the
# Python type of a literal, and the length of a list, with a one-word answer each, so that
# **exact match** of the answer is a clear task metric. The lora stage formats an example with a
# fixed template; the model learns to write the answer after `### Response:`.

# %% tags=["demo"]
train, val = instruct.load_splits(str(TASKS))
example = train[0]
print(f"{len(train):,} training and {len(val):,} validation examples; "
      f"the first:\n{example}\n")
print(finetune_lora.format_prompt(example) + example["output"])

# %% [markdown]
# `tokenize_example` appends the answer and the end-of-text token to the prompt, and makes the
# **labels**: the same token ids, except that the prompt's are $-100$, the index PyTorch's
# cross-entropy ignores (the model shifts the labels by one inside: position $t$ predicts token
# $t+1$). The loss then comes only from the answer: the model is taught to answer, not to
# reproduce instructions it will always be given.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *The loss should include the prompt.* Spot it in labels without `-100`.
# :::

# %% tags=["demo"]
base_model, tokenizer = finetune_lora.load_pretrained(str(MODEL))
tokens = finetune_lora.tokenize_example(tokenizer, example, max_len=64)
print("position  token                      label")
for position, (token, label) in enumerate(zip(tokens["input_ids"], tokens["labels"])):
    if label != -100 or position in (0, 1) or tokens["labels"][position + 1] != -100:
        print(f"{position:8d}  {tokenizer.decode([token])!r:24s}  "
              f"{'-100 (ignored)' if label == -100 else tokenizer.decode([label])!r}")
answer_tokens = sum(label != -100 for label in tokens["labels"])
print(f"{answer_tokens} of {len(tokens['labels'])} tokens count in the loss "
      "(the middle of the prompt is not shown)")

# %% [markdown]
# ## Fine-tuning the tiny model on one process
#
# `solutions/finetune_lora.py` is the lora stage: it loads a pretrained model (a directory, or a
# hub name), adds adapters with PEFT (or trains every weight with `--method full`), trains with
# AdamW and a cosine schedule, evaluates before and after training, and writes into its run
# directory `config.json`, `metrics.jsonl`, `eval.json`, `predictions.jsonl`, the adapter alone
# (`adapter/`), the merged model (`model/`) and checkpoints (`ckpt/`). **Accelerate** launches
# it: the same script runs on one device, with DDP, FSDP or DeepSpeed, as a config file says.
#
# The base model is the tiny GPT of lesson 01 (4 blocks, 64 wide), pretrained on Python's
# documentation and exported to Hugging Face's format (`python -m coursekit export-hf`). Such a
# narrow model needs help to be steered: its preset also adapts the token embedding (`wte`) and
# the output head (`lm_head`), not only the blocks' linear layers (the list is printed below).
# Without them its hidden states barely differ from one input to the next, and its frozen
# 64-wide output embedding cannot make a rare answer word likely: adapters on the blocks alone
# leave exact match at 0%. GPT-2 shares one matrix between `wte` and `lm_head`; the kit's export
# gives the head its own copy (`--untie`), so that merging one adapter does not change the other.
# The run takes the tiny preset's defaults (steps, learning rate, rank, adapted layers), and on a
# CPU it checks its answers less often (`LONGER_RUNS`): a minute or so on a laptop. Every number
# below is read from its run directory.

# %% tags=["demo"]
# installed next to this kernel
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
RUNS = Path("runs")


def free_port():
    """A TCP port nobody listens on, for the processes' rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def finetune(config, name, *flags, env=None):
    """`accelerate launch` the lora stage with solutions/accelerate/<config>.yaml;
    return the run directory and the script's output."""
    out = RUNS / name
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time the cell runs
    command = [ACCELERATE, "launch", "--config_file",
               KIT_ROOT / "solutions" / "accelerate" / f"{config}.yaml",
               "--main_process_port", free_port(),
               KIT_ROOT / "solutions" / "finetune_lora.py",
               "--preset", "tiny", "--model", MODEL, "--data", TASKS, "--out", out,
               *flags]
    result = subprocess.run(list(map(str, command)), capture_output=True, text=True,
                            env={**os.environ, **(env or {})})
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} failed:\n"
                           f"{result.stderr[-3000:]}")
    return out, result.stdout


def summary(log):
    """The script's own lines, without the per-step ones (those are in metrics.jsonl)
    and without DeepSpeed's note that it found no GPU."""
    return "\n".join(line for line in log.splitlines()
                     if not line.startswith(("step ", "[")))


QUICK_EVALUATION = ([] if LONGER_RUNS
                    else ["--eval-interval", 125, "--eval-examples", 50])
single, log = finetune("single", "lora-single", *QUICK_EVALUATION)
print(summary(log))

# %% tags=["demo"]
settings = runs.read_json(single / "config.json")
metrics = runs.read_metrics(single)
evaluation = runs.read_json(single / "eval.json")  # before and after training
evals = [{"step": 0, **evaluation["before"]}] + [m for m in metrics if "val_loss" in m]
targets = settings["args"]["target_modules"]  # a list of names, or "all-linear"
print(f"{settings['trainable']:,} of {settings['parameters']:,} parameters trained "
      f"({settings['trainable_fraction']:.1%}), rank {settings['args']['lora_r']}, on "
      f"{targets if isinstance(targets, str) else ', '.join(targets)}; "
      f"{len(metrics)} steps, "
      f"{sum(m['ms'] for m in metrics) / 1000:.0f} s of training")

fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
left.plot([m["step"] for m in metrics], [m["loss"] for m in metrics],
          label="training loss")
left.plot([m["step"] for m in evals], [m["val_loss"] for m in evals], "o-",
          label="validation loss")
left.set_xlabel("step")
left.set_ylabel("loss per answer token")
left.legend()
right.plot([m["step"] for m in evals], [m["exact_match"] for m in evals], "o-")
right.set_xlabel("step")
right.set_ylabel("exact match")
right.set_ylim(0, 1)
fig.suptitle("LoRA on the tiny GPT, one process")
plt.show()

# %% [markdown]
# ## Before and after
#
# The stage evaluates twice. The **validation loss** is the mean loss per answer token on the
# whole validation split. **Exact match** is stricter: the model writes an answer greedily after
# the prompt, and it counts only if its first line equals the reference (case and spaces aside).
# A loss can fall a long way while the answers are still wrong; exact match says whether the
# model does the task. `eval.json` holds both evaluations; `predictions.jsonl` the answers of
# the last one.

# %% tags=["demo"]
rows = ["| | validation loss | exact match | " + " | ".join(
    evaluation["after"]["exact_match_by_task"]) + " |", "|---|---|---|" + "---|" *
    len(evaluation["after"]["exact_match_by_task"])]
for when in ("before", "after"):
    result = evaluation[when]
    rows.append(f"| {when} training | {result['val_loss']:.3f} | "
                f"{result['exact_match']:.0%} | "
                + " | ".join(f"{v:.0%}" for v in result["exact_match_by_task"].values())
                + " |")
display(Markdown("\n".join(rows)))
# what the tiny preset's recipe promises (the lesson fails if a change to the kit breaks
# it): 30 points more exact match at least, and a quarter off the validation loss
before, after = evaluation["before"], evaluation["after"]
assert after["exact_match"] - before["exact_match"] >= 0.30, evaluation
assert after["val_loss"] < 0.75 * before["val_loss"], evaluation

predictions = [json.loads(line)
               for line in (single / "predictions.jsonl").read_text().splitlines()]
right_ones = [p for p in predictions if p["correct"]][:3]
wrong_ones = [p for p in predictions if not p["correct"]][:3]
rows = ["| task | input | reference | the model's answer | correct |",
        "|---|---|---|---|---|"]
for p in right_ones + wrong_ones:
    # a pipe would end the table cell
    answer = repr(p["answer"].strip()).replace("|", "\\|")
    rows.append(f"| {p['task']} | `{p['input']}` | {p['reference']} | {answer} | "
                f"{'yes' if p['correct'] else 'no'} |")
display(Markdown("\n".join(rows)))

# %% [markdown]
# Before training the model has never seen the template, and it continues the prompt with
# whatever its pretraining suggests. After training, compare the two tasks, and look at the
# wrong answers: are they at least the right *kind* of word (a type name, a number)? A model
# that answers "list" for every container has learnt the format but not yet to read the
# brackets. More steps and a larger base model read the syntax better.
#
# ## Merging the adapter
#
# The run saved the adapter alone (`adapter/`) and the merged model (`model/`):
# $W' = W + \frac{\alpha}{r} BA$ for every adapted matrix, a plain Hugging Face model again, as
# fast as the base model and loadable without PEFT. First the formula on one matrix, by hand;
# then the whole models' logits on some validation prompts.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *Merging an adapter changes the model's answers.* The merge is exact, up to rounding;
# the lesson checks it.
# :::

# %% tags=["demo"]
adapted = PeftModel.from_pretrained(base_model, single / "adapter").eval()
merged = AutoModelForCausalLM.from_pretrained(single / "model").eval()
# the first adapted linear layer (embeddings are adapted too, with other attribute
# names)
name, lora = next((n, m) for n, m in adapted.named_modules() if hasattr(m, "lora_B")
                  and "default" in m.lora_B)
delta = (lora.scaling["default"] * lora.lora_B["default"].weight
         @ lora.lora_A["default"].weight)
# GPT-2's Conv1D stores W transposed (d_in x d_out): so does delta
W = lora.base_layer.weight
by_hand = W + (delta.T if lora.fan_in_fan_out else delta)
saved = merged.state_dict()[name.removeprefix("base_model.model.") + ".weight"]
print(f"{name}: |delta| / |W| = {delta.norm() / W.norm():.2f}; "
      f"W + (alpha/r) B A by hand vs the "
      f"merged model: largest difference {(by_hand - saved).abs().max():.1e}")

batch = tokenizer([finetune_lora.format_prompt(e) for e in val.select(range(8))],
                  return_tensors="pt", padding=True)
with torch.no_grad():
    logits = adapted(**batch).logits
    gap = (logits - merged(**batch).logits).abs().max()
adapter_bytes = (single / "adapter" / "adapter_model.safetensors").stat().st_size
model_bytes = (single / "model" / "model.safetensors").stat().st_size
print(f"merged model vs base model + adapter: largest logit difference {gap:.1e} "
      f"(logits up to {logits.abs().max():.0f})")
print(f"on disk: adapter {adapter_bytes / 2**20:.1f} MiB, merged model "
      f"{model_bytes / 2**20:.1f} MiB")

# %% [markdown]
# The logits agree to float32 rounding: merging changes how the model is stored, not what it
# computes. The tiny model's adapter is a large share of its size when, as here, the 50,257-row
# embedding and output head are adapted too; on GPT-2 124M with adapters on the blocks only it
# is under 1% (exercise 2).
#
# ## One script, five Accelerate configs
#
# `accelerate launch --config_file C` starts the processes and tells the script, through
# environment variables, how to distribute; the script asks `Accelerator.prepare` to wrap the
# model, optimiser and data loaders accordingly. The kit's five configs:

# %% tags=["demo"]
for config in ("single", "ddp", "fsdp", "zero2", "zero3"):
    path = KIT_ROOT / "solutions" / "accelerate" / f"{config}.yaml"
    display(Markdown(f"**{path.name}**\n```yaml\n{path.read_text().strip()}\n```"))

# %% [markdown]
# - `single`: one process, one device; no communication.
# - `ddp`: every process holds the whole model and a share of each batch; after backward the
#   trainable gradients are all-reduced (with LoRA, only the adapters': megabytes).
# - `fsdp`: FSDP2, PyTorch's own ZeRO-3 (lesson 04). Every block's frozen and trainable
#   weights are split over the processes, gathered just before the block runs and freed after.
# - `zero2`: DeepSpeed ZeRO stage 2: gradients and optimiser states are partitioned, the
#   weights are not. With LoRA these are small, so it saves little over DDP.
# - `zero3`: DeepSpeed ZeRO stage 3: weights partitioned too, like FSDP, with optional
#   **offload** of the optimiser state or the weights to CPU memory (or NVMe) when GPU memory
#   runs out.
#
# **DeepSpeed or FSDP?** Both implement ZeRO. FSDP is part of PyTorch: nothing extra to
# install or compile, and it composes with `torch.compile`, tensor parallelism (DTensor) and
# PyTorch's distributed checkpoints; prefer it by default. DeepSpeed has a configuration of its
# own (Accelerate writes it from the yaml above), builds some CUDA operators at first use, and
# offers the most mature offloading (ZeRO-Offload, ZeRO-Infinity), useful when a model barely
# fits in the memory of all the GPUs together; many existing recipes use it. With Accelerate,
# switching between them is a change of config file, not of code. (This lesson skips the
# DeepSpeed configs, whose first start compiles an operator; the kit's tests run all five.)
#
# Now the same script under the **fsdp** config, on 2 processes, for a few steps. With fewer
# than 2 GPUs the processes run on the CPU and talk over gloo. Before any update, both runs hold
# the same pretrained model with $B = 0$ and see the same first batch (32 examples: 2
# micro-batches of 16 on one process, 16 on each of two), so their first losses must agree;
# after that they part, because a 6-step run warms up and decays its learning rate over 6 steps,
# not over the long run's.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# Say here: reading an Accelerate config.
# :::

# %% tags=["demo"]
cpu_only = {"CUDA_VISIBLE_DEVICES": ""} if torch.cuda.device_count() < 2 else {}
sharded, log = finetune("fsdp", "lora-fsdp-2", "--max-steps", 6, "--eval-interval", 3,
                        "--eval-examples", 16, env=cpu_only)
print(summary(log).splitlines()[0])
sharded_settings = runs.read_json(sharded / "config.json")
first_single, first_sharded = metrics[0]["loss"], runs.read_metrics(sharded)[0]["loss"]
print(f"{sharded_settings['distributed_type']} on {sharded_settings['world_size']} "
      f"processes: first loss {first_sharded:.5f}, one process: {first_single:.5f}")
print(f"saved: {', '.join(sorted(p.name for p in sharded.iterdir()))}")

# %% [markdown]
# ## QLoRA, in brief
#
# LoRA leaves the frozen weights as the largest part of memory. **QLoRA** (Dettmers et al.,
# 2023) stores them in 4 bits instead: the **NF4** data type (4-bit "normal float", levels
# spaced for normally distributed weights) with one scale per block of 64 weights, the scales
# themselves quantised again ("double quantisation"). Each layer de-quantises its weights to
# bf16 on the fly for the matrix product; the LoRA adapters keep a higher precision and train
# as before.
# A 7B model's weights shrink from 13.5 GB (bf16) to about 4 GB: one 24 GB GPU fine-tunes it.
# The price is speed (de-quantising every step) and a little accuracy. It needs the
# `bitsandbytes` package and a GPU, so it is not run here; on a GPU node the model would be
# loaded like this, and the rest of the script stays the same:
#
# ```python
# from peft import prepare_model_for_kbit_training
# from transformers import AutoModelForCausalLM, BitsAndBytesConfig
#
# quantisation = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
#                                   bnb_4bit_use_double_quant=True,
#                                   bnb_4bit_compute_dtype=torch.bfloat16)
# model = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M",
#                                              revision="93efa2f097d58c2a74874c7e644dbc9b0cee75a2",
#                                              quantization_config=quantisation,
#                                              device_map={"": 0})
# model = prepare_model_for_kbit_training(model)  # fp32 norms, input gradients for checkpointing
# model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
#                                          task_type="CAUSAL_LM"))
# ```
#
# A quantised base cannot be merged exactly: merge the adapter into the bf16 model instead.
#
# **Exercise 3: choose the set-up from the memory.** For each job below, pick the set-up that
# fits and communicates least: `"ddp"` if it fits, else `"zero2"`, else `"zero3"`; `"qlora"`
# only where none of them fits, since de-quantising every step is slow. Count the weights,
# gradients and Adam states as the memory table above does (fp32, from the shapes it names), and
# leave a quarter of each GPU for activations and buffers. For QLoRA take the 4 GB of the
# paragraph above.

# %% nbgrader={"grade": false, "grade_id": "choose_setup", "locked": false, "schema_version": 3, "solution": true, "task": false}
setup = {
    "LoRA r=16 on GPT-2 124M, 4 GPUs of 16 GB": None,
    "full fine-tuning of the 7B model, 8 GPUs of 80 GB": None,
    "full fine-tuning of the 7B model, 4 GPUs of 40 GB": None,
    "LoRA r=16 on the 7B model, 8 GPUs of 80 GB": None,
    "LoRA r=16 on the 7B model, 1 GPU of 16 GB": None,
}
### BEGIN SOLUTION
setup = {
    "LoRA r=16 on GPT-2 124M, 4 GPUs of 16 GB": "ddp",  # 0.5 GB of weights
    # 27 + 81 / 8 = 37 GB <= 60
    "full fine-tuning of the 7B model, 8 GPUs of 80 GB": "zero2",
    # zero2: 27 + 81 / 4 = 47 > 30
    "full fine-tuning of the 7B model, 4 GPUs of 40 GB": "zero3",
    # 27 GB + 0.6 GB for the adapters
    "LoRA r=16 on the 7B model, 8 GPUs of 80 GB": "ddp",
    # bf16 weights alone are 13.5 > 12
    "LoRA r=16 on the 7B model, 1 GPU of 16 GB": "qlora",
}
### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "choose_setup_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
assert len(setup) == 5
assert all(choice in ("ddp", "zero2", "zero3", "qlora") for choice in setup.values()), \
    'answer "ddp", "zero2", "zero3" or "qlora"'
### BEGIN HIDDEN TESTS
assert setup["LoRA r=16 on GPT-2 124M, 4 GPUs of 16 GB"] == "ddp"
assert setup["full fine-tuning of the 7B model, 8 GPUs of 80 GB"] == "zero2"
assert setup["full fine-tuning of the 7B model, 4 GPUs of 40 GB"] == "zero3"
assert setup["LoRA r=16 on the 7B model, 8 GPUs of 80 GB"] == "ddp"
assert setup["LoRA r=16 on the 7B model, 1 GPU of 16 GB"] == "qlora"
### END HIDDEN TESTS

# %% [markdown]
# ## On a cluster: hub models and data sets
#
# On GPUs the stage defaults to the `gpt2-124m` preset (GPT-2 small from the hub, adapters on
# every linear layer, bf16). `--model` takes any causal language model on the hub, such as
# `openai-community/gpt2` or `HuggingFaceTB/SmolLM2-135M`, and `--data` any data set in the
# Alpaca schema, such as `yahma/alpaca-cleaned` (about 52,000 examples; it has no validation
# split, so the stage holds 200 out).
#
# Compute nodes are often offline. Download both on a **login node** first, into the cache
# (`HF_HOME`, on a file system the compute nodes see). The kit names each at a fixed commit
# (`coursekit/hub.py`), so that a repository that changes on the hub does not change the
# lesson; download that revision:
#
# ```bash
# hf download HuggingFaceTB/SmolLM2-135M --revision 93efa2f097d58c2a74874c7e644dbc9b0cee75a2
# python -c "import datasets; datasets.load_dataset('yahma/alpaca-cleaned', \
#     revision='12567cabf869d7c92e573c7c783905fc160e9639')"
# ```
#
# Jobs then set `HF_HUB_OFFLINE=1`, so that `transformers` and `datasets` read only the cache
# and fail at once, with a clear message, if something is missing. The batch files
# `batchfiles/<site>/batch-lora-NnGg.sh` (N nodes of G GPUs) run `accelerate launch` on every
# node with the DDP config; choose another with `ACCELERATE_CONFIG`, for instance
#
# ```bash
# sbatch --export=ALL,ACCELERATE_CONFIG=solutions/accelerate/zero3.yaml \
#     batchfiles/<site>/batch-lora-1n4g.sh
# ```
#
# The stage's own flags (`--model`, `--data`, `--method full`, `--lora-r`) end the batch file's
# `accelerate launch` line: edit them in a copy of the file. A pre-empted job checkpoints, is
# requeued and resumes with `--resume`, like the other stages.

# %% [markdown]
# ## Key points
#
# - Full fine-tuning trains every weight (16 bytes per parameter with Adam in fp32); LoRA
#   freezes them (4 bytes each) and trains a low-rank update $\frac{\alpha}{r} BA$ beside chosen
#   matrices: $r\,(d_\text{in} + d_\text{out})$ parameters each, about 1% of a model.
# - $B = 0$ at the start, so training starts from exactly the pretrained model; merging
#   $W' = W + \frac{\alpha}{r} BA$ afterwards gives a plain model with the same outputs.
# - Instruction examples use a fixed prompt template; the prompt's labels are $-100$, so only
#   the answer is learnt.
# - Judge a fine-tune on a task metric (exact match) as well as the validation loss, before and
#   after training.
# - With LoRA the frozen weights dominate memory: DDP is enough while they fit on a GPU;
#   ZeRO-2 saves little; ZeRO-3 or FSDP splits the weights, and QLoRA stores them in 4 bits.
# - Accelerate runs one script on one device, DDP, FSDP or DeepSpeed by config file; on a
#   cluster, download models and data on a login node and run jobs with `HF_HUB_OFFLINE=1`.
