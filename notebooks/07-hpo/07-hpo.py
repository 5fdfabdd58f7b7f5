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
# # 07 · Hyperparameter optimisation on HPC: Optuna, pruning, Slurm arrays
#
# **Questions.** This lesson answers
# - How do I choose hyperparameters when every trial costs a training run?
# - How do many GPUs search together without repeating each other or wasting trials?
# - How do I run a search as a Slurm array that survives pre-emption?
#
# **Objectives.** After this lesson you can
# - say why the validation loss, as a function of the hyperparameters, is a black box: no
#   gradient, noisy and expensive, and what follows for how to search it;
# - show why random search beats a grid when only a few hyperparameters matter;
# - fit a Gaussian-process surrogate, compute the expected improvement by hand, and say how TPE
#   chooses its next point instead;
# - implement successive halving, compute Hyperband's brackets, and say what ASHA changes for
#   parallel workers;
# - keep parallel workers from proposing the same configuration (seeds per worker, the constant
#   liar);
# - scale the learning rate and the warm-up when more GPUs make the global batch larger;
# - run an Optuna study of the GPT trainer with workers that share a journal file, read its
#   results, and continue it;
# - run the same study on Slurm as a job array, with multi-node trials and pre-emption.
#
# **Prerequisites.** Lesson 01: the std stage, its presets, run directories (`metrics.jsonl`)
# and learning-rate schedule. Lesson 02: the global batch and the scaling rules. Lesson 00: Slurm
# batch files. Lesson 06 for tracking many runs.
#
# **Time.** About 105 minutes, in two parts of about 55 and 50 (the end of part 1 is marked):
# reading, the exercises, and waiting for the cells on a laptop's CPU. The times are estimates; the
# instructor guide says how they are made.
#
# The last part of this lesson tunes the GPT trainer itself: an Optuna study of 5 short training
# runs, 2 at a time. It takes about a minute on a laptop, so the first cell starts it in the
# background, as you would submit a batch job and read while it waits and runs. The section "The
# real study" explains every flag and reads what it wrote.

# %%
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from coursekit import KIT_ROOT, data

# %% [markdown]
# The set-up: the offline corpus, and a fresh folder for everything the lesson writes.

# %%
DATA = KIT_ROOT / "data" / "builtin"
if not (DATA / "meta.json").exists():  # the offline corpus: built in seconds, once
    data.prepare_builtin(DATA)
if globals().get("study_job") is not None and study_job.poll() is None:
    raise RuntimeError("the study of the previous run is still training: wait for it, "
                       "or restart the kernel (Kernel, Restart Kernel and Run All "
                       "Cells)")
RUNS = Path("runs")  # everything this lesson writes: the study, its trials, a copy
shutil.rmtree(RUNS, ignore_errors=True)  # a fresh study each time the lesson runs
RUNS.mkdir()

# %% tags=["demo"]
# the journal, the trials' run directories, the results
STUDY = (RUNS / "study").resolve()
STUDY_COMMAND = [sys.executable, KIT_ROOT / "solutions" / "hpo_optuna.py", "--preset",
                 "tiny", "--data", DATA, "--study-dir", STUDY, "--trials", 5,
                 "--workers", 2, "--max-steps", 6, "--eval-interval", 2,
                 "--train-args=--eval-steps 1", "--baseline"]
# what a batch job would write to its --output
study_output = open(RUNS / "study.out", "w")
study_job = subprocess.Popen(list(map(str, STUDY_COMMAND)), stdout=study_output,
                             stderr=subprocess.STDOUT, cwd=KIT_ROOT)
study_started = time.perf_counter()
print(f"started the study (process {study_job.pid}); "
      f"its output goes to {RUNS / 'study.out'}")

# %%
import difflib  # the rest of the imports, while the study starts
import json
import math
import re
import warnings

import matplotlib.pyplot as plt
import numpy as np
import optuna
import pandas as pd
import torch
from IPython.display import Markdown, display
from sklearn.exceptions import ConvergenceWarning
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import ConstantKernel, Matern

from coursekit import perf, presets, stages, training
from solutions import gpt

sys.path.insert(0, str(KIT_ROOT / "solutions"))
# the study's driver: its search space, sampler, pruner, storage
import hpo_optuna  # noqa: E402

# Optuna announces every study and trial at INFO level, and warns that a few features
# (the constant liar, multivariate TPE) are experimental: both would bury the lesson's
# own output.
optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
print(f"optuna {optuna.__version__}, torch {torch.__version__}; data "
      f"{DATA.relative_to(KIT_ROOT)}; {os.cpu_count()} cores")

# %% [markdown]
# ## Hyperparameters are not parameters
#
# Training finds the weights $w$ that minimise the training loss $L_\text{train}(w;\theta)$ for
# fixed **hyperparameters** $\theta$: the learning rate, the warm-up, the weight decay, the batch
# size, the depth of the model. Gradients reach $w$; they do not reach $\theta$. What we want of
# $\theta$ is a low validation loss after training,
#
# $$f(\theta) = L_\text{val}\big(w^*(\theta)\big), \qquad w^*(\theta) = \text{the weights a
# training run with } \theta \text{ ends with.}$$
#
# As a function, $f$ is a **black box**:
#
# - **no gradient.** Between $\theta$ and $f(\theta)$ lies a whole training run: thousands of
#   steps, data order, clipping. Some hyperparameters are discrete (the number of layers, the
#   batch size, the optimiser), where a derivative means nothing;
# - **noisy.** Another seed, another data order or a non-deterministic GPU kernel changes
#   $f(\theta)$ a little: two settings closer than that noise cannot be told apart;
# - **expensive.** One evaluation is one training run: minutes on a laptop, days on a hundred
#   GPUs.
#
# So hyperparameter optimisation (HPO) is the optimisation of an expensive, noisy function from
# samples, and the three questions of this lesson follow: *where to evaluate next* (a
# **sampler**: grid, random, Bayesian), *when to give up on a run early* (a **pruner**), and
# *how to evaluate many at once* (**workers** that share a **study**). In Optuna's words, a
# study is a series of **trials**; each trial is one training run with the hyperparameters the
# sampler proposes, and its *value* is the validation loss.
#
# The driver of this lesson, `solutions/hpo_optuna.py`, searches around the preset's own recipe:

# %%
tiny = presets.get_preset("tiny")


def describe_distribution(distribution):
    """One line for an Optuna distribution: its kind and range."""
    if isinstance(distribution, optuna.distributions.CategoricalDistribution):
        return f"one of {distribution.choices}"
    kind = ("integer" if isinstance(distribution, optuna.distributions.IntDistribution)
            else "real")
    return (f"{kind} in [{distribution.low:g}, {distribution.high:g}]"
            + (", sampled on a log scale" if distribution.log else ""))


space = hpo_optuna.search_space(tiny, max_steps=tiny.max_steps,
                                batch_unit=tiny.micro_batch * tiny.seq_len)
for name, distribution in space.items():
    print(f"{name:13s} tiny's recipe: {getattr(tiny, name):<8g} searched: "
          f"{describe_distribution(distribution)}")

# %% [markdown]
# The learning rate is searched on a *log scale*: $10^{-4}$ and $10^{-3}$ differ as much as
# $10^{-3}$ and $10^{-2}$, and a uniform draw between $3\cdot10^{-4}$ and $3\cdot10^{-2}$ would
# put nine trials in ten above $3\cdot10^{-3}$. The batch size and the depth are
# **categorical**: a few values, no order the sampler needs to know.
#
# ## Grid search or random search?
#
# A **grid** tries every combination of a few values per hyperparameter; **random search** draws
# every hyperparameter independently. With the same number of trials, which is better? Bergstra
# and Bengio (2012) noticed that in most problems only a few hyperparameters matter much, and
# which ones is not known in advance. A 3 x 3 grid of 9 trials then tries only *3 distinct
# values* of the one that matters; 9 random trials try *9*.
#
# A cheap stand-in for a validation loss with two hyperparameters, $x$ that matters and $y$ that
# hardly does:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *A grid is more thorough than random search.* With few hyperparameters that matter, a
# grid tries few values of each.
# :::

# %%
def toy_loss(x, y):
    """x matters (the best value is 0.62); y changes the loss by at most 0.02."""
    return 4 * (x - 0.62) ** 2 + 0.02 * np.sin(3 * np.pi * y) ** 2


