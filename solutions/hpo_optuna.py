"""Tune the GPT-2 trainer's hyperparameters with Optuna: the "hpo" stage.

A study is a series of trials. Each trial trains the std stage script (one process) or the ddp
stage script (torchrun, or srun + torchrun across nodes) with the hyperparameters a sampler
proposes, and reports its validation loss as it trains, so that a pruner can stop the poor ones
early. Workers share the study through a journal file on shared disk (no database server needed),
so any number of them can run side by side, and running the command again continues the study.
A worker that dies without a word (SIGKILL, a node lost) leaves its trial running in the journal;
its heartbeat stops, and after --lease seconds another worker queues the trial again, to resume
from its checkpoint.

    python solutions/hpo_optuna.py --trials 12 --workers 2          # 2 workers on this machine
    python solutions/hpo_optuna.py --trials 12 --nproc-per-node 2   # every trial a 2-process DDP run
    sbatch batchfiles/<site>/batch-hpo-1n1g.sh                      # Slurm array: a worker per task

That is the two levels of parallelism of HPO on a cluster: trials run side by side (workers), and
each trial may itself be a data-parallel run (processes per node x nodes).

The words of the lesson, as this script uses them:
    hyperparameter  a setting of training that gradients do not reach (learning rate, depth, ...)
    trial           one training run with one set of hyperparameters; its value: validation loss
    sampler         proposes the next trial's hyperparameters (TPE, random or grid)
    pruner          stops a trial whose intermediate validation loss is poor (successive halving)
    resource        what a trial has spent when it reports: here, optimiser steps
"""
import ctypes
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from coursekit import KIT_ROOT, KitError, faults, launch, presets, runs
from coursekit.cli import ArgumentParser, positive_float, positive_int

SOLUTIONS = Path(__file__).resolve().parent
SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("hyperband", "halving", "median", "none")


