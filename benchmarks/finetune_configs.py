"""Wall time and step time of the lora stage under each Accelerate config on this machine.

Each run is the real `accelerate launch --config_file solutions/accelerate/<config>.yaml
solutions/finetune_lora.py` on the tiny preset's model and tasks (models/kit-tiny, data/instruct,
built by `make`), the same 32 examples per step whatever the config: single (1 process, 2 micro-
batches of 16), ddp, fsdp, zero2 and zero3 (2 processes of 16). Wall time is the whole launch:
start-up, model loading, evaluation before and after, saving the adapter and the merged model. On a
CPU-only machine the 2 processes share the same cores, so the figures show each config's overhead,
not a speedup. DeepSpeed builds a C++ op on first use (into TORCH_EXTENSIONS_DIR): a first, untimed
ZeRO-2 run of one step warms that cache. Writes benchmarks/results/finetune_configs.json.

    .venv/bin/python benchmarks/finetune_configs.py [--steps 100] [--warmup 10]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from throughput import machine

from coursekit import KIT_ROOT, runs

RESULTS = KIT_ROOT / "benchmarks" / "results" / "finetune_configs.json"
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
CONFIGS = ("single", "ddp", "fsdp", "zero2", "zero3")


def launch(config, out, steps):
    """Run the lora stage under one config; return its wall time in seconds."""
    command = [ACCELERATE, "launch", "--config_file",
               str(KIT_ROOT / "solutions" / "accelerate" / f"{config}.yaml"),
               str(KIT_ROOT / "solutions" / "finetune_lora.py"), "--preset", "tiny",
               "--model", str(KIT_ROOT / "models" / "kit-tiny"),
               "--data", str(KIT_ROOT / "data" / "instruct"), "--out", str(out),
               "--max-steps", str(steps), "--eval-interval", str(steps),
               "--ckpt-interval", str(steps)]
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(KIT_ROOT / ".cache" / "torch_extensions")}
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=env, cwd=KIT_ROOT)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    subprocess.run(["make", "models/kit-tiny/config.json", "data/instruct/meta.json"],
                   cwd=KIT_ROOT, check=True, stdout=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory() as warm:  # DeepSpeed's op build, not timed
        launch("zero2", Path(warm) / "run", 1)
    result = {"benchmark": "lora stage under each Accelerate config", "preset": "tiny",
              "steps": args.steps, "warmup_steps": args.warmup, "examples_per_step": 32,
              "date": time.strftime("%Y-%m-%d"), "machine": machine()}
    for config in CONFIGS:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run"
            wall = launch(config, out, args.steps)
            timed = [r for r in runs.read_metrics(out) if r["step"] > args.warmup]
            evaluations = runs.read_json(out / "eval.json")
            result[config] = {
                "processes": runs.read_json(out / "config.json")["world_size"],
                "wall_s": wall,
                "median_ms_per_step": statistics.median(r["ms"] for r in timed),
                "median_tok_per_s": statistics.median(r["tok_per_s"] for r in timed),
                "exact_match_after": evaluations["after"]["exact_match"],
                "final_loss": timed[-1]["loss"],
            }
        figures = result[config]
        print(f"{config:7s} {figures['processes']} process(es): {figures['wall_s']:6.1f} s wall, "
              f"{figures['median_ms_per_step']:6.1f} ms/step, "
              f"{figures['median_tok_per_s']:8,.0f} tok/s, exact match "
              f"{figures['exact_match_after']:.0%}", flush=True)
    runs.write_json_atomic(args.out, result)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