# 3 values per dimension, spread evenly over [0, 1]
GRID_VALUES = np.array([1, 3, 5]) / 6
grid_points = np.array([(x, y) for x in GRID_VALUES for y in GRID_VALUES])
random_points = np.random.default_rng(0).uniform(0, 1, size=(9, 2))

xs = np.linspace(0, 1, 201)
fig, (square, profile) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
contours = square.contourf(xs, xs, toy_loss(xs[None, :], xs[:, None]), levels=20,
                           cmap="viridis")
fig.colorbar(contours, ax=square, label="loss")
square.plot(*grid_points.T, "ws", markersize=9, markeredgecolor="k", label="3 x 3 grid")
square.plot(*random_points.T, "o", color="tab:orange", markeredgecolor="k",
            label="9 random")
square.set(xlabel="x (matters)", ylabel="y (hardly matters)", title="the trials")
square.legend(loc="upper left")
profile.plot(xs, toy_loss(xs, 0.0), "k-", label="loss along x (y = 0)")
for values, style, label in ((GRID_VALUES, "s", "grid"),
                             (random_points[:, 0], "o", "random")):
    profile.plot(values, toy_loss(values, 0.0), style, markersize=8,
                 label=f"x values the {label} tried")
profile.set(xlabel="x", ylabel="loss",
            title="what each tried of the dimension that matters")
profile.legend()
plt.show()

grid_best = toy_loss(*grid_points.T).min()
random_best = toy_loss(*random_points.T).min()
print(f"best of the grid: {grid_best:.4f} ({len(set(grid_points[:, 0]))} distinct x); "
      f"best of 9 random trials: {random_best:.4f} "
      f"({len(set(random_points[:, 0]))} distinct x)")
repeats = toy_loss(*np.random.default_rng(1).uniform(0, 1, size=(2, 1000, 9))).min(
    axis=1)
print(f"over 1,000 draws of 9 random trials, random search beats the grid "
      f"{np.mean(repeats < grid_best):.0%} of the time")

# %% [markdown]
# The grid wastes 6 of its 9 trials re-testing the same three $x$ values with different $y$,
# which hardly matters. With more hyperparameters it gets worse: a grid of 3 values for each of
# 5 hyperparameters is $3^5 = 243$ trials. Random search costs what you decide (stop it at any
# trial), its trials are independent (any number of workers), and each new trial adds a new
# value of *every* hyperparameter. Grids are fine for one or two hyperparameters you want to
# map completely (`--sampler grid` in the driver); otherwise sample.
#
# ## Bayesian optimisation: a model of the objective
#
# Random search ignores what it has learnt. **Bayesian optimisation** fits a cheap statistical
# model, the **surrogate**, to the trials so far, and evaluates the expensive function where the
# model says it is most worth it. Two ingredients:
#
# - a **Gaussian process** (GP): a distribution over smooth functions. Conditioned on the
#   observations it gives, at every $x$, a mean $\mu(x)$ (the best guess) and a standard
#   deviation $\sigma(x)$ (how unsure it is: zero at an observation, large far from them);
# - an **acquisition function** that weighs a low mean against a large uncertainty. The
#   **expected improvement** over the best value so far, $f^*$, averages how far below $f^*$ the
#   loss at $x$ might be, over the model's belief about it,
#   $F(x) \sim \mathcal{N}(\mu(x), \sigma(x)^2)$. With $z = (f^* - \mu(x))/\sigma(x)$, and
#   $\Phi$ and $\varphi$ the standard normal's CDF and density:
#
# $$\text{EI}(x) = \mathbb{E}\big[\max(f^* - F(x), 0)\big]
#   = (f^* - \mu(x))\,\Phi(z) + \sigma(x)\,\varphi(z).$$
#
# The first term rewards a mean below the best (**exploitation**), the second an uncertainty
# (**exploration**). The next trial is the $x$ of largest EI.
#
# A 1-D stand-in: the validation loss against $u = \log_{10}(\text{learning rate})$: too small
# and training crawls, too large and it blows up, with some bumps in between.

# %%
def val_loss_1d(u):
    """A stand-in validation loss against u = log10(learning rate), for u in
    [-4, -1]."""
    u = np.asarray(u, dtype=float)
    return (3.0 + 0.35 * (u + 2.3) ** 2 + 0.25 * np.sin(5 * u)
            + 0.5 * np.exp(3 * (u + 1.3)))


U = np.linspace(-4, -1, 301)  # where the surrogate and EI are evaluated: cheap
BEST_1D = val_loss_1d(U).min()
normal_cdf = np.vectorize(lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2))))


def normal_pdf(z):
    return np.exp(-z**2 / 2) / math.sqrt(2 * math.pi)


def fit_surrogate(u, f):
    """A GP fitted to the observations: a Matérn kernel (smooth, not too smooth) times
    a scale, its length scale fitted to the data; normalize_y centres the losses."""
    kernel = ConstantKernel(1.0, (1e-2, 1e2)) * Matern(length_scale=0.5,
                                                       length_scale_bounds=(0.05, 5),
                                                       nu=2.5)
    gp = GaussianProcessRegressor(kernel, alpha=1e-6, normalize_y=True,
                                  n_restarts_optimizer=2, random_state=0)
    # a length scale at its bound, with 3 points, is expected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return gp.fit(np.reshape(u, (-1, 1)), f)


def expected_improvement(mean, std, best):
    """EI for minimisation, from the formula above; zero where the GP is certain."""
    std = np.maximum(std, 1e-12)
    z = (best - mean) / std
    return (best - mean) * normal_cdf(z) + std * normal_pdf(z)


observed_u = [-3.5, -2.0, -1.2]  # three first trials, spread out
observed_f = list(val_loss_1d(observed_u))
fig, axes = plt.subplots(2, 4, figsize=(13, 5), sharex=True, height_ratios=[2, 1],
                         layout="constrained")
for iteration in range(4):
    gp = fit_surrogate(observed_u, observed_f)
    mean, std = gp.predict(U.reshape(-1, 1), return_std=True)
    ei = expected_improvement(mean, std, min(observed_f))
    proposal = U[ei.argmax()]
    top, bottom = axes[:, iteration]
    top.plot(U, val_loss_1d(U), "k:", label="true (unknown)")
    top.plot(U, mean, "tab:blue", label="GP mean")
    top.fill_between(U, mean - 2 * std, mean + 2 * std, color="tab:blue", alpha=0.2,
                     label="mean ± 2 std")
    top.plot(observed_u, observed_f, "ko", label="trials")
    top.axvline(proposal, color="tab:red")
    top.set(title=f"{len(observed_u)} trials", ylim=(2.5, 6.5))
    bottom.plot(U, ei, "tab:red")
    bottom.set_xlabel("log10(learning rate)")
    print(f"after {len(observed_u)} trials: expected improvement picks "
          f"log10(lr) = {proposal:.2f} "
          f"(loss {val_loss_1d(proposal):.3f}; best so far {min(observed_f):.3f})")
    observed_u.append(proposal)
    observed_f.append(float(val_loss_1d(proposal)))
axes[0, 0].legend(fontsize=8)
axes[0, 0].set_ylabel("loss")
axes[1, 0].set_ylabel("EI")
plt.show()
print(f"best after {len(observed_u)} trials: {min(observed_f):.3f}; "
      f"the true minimum: {BEST_1D:.3f}")

# %% [markdown]
# Where the GP is sure (near a trial) EI is near zero; it peaks where the mean is low *and* the
# uncertainty is large, and after a few trials it zooms in on the best basin. GPs shine with a
# few, continuous hyperparameters and tens of trials. Their cost grows as the cube of the number
# of trials, and discrete or conditional choices (the number of layers; a dropout only if
# dropout is on) fit them badly.
#
# ### TPE: model the good and the bad, not the loss
#
# Optuna's default sampler, the **Tree-structured Parzen Estimator** (TPE, Bergstra et al. 2011),
# turns the question around. Sort the trials so far by loss and split them at a quantile
# $\gamma$ (say the best 25%): *good* and *bad*. Estimate the density of each group over the
# hyperparameters: $l(x)$ for the good trials, $g(x)$ for the bad ones (Parzen estimators: a
# small Gaussian bump on every trial). Then propose the $x$ where $l(x)/g(x)$ is largest: likely
# under the good, unlikely under the bad. Maximising that ratio is the same as maximising the
# expected improvement under TPE's model. Densities are cheap, one per hyperparameter (or one
# joint, `multivariate=True`), and a categorical hyperparameter just gets a histogram.
#
# By hand, from 20 random trials of the same function:

# %%
def parzen_density(points, at, bandwidth=0.25):
    """The average of one Gaussian bump per point: a smooth density of where the points
    are."""
    bumps = np.exp(-0.5 * ((at[:, None] - points[None, :]) / bandwidth) ** 2)
    return bumps.mean(axis=1) / (bandwidth * math.sqrt(2 * math.pi))


trials_u = np.random.default_rng(3).uniform(-4, -1, 20)
trials_f = val_loss_1d(trials_u)
GAMMA = 0.25
n_good = math.ceil(GAMMA * len(trials_u))
order = np.argsort(trials_f)
good, bad = trials_u[order[:n_good]], trials_u[order[n_good:]]
l_density, g_density = parzen_density(good, U), parzen_density(bad, U)
ratio = l_density / g_density
tpe_proposal = U[ratio.argmax()]

fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True,
                                  layout="constrained")
top.plot(U, val_loss_1d(U), "k:", label="true loss")
top.plot(good, val_loss_1d(good), "o", color="tab:green",
         label=f"good: best {GAMMA:.0%}")
top.plot(bad, val_loss_1d(bad), "o", color="tab:gray", label="bad: the rest")
top.set_ylabel("loss")
top.legend()
bottom.plot(U, l_density, color="tab:green", label="l(x): density of the good")
bottom.plot(U, g_density, color="tab:gray", label="g(x): density of the bad")
twin = bottom.twinx()
twin.plot(U, ratio, color="tab:red", label="l(x) / g(x)")
twin.axvline(tpe_proposal, color="tab:red", linestyle="--")
twin.set_ylabel("l / g", color="tab:red")
bottom.set(xlabel="log10(learning rate)", ylabel="density")
bottom.legend(loc="upper left")
plt.show()
print(f"{n_good} good and {len(bad)} bad trials; l/g is largest at log10(lr) = "
      f"{tpe_proposal:.2f} (loss {val_loss_1d(tpe_proposal):.3f}, best trial so far "
      f"{trials_f.min():.3f})")

# %% [markdown]
# Optuna's `TPESampler` draws a couple of dozen candidates from $l(x)$ and keeps the one with
# the largest ratio, and its first `n_startup_trials` (10) trials are random, to have something
# to split. Compare it with random search on the same function, over 20 seeds of 30 trials
# each, by the gap between the best loss found so far and the true minimum:

# %%
def best_so_far_gaps(make_sampler, seeds=range(20), n_trials=30):
    """For each seed, an in-memory study of val_loss_1d: the gap to the minimum after
    each trial."""
    gaps = []
    for seed in seeds:
        study = optuna.create_study(sampler=make_sampler(seed))
        study.optimize(
            lambda trial: float(val_loss_1d(trial.suggest_float("log_lr", -4, -1))),
            n_trials=n_trials)
        gaps.append(np.minimum.accumulate([t.value for t in study.trials]) - BEST_1D)
    return np.array(gaps)


samplers = {"random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
            "TPE": lambda seed: optuna.samplers.TPESampler(seed=seed)}
gaps = {name: best_so_far_gaps(make) for name, make in samplers.items()}
fig, ax = plt.subplots(figsize=(7, 3.5), layout="constrained")
trial_numbers = np.arange(1, 31)
for name, gap in gaps.items():
    low, median, high = np.percentile(gap, [25, 50, 75], axis=0)
    ax.plot(trial_numbers, median, label=f"{name}: median of 20 seeds")
    ax.fill_between(trial_numbers, low, high, alpha=0.2)
ax.axvline(10.5, color="grey", linestyle=":", label="TPE's random start-up ends")
ax.set(yscale="log", xlabel="trials", ylabel="best so far - true minimum")
ax.legend()
plt.show()
for n in (10, 20, 30):
    tpe_median, random_median = (np.median(gaps[name][:, n - 1])
                                 for name in ("TPE", "random"))
    print(f"after {n} trials: median gap TPE {tpe_median:.4f}, "
          f"random {random_median:.4f}; TPE "
          f"better for {np.mean(gaps['TPE'][:, n - 1] < gaps['random'][:, n - 1]):.0%} "
          f"of seeds")

# %% [markdown]
# For its first 10 trials TPE *is* random search (the same draws, with the same seed); after
# that it concentrates its trials where the good ones are. On a real study the gain is larger,
# because each trial costs a training run, and smaller, because the loss is noisy: a study of
# 5 trials, like ours below, never leaves TPE's random start-up. Plan studies of 50 to a few
# hundred trials, and make them affordable with the next idea.
#
# ## Stopping bad trials early: successive halving, Hyperband, ASHA
#
# Most trials are bad, and a bad learning curve often looks bad early. A **pruner** stops such a
# trial and gives its compute to others. The budget (the **resource**) is what a trial has
# spent: optimiser steps, tokens, epochs.
#
# **Successive halving** (SH; Jamieson and Talwalkar 2016):
# 1. start $n$ configurations with a small budget $r$ (the first **rung**);
# 2. keep the best $1/\eta$ of them ($\eta$, the **reduction factor**, is often 3), and give the
#    survivors $\eta$ times the budget (the next rung);
# 3. repeat until one configuration is left or the budget reaches the maximum $R$.
#
# With $n = 27$, $r = 1$, $\eta = 3$, $R = 27$: 27 runs of 1 step, 9 of 3, 3 of 9, 1 of 27: 108
# steps for 27 configurations, against $27 \times 27 = 729$ to train them all to the end. Each
# rung costs about the same ($n r$), and there are $\log_\eta(R/r) + 1$ of them.
#
# The risk is in step 2: a ranking after a short budget is not the ranking at the end. A large
# learning rate falls fastest at first and may end worse. Synthetic learning curves with that
# behaviour:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# - *Early stopping compares trials at different budgets.* Trials are compared only at
#   the same rung.
# - Say here: pruning as the biggest saving.
# :::

# %%
def learning_curve(lr, steps):
    """A synthetic validation loss after `steps` steps at learning rate lr. It starts
    at ln(50257) = 10.8, a uniform guess over GPT-2's vocabulary; a larger rate falls
    faster; the lowest final loss is at lr = 3e-3."""
    final = 3.0 + 1.5 * math.log10(lr / 3e-3) ** 2
    # steps to fall halfway to the final loss: fewer at a larger lr
    halfway = (3e-3 / lr) ** 0.3
    return final + (10.8 - final) / (1 + steps / halfway)


# 27 learning rates, log-uniform in [1e-4, 1e-1]
CANDIDATE_LRS = sorted(float(f"{lr:.3g}")
                       for lr in 10 ** np.random.default_rng(7).uniform(-4, -1, 27))
print(f"27 learning rates from {CANDIDATE_LRS[0]:g} to {CANDIDATE_LRS[-1]:g}")
for steps in (1, 9, 81):
    ranked = sorted(CANDIDATE_LRS, key=lambda lr: learning_curve(lr, steps))
    print(f"the best 3 after {steps:2d} steps: "
          + ", ".join(f"{lr:g}" for lr in ranked[:3]))

# %% [markdown]
# **Exercise 1.** Write `successive_halving(configs, evaluate, min_budget, eta, max_budget)`.
# `configs` is a list of hashable configurations; `evaluate(config, budget)` trains one for
# `budget` steps and returns its loss (lower is better). Evaluate every configuration at
# `min_budget`; then, while more than one configuration is left and the budget is below
# `max_budget`, keep the `max(1, len(rung) // eta)` configurations with the lowest losses (ties:
# the earlier one in the rung) and evaluate them at `min(budget * eta, max_budget)`. Call
# `evaluate` exactly once per configuration and rung. Return `(best, history)`: `best` is the
# configuration with the lowest loss in the last rung; `history` has one `(budget, losses)` pair
# per rung, `losses` a dictionary `{config: loss}` of the configurations evaluated there, in the
# order they were evaluated.