# ----------------------------------------------------------------------------------------------
# What the study tunes: ranges around the preset's own recipe
# ----------------------------------------------------------------------------------------------
def batch_choices(preset, batch_unit):
    """Half, the same and twice the preset's tokens per step, where the replicas split them evenly."""
    choices = [b for b in (preset.batch_tokens // 2, preset.batch_tokens, 2 * preset.batch_tokens)
               if b % batch_unit == 0]
    return choices or [batch_unit]


def search_space(preset, max_steps, batch_unit):
    """Each hyperparameter the trainer takes as a flag, with the values a sampler may propose."""
    return {
        "lr": FloatDistribution(preset.lr / 10, preset.lr * 10, log=True),  # scale, so log
        "warmup_steps": IntDistribution(0, max_steps // 4),
        "weight_decay": FloatDistribution(0.0, 0.3),
        "batch_tokens": CategoricalDistribution(batch_choices(preset, batch_unit)),
        "n_layer": CategoricalDistribution(sorted({max(1, preset.n_layer // 2), preset.n_layer,
                                                   preset.n_layer * 3 // 2})),  # the architecture
    }


def grid(preset, max_steps, batch_unit):
    """The grid sampler's points: 2-3 values per hyperparameter already make 48 trials."""
    return {"lr": [preset.lr / 3, preset.lr, preset.lr * 3],
            "warmup_steps": [0, max_steps // 10],
            "weight_decay": [0.0, preset.weight_decay],
            "batch_tokens": batch_choices(preset, batch_unit)[-2:],
            "n_layer": [max(1, preset.n_layer // 2), preset.n_layer]}


def default_hyperparameters(preset, max_steps, batch_unit):
    """The preset's recipe as the trainer would run it: the baseline the study has to beat."""
    return {"lr": preset.lr, "warmup_steps": min(preset.warmup_steps, max_steps // 10),
            "weight_decay": preset.weight_decay,
            "batch_tokens": preset.batch_tokens if preset.batch_tokens % batch_unit == 0
            else batch_unit, "n_layer": preset.n_layer}


# ----------------------------------------------------------------------------------------------
# The study: storage shared by every worker, a sampler, a pruner
# ----------------------------------------------------------------------------------------------
def open_storage(url, study_dir):
    """A journal file in the study's folder by default: appends under a file lock, which works on
    the parallel file systems of clusters (NFS, Lustre, GPFS) with no database server. An RDB URL
    (sqlite:///..., postgresql://...) uses a database instead."""
    if url is None:
        study_dir.mkdir(parents=True, exist_ok=True)
        backend = optuna.storages.journal.JournalFileBackend(str(study_dir / "journal.log"))
        return optuna.storages.JournalStorage(backend)
    try:
        return optuna.storages.RDBStorage(url)
    except Exception as err:  # SQLAlchemy's errors name the URL's problem; one line is enough
        raise KitError(f"--storage {url!r}: {str(err).splitlines()[0]} (use an RDB URL such as "
                       "sqlite:///runs/hpo.db, or leave it out for a journal file)") from None


def make_sampler(name, seed, preset, max_steps, batch_unit):
    if name == "tpe":  # constant liar: a running trial counts as a bad one, so parallel workers
        # do not all propose the same promising point
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.GridSampler(grid(preset, max_steps, batch_unit), seed=seed)


def make_pruner(name, eval_interval, max_steps):
    """Successive halving keeps the best 1/3 of trials at each rung (eval_interval x 3^k steps);
    Hyperband runs several such brackets with different starting budgets."""
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=eval_interval, max_resource=max_steps,
                                              reduction_factor=3)
    if name == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=eval_interval,
                                                      reduction_factor=3)
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=eval_interval)
    return optuna.pruners.NopPruner()


def open_study(args, worker):
    preset = presets.get_preset(args.preset)
    return optuna.create_study(
        study_name=args.study_name, storage=open_storage(args.storage, args.study_dir),
        direction="minimize", load_if_exists=True,
        sampler=make_sampler(args.sampler, args.seed + worker, preset, args.max_steps,
                             args.batch_unit),  # a seed per worker: different first proposals
        pruner=make_pruner(args.pruner, args.eval_interval, args.max_steps))


# ----------------------------------------------------------------------------------------------
# One trial: a training run in a subprocess, followed through its metrics.jsonl
# ----------------------------------------------------------------------------------------------
def trainer_command(args, hyperparameters, run_dir):
    """The trainer's command line: python (one process), torchrun (processes on this node), or
    srun + torchrun (one torchrun per node, rendezvous on the allocation's first host)."""
    stage = "std" if args.processes == 1 else "ddp"
    flags = ["--preset", args.preset, "--data", args.data, "--out", str(run_dir), "--resume",
             "--max-steps", str(args.max_steps), "--eval-interval", str(args.eval_interval),
             "--ckpt-interval", str(args.max_steps), "--sample-tokens", "0",
             "--micro-batch", str(args.micro_batch),
             "--seed", str(args.seed)]  # the same seed for every trial: only the settings differ
    flags += [f"--{name.replace('_', '-')}={value}" for name, value in hyperparameters.items()]
    script = [str(SOLUTIONS / f"train_gpt2_{stage}.py"), *flags, *args.train_args.split()]
    if args.nodes == 1 and args.nproc_per_node == 1:
        return [sys.executable, *script]
    if args.nodes == 1:
        return [*launch.torchrun(args.nproc_per_node), *script]
    # one torchrun per node, the rendezvous on the allocation's first host, where this worker
    # runs, at a port free there (coursekit.launch: why the static rendezvous, not c10d), by the
    # name the batch file gives it (MASTER_ADDR: the site's InfiniBand name, say) or Slurm's
    first = os.environ.get("MASTER_ADDR") or subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
        capture_output=True, text=True, check=True).stdout.split()[0]
    return ["srun", *args.srun_args.split(), f"--nodes={args.nodes}", "--ntasks-per-node=1",
            *launch.PER_NODE, *launch.torchrun(args.nproc_per_node, args.nodes, first), *script]


INTERRUPTS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Interrupt:
    """SIGTERM or SIGUSR1 (Slurm's time limit or pre-emption) or Ctrl-C: pass it on to the running
    trainer (its own process group), which checkpoints and exits; the worker stops after it."""

    def __init__(self):
        self.received, self.trainer = None, None
        for sig in INTERRUPTS:
            signal.signal(sig, self.handle)

    def handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        if self.trainer is not None and self.trainer.poll() is None:
            os.killpg(self.trainer.pid, signal.SIGTERM)


def new_validations(metrics_path, seen):
    """The (step, val_loss) pairs of metrics.jsonl after the first `seen` ones."""
    if not metrics_path.exists():
        return []
    records = runs.read_metrics(metrics_path.parent)
    return [(r["step"], r["val_loss"]) for r in records if "val_loss" in r][seen:]


def train(command, run_dir, env, interrupt, on_validation, heartbeat):
    """Run the trainer; call on_validation(step, loss) for each validation it writes, and
    heartbeat() while it runs. Returns "complete", "pruned" (on_validation returned True: the
    trainer was stopped), "interrupted" or "failed", and the last validation loss."""
    runs.make_run_dir(run_dir)
    with open(run_dir / "train.log", "ab") as log:
        trainer = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   cwd=KIT_ROOT, start_new_session=True,  # its own process group
                                   preexec_fn=stop_when_the_worker_dies)
    interrupt.trainer = trainer
    seen, last, pruned = 0, None, False
    while True:
        heartbeat()
        exited = trainer.poll() is not None  # read what it wrote before it exited, then stop
        for step, loss in new_validations(run_dir / "metrics.jsonl", seen):
            seen, last = seen + 1, loss
            if not pruned and on_validation(step, loss):
                pruned = True
                os.killpg(trainer.pid, signal.SIGTERM)  # it checkpoints and exits
        if exited:
            break
        time.sleep(0.5)
    interrupt.trainer = None
    if pruned:
        return "pruned", last
    if interrupt.received:
        return "interrupted", last
    return ("complete" if trainer.returncode == 0 else "failed"), last


def stop_when_the_worker_dies():
    """In the trainer, before it starts (Linux): SIGTERM when its worker dies, even by SIGKILL,
    so that it checkpoints and exits instead of training on in a run directory that another
    worker is about to resume."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


PR_SET_PDEATHSIG = 1  # prctl's option, from <linux/prctl.h>


def last_line(log_path):
    lines = log_path.read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else "(no output)"


def trainer_environment(args, worker):
    """Threads (CPU) or GPUs (CUDA_VISIBLE_DEVICES) of this machine shared out between the local
    workers; a Slurm task keeps what Slurm gave it."""
    env = dict(os.environ)
    if args.workers > 1 and args.gpus:
        per_trial = args.nproc_per_node
        env["CUDA_VISIBLE_DEVICES"] = ",".join(args.gpus[worker * per_trial:(worker + 1) * per_trial])
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0))
        env["OMP_NUM_THREADS"] = str(max(1, cores // (args.workers * args.nproc_per_node)))
    return env


def describe(hyperparameters):
    h = hyperparameters
    return (f"lr {h['lr']:.1e} | warmup {h['warmup_steps']} | wd {h['weight_decay']:.2f} | "
            f"batch {h['batch_tokens']} | layers {h['n_layer']}")


# ----------------------------------------------------------------------------------------------
# A worker: ask the study for a trial, train it, tell the study how it went; until enough trials
# ----------------------------------------------------------------------------------------------
def counted_trials(study, before=None):
    """Trials that count towards --trials (those numbered below ``before``, if given): finished
    and running ones. An interrupted or lost trial does not count, nor does its copy waiting in
    the queue until a worker resumes it, nor a surplus trial."""
    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.state != TrialState.WAITING and (before is None or t.number < before)
               and not (t.state == TrialState.FAIL and (t.user_attrs.get("interrupted")
                                                        or t.user_attrs.get("surplus"))))


# A running trial's worker writes a heartbeat into the study every --lease / 4 seconds. One that
# has not for --lease seconds lost its worker (SIGKILL, the out-of-memory killer, a node that
# died): any other worker fails it and queues its settings again, to resume from its checkpoint.
# Optuna's own heartbeat needs a database; the journal file is what works on a cluster's
# parallel file system. The first worker to fail it wins: the journal orders their writes.
BEATS_PER_LEASE = 4


def heartbeat_age(trial):
    """Seconds since a running trial's worker last said it was alive."""
    return time.time() - trial.user_attrs.get("heartbeat", trial.datetime_start.timestamp())


def running(study):
    return study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))


def queue_lost_trials(study, lease, worker):
    for trial in running(study):
        age = heartbeat_age(trial)
        if age < lease:
            continue
        try:  # private: Optuna's public API changes only the trials a worker asked for itself
            study._storage.set_trial_user_attr(trial._trial_id, "interrupted", True)
            study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        except UpdateFinishedTrialError:  # another worker failed it first, or its own ended it
            continue
        # a worker killed between its ask and naming the run directory left none to resume
        resume = {"run_dir": trial.user_attrs["run_dir"]} if "run_dir" in trial.user_attrs else {}
        study.enqueue_trial(trial.params, user_attrs=resume)
        print(f"worker {worker} | trial {trial.number} lost its worker (no heartbeat for "
              f"{age:.0f} s): queued again, to resume from its checkpoint", flush=True)


def may_be_lost(study, lease):
    """Running trials whose heartbeat is late: their worker may be gone."""
    return [t for t in running(study) if heartbeat_age(t) > lease / 2]


def run_worker(args, worker):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    interrupt = Interrupt()
    study = open_study(args, worker)
    preset = presets.get_preset(args.preset)
    space = search_space(preset, args.max_steps, args.batch_unit)
    env = trainer_environment(args, worker - args.first_worker)
    while not interrupt.received:
        queue_lost_trials(study, args.lease, worker)
        if counted_trials(study) >= args.trials:
            if not may_be_lost(study, args.lease):
                break
            time.sleep(args.lease / BEATS_PER_LEASE)  # until each is back, done or lost
            continue
        trial = study.ask(space)  # a queued (interrupted) trial first, else the sampler's proposal
        if counted_trials(study, before=trial.number) >= args.trials:  # another worker's ask
            trial.set_user_attr("surplus", True)                        # came first
            study.tell(trial, state=TrialState.FAIL)
            continue
        run_dir = Path(trial.user_attrs.get("run_dir")
                       or args.study_dir / "trials" / f"{trial.number:04d}")
        trial.set_user_attr("run_dir", str(run_dir))
        trial.set_user_attr("worker", worker)
        start = last_beat = time.perf_counter()

        def report(step, loss):
            trial.report(loss, step)
            return trial.should_prune()

        def heartbeat():
            nonlocal last_beat
            if time.perf_counter() - last_beat > args.lease / BEATS_PER_LEASE:
                trial.set_user_attr("heartbeat", time.time())
                last_beat = time.perf_counter()

        command = trainer_command(args, trial.params, run_dir)
        outcome, loss = train(command, run_dir, env, interrupt, report, heartbeat)
        try:
            tell(study, trial, worker, outcome, loss, run_dir, time.perf_counter() - start)
        except UpdateFinishedTrialError:
            print(f"worker {worker} | trial {trial.number} was taken for lost (a heartbeat later "
                  f"than --lease {args.lease:g} s) and queued again", flush=True)
    return interrupt.received


def tell(study, trial, worker, outcome, loss, run_dir, seconds):
    """Tell the study how the trial went."""
    trial.set_user_attr("seconds", round(seconds, 1))
    print(f"worker {worker} | trial {trial.number} | {describe(trial.params)} -> {outcome}"
          + (f", val {loss:.4f}" if loss is not None else "") + f" ({seconds:.1f} s)", flush=True)
    if outcome == "complete" and loss is not None:
        study.tell(trial, loss)
    elif outcome == "pruned":
        shutil.rmtree(runs.checkpoint_dir(run_dir), ignore_errors=True)  # never resumed
        study.tell(trial, state=TrialState.PRUNED)
    elif outcome == "interrupted":  # queue the same settings; the next worker resumes the run
        trial.set_user_attr("interrupted", True)
        study.tell(trial, state=TrialState.FAIL)
        study.enqueue_trial(trial.params, user_attrs={"run_dir": str(run_dir)})
    else:
        error = last_line(run_dir / "train.log")
        trial.set_user_attr("error", error)
        study.tell(trial, state=TrialState.FAIL)
        print(f"worker {worker} | trial {trial.number} failed: {error}", flush=True)


def run_workers(args):
    """--workers N local processes, each its own Optuna client of the shared storage."""
    if args.workers == 1:
        return run_worker(args, args.first_worker)
    context = multiprocessing.get_context("spawn")  # a clean interpreter: no inherited locks
    workers = [context.Process(target=run_worker, args=(args, args.first_worker + w))
               for w in range(args.workers)]
    for process in workers:
        process.start()
    for sig in INTERRUPTS:  # each worker passes it on to its trainer
        signal.signal(sig, lambda signum, frame: [os.kill(p.pid, signum) for p in workers])
    for process in workers:
        process.join()
    if any(process.exitcode for process in workers):
        raise KitError(f"a worker failed (exit codes {[p.exitcode for p in workers]}): see above")
    return None


# ----------------------------------------------------------------------------------------------
# The default configuration, for comparison; the results
# ----------------------------------------------------------------------------------------------
def baseline_loss(args):
    """The final validation loss of STUDY_DIR/baseline, if that run has finished."""
    run_dir = args.study_dir / "baseline"
    done = [r["val_loss"] for r in (runs.read_metrics(run_dir) if run_dir.exists() else [])
            if r.get("step") == args.max_steps and "val_loss" in r]
    return done[-1] if done else None


def run_baseline(args):
    """The preset's own recipe with the same budget, in STUDY_DIR/baseline (once)."""
    if baseline_loss(args) is not None:
        return
    preset = presets.get_preset(args.preset)
    run_dir = args.study_dir / "baseline"
    hyperparameters = default_hyperparameters(preset, args.max_steps, args.batch_unit)
    command = trainer_command(args, hyperparameters, run_dir)
    outcome, loss = train(command, run_dir, trainer_environment(args, 0), Interrupt(),
                          on_validation=lambda step, loss: False, heartbeat=lambda: None)
    if outcome != "complete" or loss is None:
        raise KitError(f"the baseline run {outcome}: {last_line(run_dir / 'train.log')}")
    print(f"baseline | {describe(hyperparameters)} -> val {loss:.4f}", flush=True)


def save_atomic(path, write):
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # workers may write at once
    write(tmp)
    tmp.replace(path)


def write_results(args, baseline):
    """best.json, trials.csv and the plots, in STUDY_DIR; any worker may write them at any time."""
    study = optuna.load_study(study_name=args.study_name,
                              storage=open_storage(args.storage, args.study_dir))
    trials = study.get_trials(deepcopy=False)
    states = {state.name.lower(): sum(t.state == state for t in trials) for state in TrialState}
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    summary = {"study": args.study_name, "trials": len(trials), "states": states}
    if complete:
        best = study.best_trial
        summary["best"] = {"number": best.number, "val_loss": best.value, "params": best.params,
                           "run_dir": best.user_attrs.get("run_dir")}
    if baseline is not None:
        summary["baseline_val_loss"] = baseline
    runs.write_json_atomic(args.study_dir / "best.json", summary)
    save_atomic(args.study_dir / "trials.csv",
                lambda tmp: study.trials_dataframe().to_csv(tmp, index=False))
    if len(complete) >= 2:
        save_plots(study, args.study_dir / "plots")
    print(f"{len(trials)} trials: " + ", ".join(f"{n} {s}" for s, n in states.items() if n))
    if complete:
        print(f"best: trial {best.number}, val {best.value:.4f} | {describe(best.params)}")
    if baseline is not None:
        print(f"the preset's defaults: val {baseline:.4f}")
    return summary


def save_plots(study, folder):
    """Optuna's matplotlib figures: history, importance, intermediate values, parallel coords."""
    import matplotlib
    matplotlib.use("Agg")  # no display on a compute node
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    folder.mkdir(parents=True, exist_ok=True)
    figures = {"history": plots.plot_optimization_history, "importance": plots.plot_param_importances,
               "intermediate": plots.plot_intermediate_values,
               "parallel": plots.plot_parallel_coordinate}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        for name, plot in figures.items():
            figure = plot(study).get_figure()
            save_atomic(folder / f"{name}.png",
                        lambda tmp: figure.savefig(tmp, format="png", dpi=100, bbox_inches="tight"))
            plt.close(figure)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=list(presets.PRESETS), default="tiny")
    parser.add_argument("--data", help="prepared data directory (default: the preset's)")
    parser.add_argument("--study-dir", help="journal, trial runs and results "
                        "(default: runs/hpo-<preset>)")
    parser.add_argument("--study-name", help="the study in the storage (default: hpo-<preset>)")
    parser.add_argument("--storage", help="an RDB URL instead of STUDY_DIR/journal.log")
    parser.add_argument("--trials", type=positive_int, default=12,
                        help="trials of the whole study, over all workers")
    parser.add_argument("--workers", type=positive_int, default=1,
                        help="trials side by side on this machine, each in its own process")
    parser.add_argument("--nproc-per-node", type=positive_int, default=1,
                        help="processes of each trial on a node (more than 1: the ddp stage)")
    parser.add_argument("--nodes", type=positive_int, default=1,
                        help="nodes of each trial (more than 1: srun inside a Slurm allocation)")
    parser.add_argument("--srun-args", default="", help="extra srun options of multi-node trials")
    parser.add_argument("--sampler", choices=SAMPLERS, default="tpe")
    parser.add_argument("--pruner", choices=PRUNERS, default="hyperband")
    parser.add_argument("--max-steps", type=positive_int, help="steps of a trial that is not "
                        "pruned (the most resource; default: the preset's)")
    parser.add_argument("--eval-interval", type=positive_int,
                        help="steps between validations: the pruner's rungs (default: the preset's)")
    parser.add_argument("--micro-batch", type=positive_int, help="samples per forward pass of "
                        "every trial: what the GPU holds (default: the preset's)")
    parser.add_argument("--train-args", default="", help="more flags for the trainer, quoted")
    parser.add_argument("--baseline", action="store_true",
                        help="also train the preset's defaults with the same budget, to compare")
    parser.add_argument("--results-only", action="store_true",
                        help="write best.json, trials.csv and the plots, and train nothing")
    parser.add_argument("--lease", type=positive_float, default=120,
                        help="seconds without a heartbeat after which a running trial's worker "
                             "is taken for lost and the trial is queued again")
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except KitError as err:
        parser.error(str(err))
    return args


def check_args(args):
    preset = presets.get_preset(args.preset)
    args.data = args.data or preset.data
    args.max_steps = args.max_steps or preset.max_steps
    args.eval_interval = args.eval_interval or preset.eval_interval
    args.study_dir = Path(args.study_dir or f"runs/hpo-{preset.name}")
    args.study_name = args.study_name or f"hpo-{preset.name}"
    args.processes = args.nodes * args.nproc_per_node
    args.micro_batch = args.micro_batch or preset.micro_batch
    args.batch_unit = args.micro_batch * preset.seq_len * args.processes  # one microbatch each
    args.first_worker = int(os.environ.get("SLURM_ARRAY_TASK_ID", 0)) * args.workers
    args.gpus = visible_gpus()
    if args.eval_interval > args.max_steps:
        raise KitError(f"--eval-interval {args.eval_interval} is more than --max-steps "
                       f"{args.max_steps}: the pruner would see no intermediate loss")
    if args.nodes > 1 and "SLURM_JOB_NODELIST" not in os.environ:
        raise KitError(f"--nodes {args.nodes} starts trials with srun: run it inside a Slurm job "
                       "of that many nodes (batchfiles/<site>/batch-hpo-2n*g.sh)")
    if args.workers > 1 and args.gpus and len(args.gpus) < args.workers * args.nproc_per_node:
        raise KitError(f"--workers {args.workers} x --nproc-per-node {args.nproc_per_node} needs "
                       f"{args.workers * args.nproc_per_node} GPUs; {len(args.gpus)} are visible")
    if not (Path(args.data) / "meta.json").exists():
        raise KitError(f"--data {args.data} holds no prepared data (meta.json): "
                       f"python -m coursekit data prepare --out {args.data}")


def visible_gpus():
    """This machine's GPU ids as CUDA numbers them, without importing torch in the driver."""
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return []
    return [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")]


def main(argv=None):
    args = parse_args(argv)
    if args.baseline and not args.results_only:
        run_baseline(args)
    interrupted = None if args.results_only else run_workers(args)
    write_results(args, baseline_loss(args))
    if interrupted:
        print(f"{interrupted} received: the running trial is queued; run again to continue")
    return 0


if __name__ == "__main__":
    sys.exit(faults.run(main))  # a bad value, a lost peer, a full disk: one line, no traceback
