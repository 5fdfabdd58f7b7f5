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
# # 00b · Deep learning in PyTorch
#
# **Questions.** This lesson answers
# - What is a tensor, and how does PyTorch put one on a GPU?
# - How does PyTorch compute gradients, and how does a model learn from them?
# - How do I know that a model has learned something general, not its training data by heart?
# - How much faster is a GPU at the arithmetic of deep learning?
#
# **Objectives.** After this lesson you can
# - create tensors, read their shapes and dtypes, predict the shape of a broadcast or a matrix
#   product, and move a tensor to a device;
# - compute a gradient with autograd and check it against the derivative worked out by hand;
# - build a model from `nn.Linear` layers as an `nn.Module` and count its parameters;
# - write a training loop (loss, `zero_grad`, `backward`, `step`), and one training step that
#   adds up the gradients of several microbatches;
# - split data into a training and a validation set, tell overfitting from underfitting by their
#   loss curves, and stop a run early;
# - time a matrix multiplication on your device, and say why deep learning runs on GPUs.
#
# **Prerequisites.** Python (functions, lists, loops, classes); lesson 00. No PyTorch: this
# lesson starts from nothing, and lesson 01 builds on it.
#
# **Time.** About 65 minutes: reading, the exercises, and waiting for the cells on a laptop's CPU.
# The time is an estimate; the instructor guide says how it is made.

# %%
import math
import time

import matplotlib.pyplot as plt
import torch
from torch import nn

# %% [markdown]
# The set-up: the device this kernel computes on (a GPU if it has one), and the lesson's data
# set, which it makes itself: 1,000 points $(x, y)$ of a sine with noise added, $y = \sin 2x +
# \varepsilon$. Everything random is seeded, and the CPU computes on one thread (for tensors this
# small, one core is faster than several that must wait for each other), so every run of the
# lesson prints the same numbers.

# %%
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print(f"PyTorch {torch.__version__}, computing on {device}")
torch.manual_seed(0)  # the random numbers of the cells below, the same in every run
torch.set_num_threads(1)  # one CPU core: the same sums in the same order, every run

NOISE = 0.3  # the standard deviation of the noise no model can predict
generator = torch.Generator().manual_seed(0)
x_all = torch.rand(1000, 1, generator=generator) * 4 - 2  # 1,000 x in [-2, 2)
y_all = torch.sin(2 * x_all) + NOISE * torch.randn(1000, 1, generator=generator)
print(x_all.shape, y_all.shape)

# %% [markdown]
# ## Tensors
#
# A **tensor** is an array of numbers with any number of dimensions: a number, a vector, a
# matrix, a stack of matrices. It is NumPy's array with two more powers: it can live on a GPU,
# and it can remember how it was computed, for gradients (next section). Every tensor has a
# `shape` (its size along each dimension), a `dtype` (the kind of number: 32-bit floats unless
# you say otherwise) and a `device` (where its memory is).

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# Tell trainees to read `.shape` first: most errors in PyTorch are shape errors.
# :::

# %%
a = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # nested lists: 2 rows, 3 columns
print(a.shape, a.dtype, a.device)
print(torch.zeros(2, 3))
print(torch.arange(5), torch.tensor([1, 2, 3]).dtype)  # integers are int64
print(torch.randn(2, 2))  # random numbers from a normal distribution
half = a.to(torch.bfloat16)  # 16-bit floats, as GPUs train in: half the bytes
print(half.dtype, half.element_size(), "bytes a number, against", a.element_size())
print(a[1], a[:, 0], a.sum(), a.mean(dim=0), a.reshape(3, 2).shape, sep="\n")

# %% [markdown]
# Arithmetic works number by number, and shapes that differ are matched by **broadcasting**:
# PyTorch lines the shapes up from the right, and a dimension of size 1 (or a missing one) is
# stretched to the other's size. A column of shape (2, 1) plus a row of shape (3,) gives a
# (2, 3) table of every sum.
#
# `@` is the matrix product: $(n, m)$ @ $(m, k)$ gives $(n, k)$, each entry a dot product of
# length $m$. With more dimensions, the last two are multiplied and those in front are a
# batch: 8 matrices of (2, 3) @ one (3, 4) is 8 products of (2, 4). Almost all the arithmetic
# of a neural network is such products.

