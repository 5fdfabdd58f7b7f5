"""Tune the GPT-2 trainer's hyperparameters with Ray Tune (lesson 09): the search space, trainer and
budget of lesson 07's Optuna study (solutions/hpo_optuna.py), with two of Ray Tune's schedulers.

    python solutions/ray_tune_gpt2.py --scheduler asha --trials 12 --workers 2   # a local Ray
    sbatch batchfiles/<site>/batch-ray-2n4g.sh solutions/ray_tune_gpt2.py --scheduler pbt

asha  Asynchronous successive halving: random proposals from the whole space, and at each rung
      (eval_interval x 3^k steps) a trial goes on only if it is in the best third of those that
      reached that rung so far. Lesson 07's Hyperband pruner runs the same rule in brackets.
pbt   Population-based training: --trials runs train side by side from the start; every
      --eval-interval steps, once all have reached it, one in the worst quarter stops, copies the
      weights of one in the best quarter (its checkpoint) and goes on with that one's learning
      rate perturbed (x0.8 or x1.2, or a new draw). What PBT finds is a schedule, not one value.
      Only what can change in the middle of a run is explored: the learning rate, which the
      trainer sets at every step. The others keep the preset's values (a copied model needs the
      same depth, and a resumed run the same batch).

Each trial is the std stage in its own process, followed through its metrics.jsonl as lesson 07's
workers follow theirs; Ray runs --workers of them at once, one CPU (or one GPU) each, on any node
of the cluster. The study's folder holds Ray's records (ray/) and best.json.
"""
import os
import re
import shutil
import sys
import time
import types
from pathlib import Path

from coursekit import KitError, faults, presets, raycluster, runs
from coursekit.cli import ArgumentParser, positive_int
from solutions import hpo_optuna

SCHEDULERS = ("asha", "pbt")


def ray_space(distributions):
    """Optuna's distributions (lesson 07's search space) as Ray Tune's."""
    from optuna.distributions import FloatDistribution, IntDistribution
    from ray import tune

    def convert(distribution):
        if isinstance(distribution, FloatDistribution):
            sample = tune.loguniform if distribution.log else tune.uniform
            return sample(distribution.low, distribution.high)
        if isinstance(distribution, IntDistribution):  # Ray's upper bound is left out
            return tune.randint(distribution.low, distribution.high + 1)
        return tune.choice(list(distribution.choices))

    return {name: convert(distribution) for name, distribution in distributions.items()}


def search(args):
    """(the space Ray samples, the scheduler)."""
    from ray.tune.schedulers import ASHAScheduler, PopulationBasedTraining

    preset = presets.get_preset(args.preset)
    space = ray_space(hpo_optuna.search_space(preset, args.max_steps, args.batch_unit))
    if args.scheduler == "asha":
        return space, ASHAScheduler(time_attr="step", max_t=args.max_steps,
                                    grace_period=args.eval_interval, reduction_factor=3)
    fixed = hpo_optuna.default_hyperparameters(preset, args.max_steps, args.batch_unit)
    return ({**fixed, "lr": space["lr"]},
            # synchronous: the population is compared when every trial has reached the same step,
            # not each trial with the others' latest results (from fewer steps, if they are slower)
            PopulationBasedTraining(time_attr="step", perturbation_interval=args.eval_interval,
                                    hyperparam_mutations={"lr": space["lr"]}, synch=True))


def restore(checkpoint, run_dir):
    """Put the checkpoint Ray hands a trial (its own after a pause, or under PBT another trial's)
    where the trainer's --resume finds it; return its step (0: none)."""
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as folder:
        step = runs.read_json(Path(folder) / "state.json")["step"]
        target = runs.checkpoint_dir(run_dir) / f"step_{step:08d}"
        shutil.rmtree(runs.checkpoint_dir(run_dir), ignore_errors=True)
        shutil.copytree(folder, target)
    runs.write_json_atomic(runs.checkpoint_dir(run_dir) / "latest.json",
                           {"dir": target.name, "step": step})
    return step


def checkpoint_at(run_dir, step, timeout=120):
    """The trainer's checkpoint of ``step`` once it is published (it follows the step's metrics
    line), or None if it is not within ``timeout`` seconds."""
    pointer = runs.checkpoint_dir(run_dir) / "latest.json"
    deadline = time.monotonic() + timeout
    while not pointer.exists() or runs.read_json(pointer)["step"] < step:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)
    return runs.latest_checkpoint(run_dir)


