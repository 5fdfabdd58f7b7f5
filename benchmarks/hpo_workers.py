"""How fast an Optuna study runs with 1 and with 2 local workers, how much pruning saves, and how
its best trial compares with the preset's defaults: solutions/hpo_optuna.py on this machine.

Each setting is a fresh study of the same trials (TPE, Hyperband pruning, the same seed) on the
tiny preset; the wall time of the whole command gives trials per minute. The defaults' baseline
is trained once, after the timed studies, with the same budget. On a 2-core CPU two workers
share the cores (each trial gets 1 thread instead of 2), so the figure shows what side-by-side
trials gain when a trial cannot use every core well. Writes benchmarks/results/hpo_workers.json.

    .venv/bin/python benchmarks/hpo_workers.py [--trials 12] [--max-steps 30] [--eval-interval 5]
"""
import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from throughput import machine

from coursekit import KIT_ROOT, runs

RESULTS = KIT_ROOT / "benchmarks" / "results" / "hpo_workers.json"


def study(study_dir, workers, args, baseline=False):
    """Run hpo_optuna.py; returns (wall seconds, its best.json)."""
    command = [sys.executable, str(KIT_ROOT / "solutions" / "hpo_optuna.py"), "--preset", "tiny",
               "--data", str(KIT_ROOT / "data" / "builtin"), "--study-dir", str(study_dir),
               "--trials", str(args.trials), "--workers", str(workers),
               "--max-steps", str(args.max_steps), "--eval-interval", str(args.eval_interval),
               "--train-args", "--eval-steps 4", *(["--baseline"] if baseline else [])]
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=KIT_ROOT)
    return time.perf_counter() - start, runs.read_json(study_dir / "best.json")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--eval-interval", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    subprocess.run(["make", "data/builtin/meta.json"], cwd=KIT_ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    result = {"benchmark": "Optuna study (TPE, Hyperband) over the std stage, 1 vs 2 workers",
              "preset": "tiny", "trials": args.trials, "max_steps": args.max_steps,
              "eval_interval": args.eval_interval, "date": time.strftime("%Y-%m-%d"),
              "machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (1, 2):
            wall, summary = study(Path(tmp) / f"workers-{workers}", workers, args)
            states = summary["states"]
            finished = states["complete"] + states["pruned"]
            result[f"workers_{workers}"] = {
                "wall_s": wall, "trials_per_minute": finished / wall * 60,
                "pruned_fraction": states["pruned"] / finished,
                "best_val_loss": summary["best"]["val_loss"], "best_params": summary["best"]["params"]}
        # untimed: the study is complete, so this trains only the defaults, with the same budget
        _, summary = study(Path(tmp) / "workers-1", 1, args, baseline=True)
        result["baseline_val_loss"] = summary["baseline_val_loss"]
    for workers in (1, 2):
        figures = result[f"workers_{workers}"]
        print(f"{workers} worker(s): {args.trials} trials in {figures['wall_s']:.0f} s = "
              f"{figures['trials_per_minute']:.2f} trials/min, "
              f"{100 * figures['pruned_fraction']:.0f}% pruned, best val "
              f"{figures['best_val_loss']:.4f} (defaults {result['baseline_val_loss']:.4f})")
    runs.write_json_atomic(args.out, result)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