# %%
column = torch.tensor([[10.0], [20.0]])  # shape (2, 1)
row = torch.tensor([1.0, 2.0, 3.0])  # shape (3,)
print(column + row)  # (2, 1) and (3,) broadcast to (2, 3)
print(a * 10, a - a.mean(dim=0), sep="\n")  # (2, 3) with a number, with a (3,) row

w = torch.randn(3, 4)
print((a @ w).shape)  # (2, 3) @ (3, 4) -> (2, 4)
print((torch.randn(8, 2, 3) @ w).shape)  # a batch of 8: (8, 2, 4)

# %% [markdown]
# A tensor is created on the CPU; `.to(device)` returns a copy on another device (on the CPU,
# `.to("cpu")` returns the tensor itself). An operation runs on the device its tensors are on,
# and all of them must be on the same one: mixing a GPU tensor with a CPU tensor is an error.
# The code is otherwise the same on every device, which is what lets this lesson's cells run
# unchanged on a laptop and on a GPU node.

# %%
on_device = a.to(device)
print(on_device.device, (on_device @ w.to(device)).device)
print(on_device.cpu().tolist())  # back to the CPU, and to Python lists

# %% [markdown]
# ## Autograd: gradients for free
#
# Training needs the **gradient** of the loss: how much it changes when each parameter changes a
# little (the derivative, for every parameter at once). PyTorch works it out for you. A tensor
# made with `requires_grad=True` has the operations on it recorded; `backward()` on a result
# then goes through that record from the end back to the start (the chain rule) and leaves
# $\partial\,\text{result} / \partial x$ in `x.grad`. This is **autograd**.
#
# Check it on one we can do by hand: $y = x^3 - 2x$ has $dy/dx = 3x^2 - 2$, which is 10 at
# $x = 2$.

# %%
x = torch.tensor(2.0, requires_grad=True)
y = x**3 - 2 * x
y.backward()  # fills x.grad with dy/dx at x = 2
print(f"y = {y.item()}, dy/dx by autograd = {x.grad.item()}, "
      f"by hand = {3 * 2.0**2 - 2}")

# %% [markdown]
# Three things about `.grad` that every training loop depends on:
# - `backward()` *adds* to `.grad`; it does not replace what is there. Run it again and the
#   gradient doubles. Before each new gradient, empty it (`x.grad = None`, which is what an
#   optimiser's `zero_grad()` does).
# - Only the tensors you made with `requires_grad=True` (the leaves of the record, such as a
#   model's parameters) keep a `.grad`; results computed from them do not.
# - Inside `with torch.no_grad():` nothing is recorded: for evaluating a model, and for changing
#   its parameters in place. `t.detach()` is the same numbers as `t`, cut off from the record.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *`backward()` replaces the gradient.* Spot it in `train_step`s without `zero_grad()`,
# whose gradients pile up from one call to the next. The autograd section's second
# `backward` answers it.
# :::

# %%
y = x**3 - 2 * x
y.backward()
print("a second backward:", x.grad.item())  # 10 + 10
x.grad = None

# the gradient of a mean squared error, for each of two parameters at once
w_b = torch.tensor([0.5, 0.0], requires_grad=True)  # slope and intercept
xs, ys = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 6.0])
error = w_b[0] * xs + w_b[1] - ys
(error**2).mean().backward()
by_hand = torch.stack([(2 * error * xs).mean(), (2 * error).mean()]).detach()
print("autograd:", w_b.grad, " by hand:", by_hand)
with torch.no_grad():
    print("recorded inside no_grad:", (w_b * 2).requires_grad)

# %% [markdown]
# **Exercise 1.** Write `gradient(f, x)`: the gradient of the function `f` (which takes a tensor
# and returns a tensor holding one number) at the point `x`, computed by autograd with one call of
# `f`. The result has `x`'s shape. Leave `x` as it was: its `requires_grad` and its `.grad`
# unchanged, whatever they were (`x` may be a model's parameter, which already requires
# gradients). Calling `gradient` twice gives the same answer twice.

