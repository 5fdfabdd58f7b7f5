"""The pipeline bubble of the pp stage, predicted and measured, over schedules and microbatch counts.

For each schedule and number of microbatches m, the same step (the tiny preset, --batch-tokens of
16 samples) runs on one process (a pipeline of one stage: no bubble) and on p processes (p
stages), every process with one thread (torchrun sets OMP_NUM_THREADS=1 for both). Without a bubble
and without communication, p stages would take 1/p of one stage's time, so the measured idle
fraction is 1 - (t_1 / p) / t_p; the prediction is (p - 1) / (m + p - 1). Only p = 2 is measured
by default: on a 2-core machine more stages than cores share cores, which no bubble explains.
Writes benchmarks/results/pipeline_bubble.json.

    .venv/bin/python benchmarks/pipeline_bubble.py [--stages 2] [--steps 6] [--warmup 2]
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

from throughput import machine, stage_command, timed_run

from coursekit import KIT_ROOT, data, runs

RESULTS = KIT_ROOT / "benchmarks" / "results" / "pipeline_bubble.json"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
SCHEDULES = ("gpipe", "1f1b")


def step_ms(processes, schedule, microbatches, args):
    """Median milliseconds per step of the pp stage on `processes` stages."""
    launcher = [TORCHRUN, "--standalone", f"--nproc-per-node={processes}"]
    with tempfile.TemporaryDirectory() as out:
        command = stage_command("train_gpt2_pp.py", "tiny", args.data, out, args.steps) + [
            "--device", "cpu", "--batch-tokens", str(args.batch_tokens),
            "--schedule", schedule, "--microbatches", str(microbatches)]
        return timed_run(launcher, command, out, args.warmup)["median_ms_per_step"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--batch-tokens", type=int, default=16 * 128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--data", default=str(KIT_ROOT / "data" / "builtin"))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if not (Path(args.data) / "meta.json").exists():
        data.prepare_builtin(args.data)
    p = args.stages
    result = {"benchmark": f"pipeline bubble, {p} stages, tiny preset", "stages": p,
              "batch_tokens": args.batch_tokens, "steps": args.steps,
              "warmup_steps": args.warmup, "date": time.strftime("%Y-%m-%d"),
              "machine": machine(), "runs": []}
    for schedule in SCHEDULES:
        for m in args.microbatches:
            one, many = step_ms(1, schedule, m, args), step_ms(p, schedule, m, args)
            row = {"schedule": schedule, "microbatches": m, "one_stage_ms": one,
                   "pipeline_ms": many, "predicted_bubble": (p - 1) / (m + p - 1),
                   "measured_idle": 1 - (one / p) / many, "speedup": one / many}
            result["runs"].append(row)
            print(f"{schedule:5s} m={m:2d}: 1 stage {one:7.1f} ms, {p} stages {many:7.1f} ms "
                  f"(speedup {row['speedup']:.2f}) | bubble predicted {row['predicted_bubble']:.2f}, "
                  f"measured idle {row['measured_idle']:.2f}")
    runs.write_json_atomic(args.out, result)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
