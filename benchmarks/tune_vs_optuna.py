"""Lesson 07's Optuna study against lesson 09's Ray Tune (ASHA and PBT) over the same search space,
trainer and steps: solutions/hpo_optuna.py and solutions/ray_tune_gpt2.py on this machine.

Optuna (TPE, Hyperband pruning) and ASHA (random proposals, successive halving) get the same
trials, steps per trial, rungs and 2 trials at a time; PBT gets a population of --population trials
that all train to the end. Each method's budget is what it really trained: the optimiser steps
that its trainers printed (a pruned trial stops early, a PBT trial that copies another's checkpoint
goes back in steps). The preset's defaults, trained once with the same steps, are the baseline.
Writes benchmarks/results/tune_vs_optuna.json.

    .venv/bin/python benchmarks/tune_vs_optuna.py [--trials 12] [--population 4] [--max-steps 30]
"""
import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from throughput import machine

from coursekit import KIT_ROOT, runs

RESULTS = KIT_ROOT / "benchmarks" / "results" / "tune_vs_optuna.json"
DATA = KIT_ROOT / "data" / "builtin"


def steps_trained(study_dir):
    """The step lines every trainer of the study printed: one per optimiser step."""
    return sum(1 for log in Path(study_dir).rglob("train.log")
               for line in log.read_text(errors="replace").splitlines()
               if re.match(r"step \d+/\d+ ", line))


def run_study(script, study_dir, args, *flags):
    """Run one study to the end; returns (wall seconds, steps trained, its best.json)."""
    command = [sys.executable, str(KIT_ROOT / "solutions" / script), "--preset", "tiny",
               "--data", str(DATA), "--study-dir", str(study_dir), "--workers", "2",
               "--max-steps", str(args.max_steps), "--eval-interval", str(args.eval_interval),
               "--train-args", "--eval-steps 4", *map(str, flags)]
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=KIT_ROOT)
    wall = time.perf_counter() - start
    return wall, steps_trained(study_dir), runs.read_json(study_dir / "best.json")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=12, help="Optuna's and ASHA's trials")
    parser.add_argument("--population", type=int, default=4, help="PBT's trials")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--eval-interval", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    subprocess.run(["make", "data/builtin/meta.json"], cwd=KIT_ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    methods = {"optuna_tpe_hyperband": ("hpo_optuna.py", "--trials", args.trials),
               "ray_asha": ("ray_tune_gpt2.py", "--scheduler", "asha", "--trials", args.trials),
               "ray_pbt": ("ray_tune_gpt2.py", "--scheduler", "pbt", "--trials", args.population)}
    result = {"benchmark": "Optuna (TPE, Hyperband) vs Ray Tune (ASHA, PBT), lesson 07's space",
              "preset": "tiny", "trials": args.trials, "population": args.population,
              "max_steps": args.max_steps, "eval_interval": args.eval_interval,
              "date": time.strftime("%Y-%m-%d"), "machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (script, *flags) in methods.items():
            wall, steps, best = run_study(script, Path(tmp) / name, args, *flags)
            result[name] = {"wall_s": wall, "steps_trained": steps,
                            "best_val_loss": best["best"]["val_loss"],
                            "best_params": best["best"]["params"]}
        # untimed: the Optuna study is complete, so this trains only the defaults
        *_, best = run_study("hpo_optuna.py", Path(tmp) / "optuna_tpe_hyperband", args,
                             "--trials", args.trials, "--baseline")
        result["baseline_val_loss"] = best["baseline_val_loss"]
    for name in methods:
        figures = result[name]
        print(f"{name}: {figures['steps_trained']} steps in {figures['wall_s']:.0f} s, best val "
              f"{figures['best_val_loss']:.4f} (defaults {result['baseline_val_loss']:.4f})")
    runs.write_json_atomic(args.out, result)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