# %% nbgrader={"grade": false, "grade_id": "gradient", "locked": false, "schema_version": 3, "solution": true, "task": false}
def gradient(f, x):
    ### BEGIN SOLUTION
    point = x.detach().clone().requires_grad_(True)
    f(point).backward()
    return point.grad
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "gradient_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
x0 = torch.tensor([1.0, -2.0, 3.0])
# the sum of t_i squared: its derivative by t_i is 2 t_i
assert torch.allclose(gradient(lambda t: (t**2).sum(), x0), 2 * x0)
assert x0.grad is None and not x0.requires_grad  # x is left as it was
### BEGIN HIDDEN TESTS
calls = []


def counted_sine(t):
    calls.append(1)
    return torch.sin(t).sum()


x1 = torch.linspace(-1, 1, 5, dtype=torch.float64)
assert torch.allclose(gradient(counted_sine, x1), torch.cos(x1))
assert len(calls) == 1  # one call of f: autograd, not finite differences
assert torch.equal(gradient(counted_sine, x1), gradient(counted_sine, x1))
m = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
assert torch.allclose(gradient(lambda t: t[0, 0] * t[1, 1] - t[0, 1] ** 3, m),
                      torch.tensor([[4.0, -12.0], [0.0, 1.0]]))
parameter = nn.Parameter(torch.tensor([2.0]))
assert torch.allclose(gradient(lambda t: (t**3).sum(), parameter), torch.tensor([12.0]))
assert parameter.grad is None and parameter.requires_grad
### END HIDDEN TESTS

# %% [markdown]
# ## A model: `nn.Module`
#
# A neural network is a function with parameters, built from layers. `nn.Linear(n_in, n_out)`
# is the simplest: it multiplies its input by a weight matrix of shape `(n_out, n_in)` and adds a
# bias of `n_out` numbers, $y = x W^\top + b$, for a whole batch of inputs at once. Between two
# linear layers goes a non-linear function (here tanh): without it, two linear layers would be
# one linear map, and could only draw straight lines.
#
# A model is a class that inherits from `nn.Module`: its layers are made in `__init__`, and
# `forward` says how an input goes through them. The module finds every parameter of its layers
# by itself (`model.parameters()`), for the optimiser to update and for you to count.

