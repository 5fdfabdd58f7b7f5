"""The pipeline bubble, predicted and measured, over schedules and microbatch counts.

Two pipelines, every process computing with one thread (so one process and one stage per core
compare fairly):
- lesson 04's demo of equal stages (notebooks/04-model-parallelism/bubble_demo.py): for each
  schedule and number of microbatches m, the same step on one process (one stage: no bubble) and
  on p processes. Without a bubble and without communication p stages take 1/p of one stage's
  time, so the measured idle fraction is 1 - (t_1 / p) / t_p; the prediction is (p-1)/(m+p-1);
- the pp stage script on the tiny preset, whose output head puts most of the work on the last
  stage: what imbalance does to the same figure.
Only p = 2 by default: on a 2-core machine more stages than cores would share cores.
Writes benchmarks/results/pipeline_bubble.json.

    .venv/bin/python benchmarks/pipeline_bubble.py [--stages 2]
"""
import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from throughput import machine, stage_command, timed_run

from coursekit import KIT_ROOT, data, launch, runs

RESULTS = KIT_ROOT / "benchmarks" / "results" / "pipeline_bubble.json"
DEMO = KIT_ROOT / "notebooks" / "04-model-parallelism" / "bubble_demo.py"
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}  # torchrun sets it only for 2+ processes


def torchrun(processes):
    return launch.torchrun(processes)


def demo_ms(processes, schedule, microbatches):
    """{m: median ms per step} of the equal-stage demo."""
    out = subprocess.run([*torchrun(processes), str(DEMO), *map(str, microbatches),
                          "--schedule", schedule], capture_output=True, text=True, check=True,
                         env=ONE_THREAD).stdout
    return {r["microbatches"]: r["step_ms"] for r in map(json.loads, out.splitlines())}


def stage_ms(processes, schedule, microbatches, args):
    """{m: median ms per step} of the pp stage script, tiny preset."""
    result = {}
    for m in microbatches:
        with tempfile.TemporaryDirectory() as out:
            command = stage_command("train_gpt2_pp.py", "tiny", args.data, out, args.steps) + [
                "--device", "cpu", "--batch-tokens", str(args.batch_tokens),
                "--schedule", schedule, "--microbatches", str(m)]
            figures = timed_run(torchrun(processes), command, out, args.warmup, ONE_THREAD)
            result[m] = figures["median_ms_per_step"]
    return result


def compare(name, schedule, one, many, p, result):
    for m in many:
        row = {"pipeline": name, "schedule": schedule, "microbatches": m,
               "one_stage_ms": one[m], "pipeline_ms": many[m],
               "predicted_bubble": (p - 1) / (m + p - 1),
               "measured_idle": 1 - (one[m] / p) / many[m]}
        result["runs"].append(row)
        print(f"{name:5s} {schedule:5s} m={m:2d}: 1 stage {one[m]:7.1f} ms, {p} stages "
              f"{many[m]:7.1f} ms | bubble predicted {row['predicted_bubble']:.2f}, "
              f"measured idle {row['measured_idle']:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--batch-tokens", type=int, default=16 * 128, help="pp stage: per step")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--data", default=str(KIT_ROOT / "data" / "builtin"))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if not (Path(args.data) / "meta.json").exists():
        data.prepare_builtin(args.data)
    p = args.stages
    result = {"benchmark": f"pipeline bubble, {p} stages", "stages": p,
              "stage_batch_tokens": args.batch_tokens, "date": time.strftime("%Y-%m-%d"),
              "machine": machine(), "runs": []}
    for schedule in ("gpipe", "1f1b"):
        counts = [m for m in args.microbatches if schedule == "gpipe" or m >= p]  # 1F1B: m >= p
        one = demo_ms(1, "gpipe", counts)  # one stage: the schedules do the same work
        compare("demo", schedule, one, demo_ms(p, schedule, counts), p, result)
        one = stage_ms(1, "gpipe", counts, args)
        compare("pp", schedule, one, stage_ms(p, schedule, counts, args), p, result)
    runs.write_json_atomic(args.out, result)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