# %% nbgrader={"grade": false, "grade_id": "successive_halving", "locked": false, "schema_version": 3, "solution": true, "task": false}
def successive_halving(configs, evaluate, min_budget, eta, max_budget):
    ### BEGIN SOLUTION
    survivors, budget, history = list(configs), min_budget, []
    while True:
        losses = {config: evaluate(config, budget) for config in survivors}
        history.append((budget, losses))
        if len(survivors) == 1 or budget >= max_budget:
            break
        survivors = sorted(survivors, key=losses.get)[:max(1, len(survivors) // eta)]
        budget = min(budget * eta, max_budget)
    last = history[-1][1]
    return min(last, key=last.get), history
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "successive_halving_tests", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
best, history = successive_halving(CANDIDATE_LRS, learning_curve, 3, 3, 81)
assert [budget for budget, _ in history] == [3, 9, 27, 81]
assert [len(losses) for _, losses in history] == [27, 9, 3, 1]
# every configuration, in order, at the first rung
assert list(history[0][1]) == CANDIDATE_LRS
assert all(loss == learning_curve(lr, budget) for budget, losses in history
           for lr, loss in losses.items())
assert best in history[-1][1] and set(history[1][1]) <= set(CANDIDATE_LRS)
assert successive_halving([3, 1, 2], lambda c, b: c + 1 / b, 1, 2, 4)[0] == 1
### BEGIN HIDDEN TESTS
calls = []


def counted(config, budget):
    calls.append((config, budget))
    return config / 10 + 1 / budget


best, history = successive_halving(list(range(10, 0, -1)), counted, 2, 2, 10)
assert (best == 1 and [b for b, _ in history] == [2, 4, 8, 10]
        and len(calls) == 10 + 5 + 2 + 1)
assert [len(losses) for _, losses in history] == [10, 5, 2, 1]
assert set(history[1][1]) == {1, 2, 3, 4, 5}  # the best 10 // 2
calls.clear()
best, history = successive_halving(list(range(27)), counted, 4, 3, 20)
assert ([b for b, _ in history] == [4, 12, 20]
        and [len(l) for _, l in history] == [27, 9, 3])
assert best == 0 and len(calls) == 39
# crossing curves: SH keeps the fast starter, and drops "slow", which would end lower
# (4 + 8/8)
crossing = {"fast": (5.0, 1.0), "slow": (4.0, 8.0), "bad": (9.0, 9.0)}
best, history = successive_halving(list(crossing),
                                   lambda c, b: crossing[c][0] + crossing[c][1] / b,
                                   1, 2, 8)
assert best == "fast" and ([list(l) for _, l in history]
                           == [["fast", "slow", "bad"], ["fast"]])
best, history = successive_halving(["a", "b", "c", "d"], lambda c, b: 1.0, 1, 2, 4)
# ties keep the earlier configuration
assert list(history[1][1]) == ["a", "b"] and best == "a"
assert (successive_halving(["only"], lambda c, b: 2.0, 1, 3, 9)
        == ("only", [(1, {"only": 2.0})]))
_, history = successive_halving(["a", "b"],
                                lambda c, b: {"a": 1.0, "b": 2.0}[c], 1, 3, 9)
# 2 // 3 keeps one
assert [(b, list(l)) for b, l in history] == [(1, ["a", "b"]), (3, ["a"])]
### END HIDDEN TESTS

# %% [markdown]
# The rungs of the 27 learning rates, over their (synthetic) learning curves:

# %% tags=["demo"]
best, history = successive_halving(CANDIDATE_LRS, learning_curve, 3, 3, 81)
fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
steps = np.arange(1, 82)
for lr in CANDIDATE_LRS:
    ax.plot(steps, [learning_curve(lr, s) for s in steps], color="lightgrey",
            linewidth=1)
for rung, (budget, losses) in enumerate(history):
    ax.plot([budget] * len(losses), list(losses.values()), "o", label=f"rung {rung}: "
            f"{len(losses)} x {budget} steps")
ax.plot(steps, [learning_curve(best, s) for s in steps], "k",
        label=f"the survivor, lr {best:g}")
ax.set(xscale="log", xlabel="steps (the budget)", ylabel="validation loss (synthetic)",
       ylim=(2.5, 11))
ax.legend(fontsize=8)
plt.show()
final = {lr: learning_curve(lr, 81) for lr in CANDIDATE_LRS}
truly_best = min(final, key=final.get)
spent = sum(budget * len(losses) for budget, losses in history)
print(f"successive halving: lr {best:g}, final loss {final[best]:.3f}, "
      f"for {spent} steps; "
      f"training all 27 to the end: lr {truly_best:g}, "
      f"final loss {final[truly_best]:.3f}, "
      f"for {27 * 81} steps")
print(f"rank of the survivor among the 27 at the end: "
      f"{sorted(final, key=final.get).index(best) + 1}")

# %% [markdown]
# A seventh of the compute finds a configuration close to the best one, though not always the
# best one: the first rung, three steps long, keeps the 9 fastest starters, and those lean towards
# large learning rates. Start the first rung too early and the fastest starters win outright.
#
# **Hyperband** (Li et al. 2018) hedges that bet. It runs several SH **brackets** with the same
# maximum budget $R$ and reduction factor $\eta$, from aggressive (many configurations, a tiny
# first budget) to cautious (few configurations, all trained to $R$: plain random search). With
# $s_\text{max} = \lfloor \log_\eta(R/r) \rfloor$, bracket $s = s_\text{max}, \dots, 0$ starts
#
# $$n_s = \left\lceil \frac{s_\text{max} + 1}{s + 1}\, \eta^s \right\rceil \text{ configurations
# at budget } r_s = R\,\eta^{-s},$$
#
# so that every bracket costs about the same: $(s_\text{max}+1)\,R$. For $R = 81$, $r = 1$,
# $\eta = 3$ (the paper's example) that is 5 brackets: 81 configurations at 1 step, 34 at 3, 15 at
# 9, 8 at 27, and 5 at 81.
#
# **Exercise 2.** Write `hyperband_brackets(min_resource, max_resource, eta)`: the list of
# `(n_configs, budget)` pairs, one per bracket, from $s = s_\text{max}$ down to $0$, with
# `n_configs` an `int` and `budget` $= R\,\eta^{-s}$.

# %% nbgrader={"grade": false, "grade_id": "hyperband_brackets", "locked": false, "schema_version": 3, "solution": true, "task": false}
def hyperband_brackets(min_resource, max_resource, eta):
    ### BEGIN SOLUTION
    # the largest s with min_resource * eta**s <= max_resource, in exact arithmetic
    s_max = 0
    while min_resource * eta ** (s_max + 1) <= max_resource:
        s_max += 1
    return [(math.ceil((s_max + 1) * eta**s / (s + 1)), max_resource / eta**s)
            for s in range(s_max, -1, -1)]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "hyperband_brackets_tests", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
paper = hyperband_brackets(1, 81, 3)
assert [n for n, _ in paper] == [81, 34, 15, 8, 5]
assert all(math.isclose(budget, expected)
           for (_, budget), expected in zip(paper, [1, 3, 9, 27, 81]))
assert [n for n, _ in hyperband_brackets(1, 9, 3)] == [9, 5, 3]
assert all(isinstance(n, int) for n, _ in paper)
### BEGIN HIDDEN TESTS
def optuna_hyperband(min_resource, max_resource, eta):
    """Optuna's own brackets, from its private attributes: fine in a test, not in
    real code."""
    pruner = optuna.pruners.HyperbandPruner(min_resource, max_resource, eta)
    pruner._try_initialization(optuna.create_study(pruner=pruner))
    return pruner._n_brackets, pruner._trial_allocation_budgets


from coursekit import exercise

cases = [(2, 6, 3), (1, 27, 3), (2, 20, 3), (1, 100, 2), (5, 100, 4), (4, 20, 3),
         (3, 81, 3)]
optunas = {case: optuna_hyperband(*case) for case in cases}
# an answer that asks Optuna's pruner for its brackets is not the exercise
with exercise.own_work(optuna.pruners.HyperbandPruner._try_initialization):
    for case, (n_brackets, allocation) in optunas.items():
        mine = hyperband_brackets(*case)
        assert len(mine) == n_brackets, (case, mine, n_brackets)
        assert [n for n, _ in mine] == allocation, (case, mine, allocation)
    twenty = hyperband_brackets(2, 20, 3)
    assert [n for n, _ in twenty] == [9, 5, 3]
    assert all(math.isclose(b, e) for (_, b), e in zip(twenty, [20 / 9, 20 / 3, 20]))
    assert (hyperband_brackets(5, 5, 3) == [(1, 5)]
            and len(hyperband_brackets(1, 8, 2)) == 4)
### END HIDDEN TESTS

# %% [markdown]
# Optuna's `HyperbandPruner(min_resource, max_resource, reduction_factor)` makes the same
# brackets. It assigns each trial to one bracket by a hash of the trial's number, in proportion
# to $n_s$, and runs SH within each bracket with rungs at $r\,\eta^k$ steps. The study below uses
# `min_resource=2` (its validation interval), `max_resource=6`, $\eta = 3$:

# %% tags=["demo"]
for case in [(2, 6, 3), (1, 81, 3), (1, 243, 3)]:
    pruner = optuna.pruners.HyperbandPruner(*case)
    # private: a look inside
    pruner._try_initialization(optuna.create_study(pruner=pruner))
    print(f"min, max, eta = {case}: brackets {hyperband_brackets(*case)}; Optuna makes "
          f"{pruner._n_brackets} brackets")
print(f"math.log(243, 3) = {math.log(243, 3)!r}")

# %% [markdown]
# The last line is why the cases differ at $R/r = 243 = 3^5$: Optuna computes
# $s_\text{max}$ with a floating-point logarithm, and $\log_3 243$ comes out a hair below 5, so it
# makes one bracket fewer. Harmless, but a reminder to count powers with integers.
#
# **ASHA** (asynchronous successive halving, Li et al. 2020) is what makes SH work with parallel
# workers. Plain SH waits for a whole rung to finish before it promotes anyone: workers idle
# while the slowest trial of the rung finishes. ASHA never waits. Whenever a trial reaches a rung,
# it is promoted if it is in the top $1/\eta$ of the trials that have reached that rung *so far*;
# otherwise it stops. Early on a rung has few results, so promotion is generous (Optuna promotes
# the first trials of a rung only if they are the best so far there); with time the rungs fill
# and the bar rises. Optuna's `SuccessiveHalvingPruner` is ASHA, and `HyperbandPruner` runs one
# ASHA per bracket: every worker asks "should I stop?" at every report (`trial.should_prune()`)
# and gets an answer at once from the shared storage.
#
# *End of part 1. Part 2, many workers on one study, larger batches, and the real study on a
# cluster, can follow after a break or in the next session.*
#
# ## Many workers, one study
#
# A study runs faster with $W$ workers training trials side by side, each asking the study for
# its next trial. With a model-based sampler there is a trap: workers that ask at the same time
# see the same finished trials, fit the same model and, with the same seed, propose the *same
# configuration*. Even with different seeds they crowd into the same promising spot, because
# the trials still running are invisible to the model.
#
# Two remedies, both in `hpo_optuna.py`: a *seed per worker* (`seed + worker`: different random
# draws), and the **constant liar** (`TPESampler(constant_liar=True)`): a running trial counts as
# if it had the worst loss, so the next worker's model avoids its neighbourhood until the real
# value arrives. Four workers asking at once, after 12 finished trials of the 1-D function:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *More workers find the best configuration proportionally faster.* Parallel proposals
# repeat each other unless the sampler accounts for running trials (the constant liar).
# :::

# %% tags=["demo"]
LOG_LR = {"log_lr": optuna.distributions.FloatDistribution(-4, -1)}
finished_u = np.random.default_rng(0).uniform(-4, -1, 12)


def four_workers_ask(seeds, constant_liar):
    """12 finished trials in a shared storage; then 4 workers, each its own TPE sampler,
    ask for a trial before anyone reports: the log10(lr) each is given."""
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(study_name="shared", storage=storage)
    for u in finished_u:
        study.add_trial(optuna.trial.create_trial(params={"log_lr": u},
                                                  distributions=LOG_LR,
                                                  value=float(val_loss_1d(u))))
    proposals = []
    # each worker loads the study with its own sampler, as a process would
    for seed in seeds:
        worker = optuna.load_study(study_name="shared", storage=storage,
                                   sampler=optuna.samplers
                                   .TPESampler(seed=seed, constant_liar=constant_liar))
        proposals.append(worker.ask(LOG_LR).params["log_lr"])  # running: not told yet
    return np.array(proposals)


for label, seeds, liar in (("the same seed", [0, 0, 0, 0], False),
                           ("a seed per worker", [0, 1, 2, 3], False),
                           ("a seed per worker + constant liar", [0, 1, 2, 3], True)):
    proposals = four_workers_ask(seeds, liar)
    closest = np.diff(np.sort(proposals)).min()
    print(f"{label:34s} log10(lr): " + ", ".join(f"{u:6.3f}" for u in proposals)
          + f" | closest pair {closest:.3f} apart")

# %% [markdown]
# With one seed, four GPUs train the same configuration four times. A seed per worker spreads
# them by a hair; the constant liar spreads them over the promising region. The cost of the lie
# is small: it lasts only while the trial runs.
#
# The workers also need a *shared storage* for the study. Optuna offers a database
# (`sqlite:///file.db` for a few processes, PostgreSQL or MySQL for many) or a **journal file**:
# every change to the study is one line appended under a file lock. A journal needs no server,
# and works on the shared parallel file systems of clusters (NFS, Lustre, GPFS), where SQLite's
# locking is unreliable; `hpo_optuna.py` uses `STUDY_DIR/journal.log` unless you pass
# `--storage`. The study lives in the file, not in any process: a worker that dies, or a job that
# ends, loses nothing but its running trial, and the next one picks up the study where it was.

# %% [markdown]
# ## Larger batches: learning rate and warm-up
#
# A study tunes the learning rate for one batch size. Then you scale out: $N$ GPUs with
# the same microbatch make the global batch $N$ times larger, and the same number of tokens takes
# $N$ times fewer optimiser steps. Each step has a less noisy gradient, but there are fewer of
# them, so at the same learning rate the run learns less per token. Lesson 02 met the rules:
#
# - the **linear scaling rule** (Goyal et al. 2017, for SGD): multiply the learning rate by $k$
#   when the batch grows by $k$; $k$ steps of size $\eta$ on $k$ small batches move the weights
#   about as far as one step of size $k\eta$ on their union;
# - the **square-root rule**, $\sqrt{k}$, the usual starting point for Adam, whose updates are
#   already normalised by the gradients' size: the gradient's noise, not its size, shrinks with
#   $\sqrt{k}$;
# - **warm-up**: a $k$ times larger learning rate applied to random weights makes the first steps
#   blow up; ramping it up linearly over the first steps lets the weights settle first. Goyal et
#   al. keep the warm-up fixed in *epochs*, GPT-3 in *tokens* (375 million): the same data, hence
#   $k$ times fewer steps when the batch is $k$ times larger.
#
# Neither rule holds forever: past a **critical batch size** a larger batch no longer buys a
# better step, and the learning rate stops scaling. Measure on your model, small, before a large
# run, as below.
#
# In code, with the warm-up kept in tokens (rounded up to whole steps: a warm-up is never
# shorter than asked), for the measurement below:

# %%
def scale_recipe(base_lr, base_batch, batch, warmup_tokens, rule):
    """(peak learning rate, warm-up steps) at a global batch of ``batch`` tokens, scaled
    from ``base_lr`` at ``base_batch`` by ``rule``, "linear" or "sqrt"."""
    factors = {"linear": batch / base_batch, "sqrt": (batch / base_batch) ** 0.5}
    if rule not in factors:
        raise ValueError(f"rule {rule!r}: use 'linear' or 'sqrt'")
    return base_lr * factors[rule], math.ceil(warmup_tokens / batch)


# %% [markdown]
# Now the measurement, on the tiny GPT: 3,072 tokens of training at a small global batch of 64
# tokens (2 samples of 32: 48 steps) and at a batch 8 times larger, 512 tokens (6 steps), as 8
# GPUs with the same microbatch would make it. The small batch trains at `BASE_LR` with a
# warm-up of 1,024 tokens; the large one at the same learning rate, at the square-root-scaled
# and the linearly scaled one with the same warm-up in tokens, and at the linearly scaled one
# without warm-up. All start from the same weights and see the same tokens in the same order.
#
# Each configuration is a few dozen steps: starting a Python process with PyTorch would cost
# more than the training, so this section trains in the notebook, with the std stage's own
# model, optimiser (AdamW), schedule (linear warm-up, cosine decay to 10%) and clipping, imported
# from `solutions/train_gpt2_std.py` as lesson 06 does to profile it. The large batch goes
# through in one forward pass; on 8 GPUs each would take 64 tokens of it, and the averaged
# gradient would be the same. One thread is enough: the study's two trainers are using the
# other cores meanwhile, and more threads than cores only make them wait for each other.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# *A learning rate tuned at one batch size carries over.* It scales with the batch; the
# lesson's third exercise is about this.
# :::

# %% tags=["demo"]
std = stages.load("std")  # solutions/train_gpt2_std.py, imported as a module
# as the stage does on a CPU: reuse freed memory, fewer page faults
perf.keep_freed_cpu_memory()
torch.set_num_threads(1)  # the study in the background has the other cores
SEQ_LEN, TOKENS, BASE_BATCH, LARGE_BATCH = 32, 3072, 64, 512
BASE_LR, WARMUP_TOKENS = 1e-3, 1024


def train_briefly(batch_tokens, lr, warmup_steps):
    """TOKENS tokens of the std stage's training loop at this global batch, peak
    learning rate and warm-up: [(tokens seen, training loss)] for every step, and the
    final validation loss."""
    config = gpt.GPTConfig(vocab_size=tiny.vocab_size, block_size=tiny.seq_len,
                           n_layer=tiny.n_layer, n_head=tiny.n_head, n_embd=tiny.n_embd)
    # the stage's seed: the same initial weights for every recipe
    torch.manual_seed(1337)
    model = gpt.GPT(config)
    optimizer = std.configure_optimizer(model, lr, tiny.weight_decay,
                                        torch.device("cpu"))
    loader = std.TokenShardLoader(DATA, "train", batch_tokens // SEQ_LEN, SEQ_LEN)
    steps, curve = TOKENS // batch_tokens, []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = std.learning_rate(step, lr, warmup_steps, steps)
        x, y = loader.next_batch()
        loss = gpt.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tiny.grad_clip)
        optimizer.step()
        curve.append(((step + 1) * batch_tokens, loss.item()))
    val_loader = std.TokenShardLoader(DATA, "val", 16, SEQ_LEN)
    cpu = torch.device("cpu")
    return curve, std.evaluate(model, val_loader, 2, cpu,
                               training.prepare_device(cpu, "fp32"))


linear_lr, large_warmup = scale_recipe(BASE_LR, BASE_BATCH, LARGE_BATCH, WARMUP_TOKENS,
                                       "linear")
sqrt_lr, _ = scale_recipe(BASE_LR, BASE_BATCH, LARGE_BATCH, WARMUP_TOKENS, "sqrt")
recipes = {  # name: (batch tokens, peak lr, warm-up steps)
    f"batch {BASE_BATCH}, base lr": (BASE_BATCH, BASE_LR,
                                     math.ceil(WARMUP_TOKENS / BASE_BATCH)),
    f"batch {LARGE_BATCH}, same lr": (LARGE_BATCH, BASE_LR, large_warmup),
    f"batch {LARGE_BATCH}, sqrt rule": (LARGE_BATCH, sqrt_lr, large_warmup),
    f"batch {LARGE_BATCH}, linear rule": (LARGE_BATCH, linear_lr, large_warmup),
    f"batch {LARGE_BATCH}, linear rule, no warm-up": (LARGE_BATCH, linear_lr, 0),
}
started = time.perf_counter()
results = {name: train_briefly(*recipe) for name, recipe in recipes.items()}
print(f"{len(recipes)} recipes of {TOKENS:,} tokens in "
      f"{time.perf_counter() - started:.1f} s")

# %% tags=["demo"]
fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
for name, (curve, _) in results.items():
    tokens_seen, losses = np.array(curve).T
    # the small batch: average each 512 tokens, to compare
    if len(curve) > TOKENS // LARGE_BATCH:
        per_large_step = len(curve) // (TOKENS // LARGE_BATCH)
        tokens_seen = tokens_seen[per_large_step - 1::per_large_step]
        losses = losses.reshape(-1, per_large_step).mean(axis=1)
    ax.plot(tokens_seen, losses, "o-", label=name)
ax.set(xlabel="tokens seen", ylabel="training loss",
       title="the same tokens, different recipes")
ax.legend()
plt.show()
rows = ["| recipe | steps | peak lr | warm-up steps | final validation loss |",
        "|---|---|---|---|---|"]
for name, (batch_tokens, lr, warmup_steps) in recipes.items():
    rows.append(f"| {name} | {TOKENS // batch_tokens} | {lr:.2e} | {warmup_steps} | "
                f"{results[name][1]:.3f} |")
display(Markdown("\n".join(rows)))

# %% [markdown]
# At the same learning rate, the large batch is far behind at the same tokens: 6 steps instead of
# 48. The square-root rule recovers part of the gap, the linear rule all of it in this short,
# early stretch of training, where the loss falls fast and a larger step is simply more progress.
# Without warm-up, the linearly scaled rate's first steps, on random weights, cost it part of
# that. Later in training, and on larger models, the linear rule for Adam overshoots, and the
# square-root rule or a fresh small search (a study like the one below, at the new batch size)
# is the safer choice. The recipe for scaling out: measure a short run at the new batch size
# against the old one at equal tokens, before spending the allocation.
#
# **Exercise 3.** Write `choose_recipe(recipes, results, batch)`: the name of the recipe to scale
# out with at a global batch of `batch` tokens, from a measurement like the one above (`recipes`:
# name to (batch tokens, peak lr, warm-up steps); `results`: name to (curve, final validation
# loss)). Only the recipes trained at that batch are candidates, whatever their names say; a run
# whose final loss is NaN or infinite diverged and is never chosen; of the others, the lowest
# final validation loss wins (the first of equals). None if no candidate is left. The cell after
# the check applies it to this lesson's measurement.

# %% nbgrader={"grade": false, "grade_id": "choose_recipe", "locked": false, "schema_version": 3, "solution": true, "task": false}
def choose_recipe(recipes, results, batch):
    ### BEGIN SOLUTION
    candidates = [name for name, (batch_tokens, _, _) in recipes.items()
                  if batch_tokens == batch and math.isfinite(results[name][1])]
    return min(candidates, key=lambda name: results[name][1], default=None)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "choose_recipe_tests", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
measured = {"small": ([], 6.1), "large, same lr": ([], 7.4), "large, sqrt": ([], 6.6)}
settings = {"small": (64, 1e-3, 16), "large, same lr": (512, 1e-3, 2),
            "large, sqrt": (512, 2.8e-3, 2)}
assert choose_recipe(settings, measured, 512) == "large, sqrt"
assert choose_recipe(settings, measured, 64) == "small"
### BEGIN HIDDEN TESTS
OTHER_BATCH = "only the recipes trained at the batch asked for are candidates"
DIVERGED = "a run whose final loss is NaN or infinite diverged: never chosen"
# the names say nothing about the batch: the settings do
named = {"a": (512, 1e-3, 2), "b": (64, 1e-3, 16), "c": (512, 4e-3, 0)}
losses = {"a": ([], 7.0), "b": ([], 5.0), "c": ([], 6.5)}
assert choose_recipe(named, losses, 512) == "c", OTHER_BATCH
assert choose_recipe(named, {**losses, "c": ([], float("nan"))}, 512) == "a", DIVERGED
assert choose_recipe(named, {**losses, "a": ([], float("nan"))}, 512) == "c", DIVERGED
assert choose_recipe(named, {**losses, "c": ([], float("-inf"))}, 512) == "a", DIVERGED
all_diverged = {name: ([], float("inf")) for name in named}
assert choose_recipe(named, all_diverged, 512) is None, DIVERGED
assert choose_recipe(named, losses, 1024) is None, OTHER_BATCH
# the first of equals
assert choose_recipe(named, {**losses, "c": ([], 7.0)}, 512) == "a"
### END HIDDEN TESTS

# %% tags=["demo"]
chosen = choose_recipe(recipes, results, LARGE_BATCH)
print(f"at batch {LARGE_BATCH}: {chosen}, final validation loss "
      f"{results[chosen][1]:.3f}; at batch {BASE_BATCH}: "
      f"{results[f'batch {BASE_BATCH}, base lr'][1]:.3f}")
assert recipes[chosen][0] == LARGE_BATCH

# %% [markdown]
# ## The real study: tuning the GPT trainer
#
# The study started at the top of the lesson runs
#
# ```bash
# python solutions/hpo_optuna.py --preset tiny --study-dir runs/study --trials 5 --workers 2 \
#     --max-steps 6 --eval-interval 2 --train-args="--eval-steps 1" --baseline
# ```
#
# - `--trials 5 --workers 2`: 5 trials over the whole study, 2 at a time, each worker its own
#   process (an Optuna client of the journal) with its own seed; each trial gets the worker's
#   share of the cores through `OMP_NUM_THREADS` (on GPUs, of `CUDA_VISIBLE_DEVICES`);
# - each trial is a subprocess: `solutions/train_gpt2_std.py` with the sampled
#   `--lr --warmup-steps --weight-decay --batch-tokens --n-layer`, in `STUDY_DIR/trials/NNNN/`,
#   with the same seed for every trial, so that only the settings differ;
# - `--max-steps 6 --eval-interval 2`: a trial trains at most 6 steps and validates every 2; the
#   worker follows the trial's `metrics.jsonl`, reports each validation loss
#   (`trial.report(loss, step)`) and asks the pruner (`trial.should_prune()`). The default pruner
#   is `HyperbandPruner(min_resource=eval_interval, max_resource=max_steps, reduction_factor=3)`:
#   the 2 brackets computed above, rungs at 2 and 6 steps. A pruned trial gets SIGTERM: it
#   finishes its step and exits;
# - the sampler is `TPESampler(multivariate=True, constant_liar=True, seed=seed + worker)`;
# - `--baseline` first trains the preset's own recipe with the same budget, in
#   `STUDY_DIR/baseline/`: the number the study has to beat.
#
# Six-step runs are a toy budget chosen for a laptop: they reward whatever learns fastest in six
# steps. On GPUs the same command with a thousand steps per trial, a validation every hundred and
# a few dozen trials is a real study: the Slurm batch files below use such settings.

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# Say here: the budget of a study in GPU hours, before it starts.
# :::

# %% tags=["demo"]
study_job.wait()
study_output.close()
output = (RUNS / "study.out").read_text().splitlines()
if study_job.returncode != 0:
    raise RuntimeError("the study failed:\n" + "\n".join(output[-30:]))
print(f"the study took {time.perf_counter() - study_started:.0f} s "
      "(and ran while the sections above executed)")
# not the plotting warnings
results_lines = ("baseline |", "worker ", "best:", "the preset's")
print("\n".join(line for line in output
                if line.startswith(results_lines) or " trials: " in line))

# %% [markdown]
# One line per trial, in the order they ended: the worker, the trial's number and settings, how
# it ended (`complete` or `pruned`) with its last validation loss, and how long it took. The
# driver then wrote `best.json`, `trials.csv` (Optuna's `study.trials_dataframe()`) and four
# plots into the study's folder:

# %% tags=["demo"]
best_json = json.loads((STUDY / "best.json").read_text())
print(json.dumps(best_json, indent=1))
# one row per trial; params_<name>, user_attrs_<name>
trials = pd.read_csv(STUDY / "trials.csv")
rows = ["| trial | state | value | worker | seconds | lr | warm-up | weight decay "
        "| batch "
        "| layers |",
        "|---|---|---|---|---|---|---|---|---|---|"]
for _, row in trials.sort_values("number").iterrows():
    # a pruned trial has none
    value = "-" if pd.isna(row["value"]) else f"{row['value']:.4f}"
    rows.append(f"| {row['number']} | {row['state']} | {value} | "
                f"{row['user_attrs_worker']} | "
                f"{row['user_attrs_seconds']} | {row['params_lr']:.2e} | "
                f"{row['params_warmup_steps']} | {row['params_weight_decay']:.3f} | "
                f"{row['params_batch_tokens']} | {row['params_n_layer']} |")
display(Markdown("\n".join(rows)))
pruned = (trials["state"] == "PRUNED").mean()
improvement = best_json["baseline_val_loss"] - best_json["best"]["val_loss"]
print(f"{(trials['state'] == 'PRUNED').sum()} of {len(trials)} trials pruned "
      f"({pruned:.0%}); "
      f"best trial {best_json['best']['number']}: "
      f"val {best_json['best']['val_loss']:.4f}, "
      f"the preset's recipe {best_json['baseline_val_loss']:.4f} "
      f"({'better' if improvement > 0 else 'not better'} by {abs(improvement):.4f})")

# %% [markdown]
# A pruned trial's value is the last loss it reported, at the step it was stopped: not comparable
# with the complete trials' final losses, and the study's best trial is always a complete one.
# The steps the pruner saved, from each trial's own `metrics.jsonl`:

# %% tags=["demo"]
trained = {int(path.name): len([line for line
                                in (path / "metrics.jsonl").read_text().splitlines()
                                if line.strip()])
           for path in sorted((STUDY / "trials").iterdir())}
print(f"steps trained per trial: {trained}; {sum(trained.values())} of "
      f"{len(trained) * 6} steps ({sum(trained.values()) / (len(trained) * 6):.0%})")

# %% [markdown]
# A trial pruned at the first rung (step 2) trained 3 steps: the worker reads a validation loss
# only once the trainer has written it and gone on to the next step. One pruned at the last rung
# (step 6) had finished anyway: that rung only ranks it. With budgets this small the pruner saves
# little. With `--max-steps 1000 --eval-interval 100` Hyperband makes 3 brackets, with rungs at
# 100, 300 and 900 steps in the most aggressive one, and a trial pruned at the first rung costs a
# tenth of a complete one.
#
# Optuna's plots, as the driver saved them: the history (each complete trial's value, and the
# best so far), the hyperparameters' importances (fANOVA: how much of the variance of the loss
# each one explains), the intermediate values (every trial's reported losses: pruned ones stop
# early), and parallel coordinates (each complete trial a line through its settings, coloured by
# its loss):

# %% tags=["demo"]
fig, axes = plt.subplots(2, 2, figsize=(13, 9), layout="constrained")
for ax, name in zip(axes.flat, ("history", "importance", "intermediate", "parallel")):
    ax.imshow(plt.imread(STUDY / "plots" / f"{name}.png"))
    ax.set_title(f"plots/{name}.png")
    ax.axis("off")
plt.show()

# %% [markdown]
# With 5 trials, of which only the complete ones count, the importances are a rough guess
# (fANOVA fits a random forest to a handful of points), and the history is TPE's random start-up.
# The value of the exercise is the workflow, which is the same at any scale.
#
# ### Continuing a study
#
# Running the command again continues the same study: the study is in `journal.log`, and
# `--trials` counts every trial it holds. With `--trials 7` the workers would train two more,
# numbered 5 and 6, and the sampler would use all the earlier ones. A new worker, such as a
# second array task starting late, does the same. On a copy of the journal, so that the real
# study stays as it is, here is what the next worker gets:

# %% tags=["demo"]
COPY = RUNS / "study-copy"
COPY.mkdir()
shutil.copy(STUDY / "journal.log", COPY / "journal.log")
args = hpo_optuna.parse_args(["--preset", "tiny", "--data", str(DATA), "--study-dir",
                              str(COPY), "--max-steps", "6", "--eval-interval", "2"])
# the driver's own code: storage, sampler, pruner
study = hpo_optuna.open_study(args, worker=2)
worker_space = hpo_optuna.search_space(tiny, args.max_steps, args.batch_unit)
trial = study.ask(worker_space)
print(f"the study holds {len(study.trials) - 1} trials; the next worker's trial: "
      f"number "
      f"{trial.number}, {hpo_optuna.describe(trial.params)}")

# %% [markdown]
# Pre-emption uses the same mechanism. When a worker receives SIGTERM or SIGUSR1 (a job's time
# limit, or a higher-priority job taking the node), it passes SIGTERM to its trainer, which saves
# a checkpoint and exits; the worker marks the trial failed, flags it `interrupted`,
# *enqueues* the same settings with the same run directory, and stops. `study.ask()` hands out
# queued trials before sampling new ones, so the next worker, maybe hours later on another node,
# restarts the trainer with `--resume` in that directory and it continues from the checkpoint.
# On the copy:

# %% tags=["demo"]
trial.set_user_attr("run_dir", str(COPY / "trials" / f"{trial.number:04d}"))
trial.set_user_attr("interrupted", True)  # what the worker does on SIGTERM or SIGUSR1
study.tell(trial, state=optuna.trial.TrialState.FAIL)
study.enqueue_trial(trial.params, user_attrs={"run_dir": trial.user_attrs["run_dir"]})
resumed = study.ask(worker_space)
print(f"interrupted trial {trial.number} -> queued; "
      f"the next ask gives trial {resumed.number} "
      f"with the same settings: {resumed.params == trial.params}, "
      f"and the same run directory: "
      f"{resumed.user_attrs['run_dir'] == trial.user_attrs['run_dir']}")
print(f"trials that count towards --trials: {hpo_optuna.counted_trials(study)} "
      f"(the interrupted one does not)")

# %% [markdown]
# ## On a cluster: the study as a job array
#
# On a cluster every worker is a Slurm **array task**: one batch file, submitted once, runs as
# many tasks as the array has indices, each its own job with its own GPU(s), each a worker of the
# same study through the journal on the shared file system. Slurm tells each task its index in
# `SLURM_ARRAY_TASK_ID`, which the driver adds to the seed. The kit generates such batch files
# for every site, `batchfiles/<site>/batch-hpo-1n1g.sh`:

# %% tags=["demo"]
HPO_BATCH = KIT_ROOT / "batchfiles" / "generic" / "batch-hpo-1n1g.sh"
display(Markdown(f"`{HPO_BATCH.relative_to(KIT_ROOT)}`:\n\n"
                 f"```bash\n{HPO_BATCH.read_text()}```"))

# %% [markdown]
# Read it from the top:
#
# - `#SBATCH --array=0-3` makes 4 array tasks; each asks for one node's share: 1 GPU and its
#   CPUs. The tasks start whenever the scheduler finds room, and the journal does not care
#   when: a task that starts an hour late joins the study as it is then;
# - *more or fewer workers* is a flag at submission, not an edit: `sbatch --array=0-7%4 ...`
#   makes 8 tasks of which at most 4 run at once (`%4`), to leave room for others on a shared
#   cluster; more workers finish sooner, but TPE learns from fewer finished trials per proposal;
# - `--output=%x-%A_%a.out`: one output file per task (`%A` the array's job id, `%a` the index);
# - `--signal=B:USR1@180` and `--requeue`: 180 s before the time limit, Slurm sends SIGUSR1 to the
#   batch shell, which passes it to the worker; the worker stops its trial, which checkpoints and
#   is queued in the study as shown above, and the task asks to be *requeued*. Whichever task
#   next asks for a trial, the requeued one or another, resumes that run from its checkpoint.
#   Pre-emption by a higher-priority job sends the same signal, and is handled the same way.
#
# **Two levels of parallelism.** The array runs trials side by side; each trial can itself be
# data-parallel. `batch-hpo-2n<G>g.sh` gives every array task 2 nodes, and the driver starts
# each trial with `srun` + `torchrun` on both (`--nodes 2 --nproc-per-node G`: the ddp stage
# from lesson 02, one rendezvous port per trial). What differs from the single-GPU file:

# %% [markdown] tags=["instructor"]
# :::{admonition} Instructor's note
# :class: tip
# Say here: two-level parallelism (trials in parallel, each one data-parallel).
# :::

# %% tags=["demo"]
two_node = sorted((KIT_ROOT / "batchfiles" / "generic").glob("batch-hpo-2n*g.sh"))[0]
diff = difflib.unified_diff(HPO_BATCH.read_text().splitlines(),
                            two_node.read_text().splitlines(), lineterm="", n=0)
changes = [line for line in diff
           if line[:1] in "+-" and not line.startswith(("+++", "---"))]
print(f"{HPO_BATCH.name} -> {two_node.name}:\n" + "\n".join(changes))

# %% [markdown]
# Choose the split by what a trial needs: a model that trains well on 1 GPU should use many
# 1-GPU trials (more trials per hour, and the scheduler finds 1 free GPU sooner than 2 free
# nodes); a model that needs 2 nodes to fit, or whose runs take days on 1 GPU, needs multi-node
# trials. Either way, more GPUs per trial make the global batch larger, which changes the best
# learning rate: tune at the batch size you will train with, or scale as in the section above.
#
# The cell below submits the array on a cluster. It is tagged `cluster`: on a laptop, or before
# you have generated your site's batch files (`python -m coursekit batchfiles --site mysite`),
# it only prints the commands. Its laptop twin is the study above: the same driver and flags,
# with 2 local workers instead of array tasks. (The book leaves its output out: on a cluster it
# would show the builder's own jobs.)

# %% tags=["cluster", "demo", "remove-output"]
SITE = "generic"  # your site's folder in batchfiles/
# True to submit from this notebook, on a cluster, once the site's files exist
SUBMIT = False
batch_file = f"batchfiles/{SITE}/batch-hpo-1n1g.sh"
if not (KIT_ROOT / batch_file).exists():
    raise FileNotFoundError(f"{batch_file}: generate it with python -m coursekit "
                            f"batchfiles --site {SITE}")
# the study's flags, as the batch file passes them to the driver
flags = dict(re.findall(r"(--preset|--data|--study-dir) (\S+)",
                       (KIT_ROOT / batch_file).read_text()))
commands = [
    # 8 workers, 4 at a time
    ["sbatch", "--parsable", "--array=0-7%4", batch_file],
    # one line per array task: pending, running, ...
    ["squeue", "--me", "--array"],
    # + the job id
    ["sacct", "--format=JobID%20,JobName,State,Elapsed,ExitCode", "-j"]]
if SUBMIT and shutil.which("sbatch"):
    job_id = subprocess.run(commands[0], cwd=KIT_ROOT, capture_output=True, text=True,
                            check=True).stdout.strip().split(";")[0]
    print(f"submitted job array {job_id}")
    for command in (commands[1], commands[2] + [job_id]):
        print(f"$ {' '.join(command)}")
        print(subprocess.run(command, capture_output=True, text=True).stdout)
else:
    print("Not submitting (no Slurm here, or SUBMIT = False). From the kit's root:")
    for command in commands:
        print("  " + " ".join(command) + (" <job id>" if command[0] == "sacct" else ""))
    print("  python solutions/hpo_optuna.py "
          + " ".join(f"{flag} {value}" for flag, value in flags.items())
          + " --results-only")

# %% [markdown]
# `--results-only` writes `best.json`, `trials.csv` and the plots from the journal without
# training: run it on a login node while the array works, as often as you like. `scancel
# <job id>` stops the whole array, `scancel <job id>_3` one task; the study keeps everything the
# tasks finished.

# %% [markdown]
# ## Key points
#
# - Hyperparameters are not reached by gradients: the validation loss as a function of them is a
#   noisy, expensive black box, searched by a sampler, cut short by a pruner, and spread over
#   workers.
# - Random search beats a grid when a few hyperparameters matter: every trial tries a new value of
#   each; search learning rates on a log scale.
# - Bayesian optimisation fits a surrogate (a GP's mean and uncertainty) and evaluates where the
#   expected improvement is largest; TPE models the good and the bad trials' densities and
#   proposes where $l(x)/g(x)$ is largest. Both need tens of trials to beat random search.
# - Successive halving keeps the best $1/\eta$ at each rung; Hyperband runs brackets from
#   aggressive to no early stopping; ASHA promotes without waiting, which suits parallel workers
#   (Optuna's `SuccessiveHalvingPruner` and `HyperbandPruner`). Early rankings can mislead: fast
#   starters are not always the best finishers.
# - Parallel workers need different seeds and the constant liar, or they propose the same
#   configuration; a journal file on the shared file system is a study's storage without a
#   server.
# - A larger global batch means fewer steps per token: scale the learning rate (linear for SGD,
#   square root as the start for Adam), keep the warm-up fixed in tokens, and measure at equal
#   tokens before a large run.
# - `hpo_optuna.py`: trials are subprocesses of the std (or ddp) stage, followed through
#   `metrics.jsonl`; the study continues when the command runs again, and an interrupted trial is
#   queued and resumed from its checkpoint.
# - On Slurm, a job array is a set of workers (`sbatch --array=0-7%4`), each trial possibly
#   multi-node (`batch-hpo-2n<G>g.sh`); SIGUSR1 before the time limit checkpoints, queues and
#   requeues.