# %%
class TwoLayerNet(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.hidden = nn.Linear(1, width)
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


net = TwoLayerNet(8)
print(net)
for name, parameter in net.named_parameters():
    print(f"{name:14s} {tuple(parameter.shape)}")
print(sum(p.numel() for p in net.parameters()), "parameters")  # 8 + 8 + 8 + 1
print(net(torch.zeros(5, 1)).shape)  # a batch of 5 inputs -> 5 outputs

# %% [markdown]
# `nn.Sequential` builds a model that only passes its input through its layers in order, with no
# class to write. The lesson makes its models with it, from one function: `make_model(width)`
# has `depth` hidden layers of `width` numbers each, and `make_model(0)` is a plain linear model.
# The seed makes a model start from the same random weights every time.

# %%
def make_model(width, depth=2, seed=0):
    torch.manual_seed(seed)
    if width == 0:
        return nn.Linear(1, 1)
    layers, inputs = [], 1
    for _ in range(depth):
        layers += [nn.Linear(inputs, width), nn.Tanh()]
        inputs = width
    return nn.Sequential(*layers, nn.Linear(inputs, 1))


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


for width in (0, 8, 128):
    print(f"width {width:3d}: {count_parameters(make_model(width)):6,d} parameters")

# %% [markdown]
# ## Training: a loss, its gradient, a step
#
# Training makes the model's outputs close to the data's. The **loss** measures how far they are:
# here the mean squared error between prediction and target (`nn.MSELoss`). Its gradient points
# the way the loss grows fastest, so a small step against it lowers the loss: **gradient
# descent**, $w \leftarrow w - \eta \, \partial L / \partial w$ for every parameter $w$, where
# the **learning rate** $\eta$ sets the size of the step. One step, by hand, on a line with
# noise:

# %%
loss_fn = nn.MSELoss()  # the mean of the squared errors
noise = torch.randn(50, 1, generator=torch.Generator().manual_seed(1))
x_line = torch.linspace(-1, 1, 50).reshape(-1, 1)
y_line = 3 * x_line - 1 + 0.1 * noise  # a line to find: y = 3x - 1

line = make_model(0)
loss = loss_fn(line(x_line), y_line)
loss.backward()
with torch.no_grad():  # change the parameters without recording it
    for parameter in line.parameters():
        parameter -= 0.1 * parameter.grad  # one step of gradient descent
print(f"loss {loss.item():.3f} before the step, "
      f"{loss_fn(line(x_line), y_line).item():.3f} after it")

# %% [markdown]
# An **optimiser** does that update for you: `torch.optim.SGD` is the step above, and
# `torch.optim.AdamW` (the one lesson 01 uses) adapts each parameter's step to the size of its
# recent gradients. Every training step is then the same three calls around the forward pass:
# `optimizer.zero_grad()` (empty the last step's gradients, which `backward` would add to),
# `loss.backward()` (the new gradients), `optimizer.step()` (update the parameters). A hundred
# such steps find the line:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *The losses of microbatches add up to the minibatch's.* Spot it when exercise 2's
#   visible test of four microbatches against the whole batch fails: the step is four
#   times too large, as `loss_fn` is a mean.
# - Say here that the three calls of a step (`zero_grad`, `backward`, `step`) are in
#   every stage script of the course (find them in `solutions/train_gpt2_std.py`);
#   exercise 2's accumulation is lesson 01's `grad_accum`, and DDP (lesson 02) averages
#   gradients over GPUs the way it averages them over microbatches.
# :::

# %% tags=["demo"]
line = make_model(0)
optimizer = torch.optim.SGD(line.parameters(), lr=0.1)
losses = []
for step in range(100):
    optimizer.zero_grad()
    loss = loss_fn(line(x_line), y_line)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"loss {losses[0]:.3f} -> {losses[-1]:.4f} in 100 steps; the line found: "
      f"y = {line.weight.item():.2f}x {line.bias.item():+.2f}")

fig, (ax_loss, ax_fit) = plt.subplots(1, 2, figsize=(9, 3.2))
ax_loss.plot(losses)
ax_loss.set(xlabel="step", ylabel="training loss", yscale="log")
ax_fit.plot(x_line, y_line, ".", label="data")
with torch.no_grad():
    ax_fit.plot(x_line, line(x_line), label="the model after training")
ax_fit.set(xlabel="x", ylabel="y")
ax_fit.legend()
plt.show()

# %% [markdown]
# A real data set is too large for one forward pass: each step takes a **minibatch** of samples.
# When even a minibatch does not fit in the device's memory, it is split into **microbatches**
# that go through the model one after another, their gradients added up in `.grad`, and the
# optimiser steps once at the end: **gradient accumulation**, lesson 01's `grad_accum`.
#
# **Exercise 2.** Write `train_step(model, optimizer, loss_fn, microbatches)`: one optimiser step
# on the minibatch made of `microbatches`, a list of `(inputs, targets)` pairs of equal size. The
# step must move the parameters exactly as one step on the whole minibatch at once would (where
# `loss_fn` is a mean over the minibatch), and must not be changed by the steps before it.
# Return the minibatch's mean loss before the step, as a Python float.