def trial(config, args):
    """One trial, in a Ray actor: the std stage with the trial's hyperparameters, its validation
    losses reported to the scheduler, each with its checkpoint."""
    from ray import tune

    run_dir = runs.make_run_dir(Path(tune.get_context().get_trial_dir()) / "run")
    resumed_at = restore(tune.get_checkpoint(), run_dir)
    command = hpo_optuna.trainer_command(args, config, run_dir)

    def report(step, loss):
        if step > resumed_at:  # the steps before were reported by the run it resumed
            found = checkpoint_at(run_dir, step) if args.scheduler == "pbt" else None
            tune.report({"step": step, "val_loss": loss},
                        checkpoint=tune.Checkpoint.from_directory(found) if found else None)
        return False  # the scheduler stops a trial by stopping its actor (and so the trainer)

    # no signal handlers here (a trial runs outside the actor's main thread): Ray stops trials
    no_interrupt = types.SimpleNamespace(trainer=None, received=None)
    outcome, _ = hpo_optuna.train(command, run_dir, dict(os.environ), no_interrupt, report,
                                  heartbeat=lambda: None)
    if outcome != "complete":
        raise RuntimeError(f"the trainer {outcome}: {hpo_optuna.last_line(run_dir / 'train.log')}")


def steps_trained(study_dir):
    """The optimiser steps of every trial's trainer runs, from the lines they printed: the
    budget the study spent (a PBT trial that copies another's checkpoint goes back in steps)."""
    return sum(1 for log in Path(study_dir).glob("ray/*/run/train.log")
               for line in log.read_text(errors="replace").splitlines()
               if re.match(r"step \d+/\d+ ", line))


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheduler", choices=SCHEDULERS, default="asha")
    parser.add_argument("--preset", choices=list(presets.PRESETS), default="tiny")
    parser.add_argument("--data", help="prepared data directory (default: the preset's)")
    parser.add_argument("--study-dir", help="Ray's records and best.json "
                        "(default: runs/tune-<scheduler>-<preset>)")
    parser.add_argument("--trials", type=positive_int, default=12,
                        help="trials (pbt: the population, all running at once)")
    parser.add_argument("--workers", type=positive_int, default=2, help="trials at once (asha)")
    parser.add_argument("--max-steps", type=positive_int, help="steps of a trial that runs to the "
                        "end (default: the preset's)")
    parser.add_argument("--eval-interval", type=positive_int,
                        help="steps between validations: the rungs, or PBT's perturbation interval")
    parser.add_argument("--micro-batch", type=positive_int,
                        help="samples per forward pass (default: the preset's)")
    parser.add_argument("--train-args", default="", help="more flags for the trainer, quoted")
    parser.add_argument("--seed", type=int, default=1337,
                        help="seed of the trials' sampling: the same seed samples the same trials")
    args = parser.parse_args(argv)
    # what lesson 07's workers check and derive, for trials of one process each
    args.nodes, args.nproc_per_node = 1, 1
    args.study_dir = args.study_dir or f"runs/tune-{args.scheduler}-{args.preset}"
    args.study_name = Path(args.study_dir).name
    try:
        hpo_optuna.check_args(args)
    except KitError as err:
        parser.error(str(err))
    args.study_dir, args.data = args.study_dir.resolve(), str(Path(args.data).resolve())
    if args.scheduler == "pbt":  # a checkpoint at every validation, for the others to copy
        args.train_args += f" --ckpt-interval {args.eval_interval}"
    return args


def main(argv=None):
    args = parse_args(argv)
    from ray import tune
    from ray.tune.search import BasicVariantGenerator

    raycluster.connect()
    space, scheduler = search(args)
    gpus = 1 if args.gpus else 0
    concurrent = args.trials if args.scheduler == "pbt" else args.workers
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(trial, args=args), {"cpu": 1, "gpu": gpus}),
        param_space=space,
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", scheduler=scheduler,
                                    search_alg=BasicVariantGenerator(random_state=args.seed),
                                    num_samples=args.trials, max_concurrent_trials=concurrent),
        # Ray keeps every checkpoint a trial reports unless told: under PBT one per validation
        # of every trial, hundreds of GB at the gpt2-124m preset. A trial that exploits another
        # copies that one's latest.
        run_config=tune.RunConfig(name="ray", storage_path=str(args.study_dir), verbose=0,
                                  checkpoint_config=tune.CheckpointConfig(
                                      num_to_keep=runs.KEEP_CHECKPOINTS)))
    results = tuner.fit()
    best = results.get_best_result(scope="all")  # the best validation any trial reached
    steps = steps_trained(args.study_dir)
    summary = {"scheduler": args.scheduler, "trials": len(results), "steps_trained": int(steps),
               "best": {"val_loss": best.metrics["val_loss"], "step": best.metrics["step"],
                        "params": best.config}}
    runs.write_json_atomic(args.study_dir / "best.json", summary)
    print(f"ray tune ({args.scheduler}): {len(results)} trials, {steps} steps trained; best val "
          f"{best.metrics['val_loss']:.4f} at step {best.metrics['step']} | "
          f"{hpo_optuna.describe(best.config)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(faults.run(main))