# %% nbgrader={"grade": false, "grade_id": "train_step", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train_step(model, optimizer, loss_fn, microbatches):
    ### BEGIN SOLUTION
    optimizer.zero_grad()
    minibatch_loss = 0.0
    for inputs, targets in microbatches:
        # each microbatch's mean, weighted: the gradients add up to the minibatch's
        share = loss_fn(model(inputs), targets) / len(microbatches)
        share.backward()
        minibatch_loss += share.item()
    optimizer.step()
    return minibatch_loss
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "train_step_tests", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
x_batch, y_batch = x_all[:32], y_all[:32]
quarters = list(zip(x_batch.split(8), y_batch.split(8)))
model = make_model(16)
start = [p.detach().clone() for p in model.parameters()]
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
losses = [train_step(model, optimizer, nn.MSELoss(), quarters) for _ in range(30)]
assert all(isinstance(loss, float) for loss in losses) and losses[-1] < 0.8 * losses[0]
assert all(not torch.equal(p, q) for p, q in zip(start, model.parameters()))
# one step on 4 microbatches moves the parameters as one step on the whole minibatch
whole, parts = make_model(16), make_model(16)
train_step(whole, torch.optim.SGD(whole.parameters(), lr=0.1), nn.MSELoss(),
           [(x_batch, y_batch)])
train_step(parts, torch.optim.SGD(parts.parameters(), lr=0.1), nn.MSELoss(), quarters)
assert all(torch.allclose(p, q, atol=1e-6)
           for p, q in zip(whole.parameters(), parts.parameters()))
### BEGIN HIDDEN TESTS
yours, reference = make_model(16, seed=1), make_model(16, seed=1)
singles = list(zip(x_batch[:4].split(1), y_batch[:4].split(1)))
for minibatches, make_optimizer in (
        (quarters, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
        (singles, lambda ps: torch.optim.SGD(ps, lr=0.05))):
    your_optimizer = make_optimizer(yours.parameters())
    reference_optimizer = make_optimizer(reference.parameters())
    x_whole = torch.cat([inputs for inputs, _ in minibatches])
    y_whole = torch.cat([targets for _, targets in minibatches])
    for _ in range(3):  # each step on its own gradients, none left from the step before
        loss = train_step(yours, your_optimizer, nn.MSELoss(), minibatches)
        reference_optimizer.zero_grad()
        expected = nn.MSELoss()(reference(x_whole), y_whole)
        expected.backward()
        reference_optimizer.step()
        assert abs(loss - expected.item()) < 1e-5, "the minibatch's mean loss"
        assert all(torch.allclose(p, q, atol=1e-5)
                   for p, q in zip(yours.parameters(), reference.parameters())), (
            "the update is not that of this minibatch's gradient alone: are the "
            "gradients of the step before still there?")
### END HIDDEN TESTS

# %% [markdown]
# ## Training and validation data: overfitting
#
# A low training loss says that the model fits the data it trained on, not that it will predict
# data it has never seen, which is what it is for. So before training, set some of the data
# aside: the **validation set**, which the model never trains on; the rest is the **training
# set**. The loss on the validation set (the **validation loss**) measures how well the model
# generalises. Shuffle before splitting, so that both halves come from the same distribution.
#
# No model can do better than the noise here: the best possible predictor, $\sin 2x$ itself,
# has a mean squared error of $0.3^2 = 0.09$ on new data.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *A low training loss is a good model.* Spot it when a trainee calls the run with the
#   lowest training loss the best fit in exercise 4. The validation curves answer it.
# - Say here that the validation loss, not the training loss, is what early stopping and
#   hyperparameter searches (lesson 07) watch.
# :::

# %%
order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(0))
x_val, y_val = x_all[order[:500]], y_all[order[:500]]
x_pool, y_pool = x_all[order[500:]], y_all[order[500:]]
print(f"{len(x_val)} validation points, {len(x_pool)} training points to draw from; "
      f"the noise floor: {NOISE**2:.2f}")

# %% [markdown]
# `fit` trains a model on the first `n_train` training points, with the whole training set as
# each step's batch (so each step is an **epoch**, one pass over the training set), and records
# both losses after every epoch. It is the training loop above, with the validation loss
# computed under `torch.no_grad()`. (These models are so small that a GPU would not train them
# faster: they train on the CPU.)

# %%
def fit(model, n_train, epochs=300, lr=0.01, weight_decay=0.0):
    x, y = x_pool[:n_train], y_pool[:n_train]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    history = {"train": [], "val": []}
    for epoch in range(epochs):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        history["train"].append(loss.item())
        with torch.no_grad():
            history["val"].append(loss_fn(model(x_val), y_val).item())
    return history


def summary(history):
    val = history["val"]
    best = min(range(len(val)), key=val.__getitem__)
    return (f"training loss {history['train'][0]:.3f} -> {history['train'][-1]:.3f}; "
            f"validation loss lowest {val[best]:.3f} at epoch {best}, "
            f"{val[-1]:.3f} at the end")


wide = make_model(128)
few_points = fit(wide, n_train=20)
print(f"{count_parameters(wide):,} parameters on 20 points:", summary(few_points))

# %% [markdown]
# The model has hundreds of parameters for each of its 20 training points. It first learns the
# sine, and both losses fall; then it goes on lowering the training loss by learning the noise of
# those 20 points, which no other point shares, and the validation loss rises. That is
# **overfitting**: the training loss falls while the validation loss rises, the gap between
# them growing. The training loss alone would never show it.

# %% tags=["demo"]
fig, (ax_loss, ax_fit) = plt.subplots(1, 2, figsize=(9, 3.2))
ax_loss.plot(few_points["train"], label="training loss")
ax_loss.plot(few_points["val"], label="validation loss")
ax_loss.axhline(NOISE**2, color="grey", linestyle="--", label="the noise floor")
ax_loss.set(xlabel="epoch", ylabel="loss", yscale="log")
ax_loss.legend()
grid = torch.linspace(-2, 2, 200).reshape(-1, 1)
ax_fit.plot(x_pool[:20], y_pool[:20], "o", label="the 20 training points")
ax_fit.plot(grid, torch.sin(2 * grid), "--", color="grey", label="sin 2x")
with torch.no_grad():
    ax_fit.plot(grid, wide(grid), label="the model after 300 epochs")
ax_fit.set(xlabel="x", ylabel="y")
ax_fit.legend(fontsize="small")
plt.show()

# %% [markdown]
# The simplest cure is to keep the model of the epoch with the lowest validation loss, and to stop
# once the validation loss has not improved for a while: **early stopping**. A run evaluates the
# model after every epoch, keeps a copy of the best one so far, and stops once `patience` epochs
# in a row have brought no new lowest validation loss (a loss equal to the lowest is no
# improvement). It cannot look ahead: a lower loss that would have come after it stopped is never
# seen.
#
# **Exercise 3.** Write `early_stopping(val_losses, patience)`: given the validation loss after
# each epoch of a run, return the index (into `val_losses`) of the epoch whose model early
# stopping keeps. `patience` is at least 1.

# %% nbgrader={"grade": false, "grade_id": "early_stopping", "locked": false, "schema_version": 3, "solution": true, "task": false}
def early_stopping(val_losses, patience):
    ### BEGIN SOLUTION
    kept = 0
    for epoch, val_loss in enumerate(val_losses):
        if val_loss < val_losses[kept]:
            kept = epoch
        elif epoch - kept >= patience:
            break  # patience epochs without a new lowest loss: stop
    return kept
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "early_stopping_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
val = few_points["val"]
kept = early_stopping(val, patience=20)
assert isinstance(kept, int) and 0 < kept < len(val) - 20
# no lower loss came in the 20 epochs after it, and none before it was as low
assert min(val[kept + 1:kept + 21]) >= val[kept] and min(val[:kept]) > val[kept]
assert early_stopping([3.0, 2.0, 1.0], patience=5) == 2
### BEGIN HIDDEN TESTS
assert early_stopping([1.0], patience=3) == 0
assert early_stopping([5.0, 4.0, 4.5, 4.6, 4.7, 3.0], patience=3) == 1, (
    "three epochs without a new low stop the run: the 3.0 after them is never seen")
assert early_stopping([5.0, 4.0, 4.5, 4.6, 3.0, 3.5], patience=3) == 4  # 3.0 in time
assert early_stopping([2.0, 2.0, 2.0, 1.0], patience=2) == 0  # equal is no improvement
assert early_stopping([3.0, 1.0, 1.0, 2.0], patience=10) == 1  # the first of equal lows
assert early_stopping([4.0, 3.0, 2.0, 1.0], patience=1) == 3


def first_not_beaten(losses, patience):
    """A new lowest loss that no loss of the next `patience` epochs beats."""
    return next(i for i, loss in enumerate(losses)
                if loss < min(losses[:i], default=math.inf)
                and min(losses[i + 1:i + 1 + patience], default=math.inf) >= loss)


for patience in (1, 5, 20, 50, 1000):
    assert early_stopping(val, patience) == first_not_beaten(val, patience), patience
### END HIDDEN TESTS

# %% [markdown]
# What else helps against overfitting, each shown on the same model:
# - **More data.** With 500 training points instead of 20, the noise of any one point hardly
#   matters: the model can only lower the training loss by learning the sine.
# - **Weight decay.** Every step also shrinks each weight a little towards zero
#   (`AdamW(..., weight_decay=...)`), which keeps the function smooth, unless the data pull hard.
# - **Early stopping**, from exercise 3: the model of the epoch marked with a dot.

# %% tags=["demo"]
cures = {"20 points (above)": few_points,
         "500 points": fit(make_model(128), n_train=500),
         "20 points, weight decay": fit(make_model(128), n_train=20, weight_decay=1.0)}
fig, ax = plt.subplots(figsize=(6, 3.5))
for name, history in cures.items():
    print(f"{name:28s}", summary(history))
    ax.plot(history["val"], label=name)
stop = early_stopping(few_points["val"], patience=20)
print(f"early stopping (patience 20) keeps epoch {stop}: validation loss "
      f"{few_points['val'][stop]:.3f}, against {few_points['val'][-1]:.3f} at the end")
ax.plot([stop], [few_points["val"][stop]], "ko", label="early stopping keeps")
ax.axhline(NOISE**2, color="grey", linestyle="--", label="the noise floor")
ax.set(xlabel="epoch", ylabel="validation loss", yscale="log")
ax.legend()
plt.show()

# %% [markdown]
# The opposite fault is **underfitting**: the model does not even fit its training data. Its
# training loss stays well above what the data allow (here the noise floor, 0.09), and the
# validation loss stays up with it. A model too simple for the data does this, and so does one
# whose training went too slowly or stopped too soon. A run that fits well brings both losses down
# together, close to the floor.
#
# **Exercise 4.** Here are four more runs, `mystery_runs`. Diagnose each from its two loss
# curves, plotted below: set `diagnosis` to a dictionary from each run's name to
# `"overfits"`, `"underfits"` or `"fits"`.

# %%
mystery_runs = {
    "A": fit(make_model(0), n_train=500),
    "B": fit(make_model(64, depth=1), n_train=500, lr=0.0005),
    "C": fit(make_model(32), n_train=500),
    "D": fit(make_model(128, depth=3), n_train=40),
}
for name, history in mystery_runs.items():
    print(name, summary(history))

# %% tags=["demo"]
fig, axes = plt.subplots(1, 4, figsize=(12, 3), sharey=True)
for ax, (name, history) in zip(axes, mystery_runs.items()):
    ax.plot(history["train"], label="training")
    ax.plot(history["val"], label="validation")
    ax.axhline(NOISE**2, color="grey", linestyle="--")
    ax.set(title=f"run {name}", xlabel="epoch", yscale="log")
axes[0].set_ylabel("loss")
axes[0].legend()
plt.show()

# %% nbgrader={"grade": false, "grade_id": "diagnosis", "locked": false, "schema_version": 3, "solution": true, "task": false}
### BEGIN SOLUTION
diagnosis = {"A": "underfits", "B": "underfits", "C": "fits", "D": "overfits"}
### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "diagnosis_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
assert set(diagnosis) == set(mystery_runs)
assert set(diagnosis.values()) <= {"overfits", "underfits", "fits"}
### BEGIN HIDDEN TESTS
assert diagnosis == {"A": "underfits", "B": "underfits", "C": "fits", "D": "overfits"}
### END HIDDEN TESTS

# %% [markdown]
# ## The GPU's speed
#
# A GPU does the same arithmetic as a CPU, on thousands of numbers at once. Lesson 00 counted the
# work of a matrix product: $2n^3$ floating-point operations (FLOPs) for two $n \times n$
# matrices. Time one on this kernel's CPU, and on its GPU if it has one, for growing $n$: the
# FLOP/s (FLOPs per second) rise while the matrices are too small to keep the device busy, then
# level off. The code is the same for both devices; only `device` differs.

# %% tags=["demo"]
def matmul_flops(n, on, repeats=3):
    """FLOP/s of an n x n matrix product on the device `on`."""
    a = torch.randn(n, n, device=on)
    b = torch.randn(n, n, device=on)
    a @ b  # a warm-up: the first call pays for setting things up
    if on.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if on.type == "cuda":
        torch.cuda.synchronize()  # a GPU works asynchronously: wait for it to finish
    return 2 * n**3 / ((time.perf_counter() - start) / repeats)


devices = [torch.device("cpu")] + ([device] if device.type == "cuda" else [])
fig, ax = plt.subplots(figsize=(6, 3.5))
for on in devices:
    sizes = [64, 128, 256, 512, 1024]
    if on.type == "cuda":  # a GPU needs larger matrices to be kept busy
        sizes += [2048, 4096, 8192]
    rates = [matmul_flops(n, on) for n in sizes]
    for n, rate in zip(sizes, rates):
        print(f"{on.type}: n = {n:5d}  {rate / 1e9:10.1f} GFLOP/s")
    ax.plot(sizes, [rate / 1e9 for rate in rates], "o-", label=on.type)
ax.set(xscale="log", yscale="log", xlabel="matrix size n", ylabel="GFLOP/s")
ax.legend()
plt.show()

# %% [markdown]
# One core of a CPU does some tens of GFLOP/s (10⁹ FLOP/s) on 32-bit floats: the cell measured
# one, as the set-up gave PyTorch one thread (`torch.set_num_threads(4)` would give it four; by
# default it takes every core), and a laptop's few cores together do a few hundred at best. A
# data-centre GPU does far more: an NVIDIA H100 SXM peaks at 67 TFLOP/s (10¹² FLOP/s) on 32-bit
# floats and at about 989 TFLOP/s on bf16 with its tensor cores, by
# [NVIDIA's H100 datasheet](https://www.nvidia.com/en-us/data-center/h100/) (which prints
# 1,979 for bf16: a figure for matrices with 2:4 sparsity, twice the dense rate). Those are the
# vendor's peaks, not measurements of this kit; lesson 00 measures your device against its peak.
# In a GPU session this same cell runs with `device` set to `cuda`, and prints and plots the
# GPU's rate beside the CPU's.
#
# Two things decide whether the GPU's speed reaches a training run. The work must be large: the
# small matrices at the left of the plot leave most of a device idle, which is why this lesson's
# tiny models trained on the CPU. And the data must already be on the GPU: copying tensors
# between CPU and GPU memory is far slower than computing on them, so a training run moves the
# model there once (`model.to(device)`) and each batch as it comes (`x.to(device)`). Lesson 01
# trains a GPT that way; the lessons after it spread the work over many GPUs.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *The GPU is always faster.* Spot it when trainees move the lesson's tiny models to a
# GPU and wait longer. The left end of the speed plot answers it.
# :::

# %% [markdown]
# ## Key points
#
# - A tensor has a shape, a dtype and a device; operations broadcast shapes from the right, `@`
#   multiplies matrices, and `.to(device)` moves a tensor to the GPU, where the same code runs.
# - Autograd records the operations on tensors that require gradients; `backward()` *adds* the
#   gradient of a result to each one's `.grad`.
# - A model is an `nn.Module` of layers; `model.parameters()` are what the optimiser updates.
# - A training step is `zero_grad()`, forward, loss, `backward()`, `step()`; accumulating
#   microbatches' gradients (each loss divided by their number) gives one large batch's step.
# - Judge a model by its validation loss, on data it never trained on: a training loss that
#   falls while the validation loss rises is overfitting. More data, weight decay and early
#   stopping help; a training loss that stays high is underfitting.
# - Deep learning is mostly large matrix products, which a GPU does thousands of times faster
#   than a CPU core, when the matrices are large enough to keep it busy.
