"""CPU-seconds that a Python process spends before its first training step, and what the tests'
fork server (tests/helpers/forkserver.py) saves on a short stage run.

First the imports alone, each in a new interpreter: nothing, torch, torch with torch._dynamo (which
every optimiser imports), Lightning, Transformers with PEFT. Then a 2-step std run and a 2-step
2-process ddp run, each `--repeat` times, as processes of their own (the ddp run under torchrun)
and forked from one fork server; the server's own start (its imports, once) is measured apart and
reported. CPU-seconds are the children's user + system time (getrusage), which the fork server's
runs reach once it has exited. Writes benchmarks/results/process_start.json.

    .venv/bin/python benchmarks/process_start.py [--repeat 3]
"""
import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from throughput import children_cpu, machine

from coursekit import KIT_ROOT, launch, runs

sys.path.insert(0, str(KIT_ROOT / "tests"))
from conftest import ONE_THREAD, kit_env, stage_command, torchrun_worker_env  # noqa: E402
from helpers import forkserver  # noqa: E402

RESULTS = KIT_ROOT / "benchmarks" / "results" / "process_start.json"
IMPORTS = {"nothing": "pass", "torch": "import torch",
           "torch + torch._dynamo": "import torch, torch._dynamo", "lightning": "import lightning",
           "transformers + peft": "import transformers, peft"}
TWO_STEPS = ["--preset", "tiny", "--max-steps", "2", "--eval-interval", "2", "--eval-steps", "1",
             "--ckpt-interval", "2", "--sample-tokens", "0", "--device", "cpu"]


def cpu_of(work):
    """CPU-seconds of the processes ``work`` starts and waits for."""
    before = children_cpu()
    work()
    return children_cpu() - before


def std_args(out):
    return [*TWO_STEPS, "--data", str(KIT_ROOT / "data" / "builtin"), "--out", str(out)]


def started(folder, repeat):
    """A std run and a ddp run under torchrun, `repeat` times each, as processes of their own."""
    env = kit_env(ONE_THREAD)
    for i in range(repeat):
        subprocess.run(stage_command("train_gpt2_std.py", *std_args(folder / f"std-{i}")),
                       check=True, capture_output=True, env=env, cwd=KIT_ROOT)
        subprocess.run([*launch.torchrun(2), str(KIT_ROOT / "solutions" / "train_gpt2_ddp.py"),
                        *std_args(folder / f"ddp-{i}")], check=True, capture_output=True, env=env,
                       cwd=KIT_ROOT)


def forked(folder, repeat):
    """The same runs forked from one fork server (its start included)."""
    env, server = kit_env(ONE_THREAD), forkserver.Server(kit_env)
    try:
        for i in range(repeat):
            result = server.run(stage_command("train_gpt2_std.py", *std_args(folder / f"s{i}")),
                                env, KIT_ROOT, 600)
            assert result is not None and result.returncode == 0, result
            command = stage_command("train_gpt2_ddp.py", *std_args(folder / f"d{i}"))
            port = launch.free_port()
            result = server.group([command] * 2, [torchrun_worker_env(env, rank, 2, port)
                                                  for rank in range(2)], KIT_ROOT, 600)
            assert result is not None and result.returncode == 0, result
    finally:
        server.stop()


def server_alone():
    server = forkserver.Server(kit_env)
    server.start()
    server.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    subprocess.run(["make", "data/builtin/meta.json"], cwd=KIT_ROOT, check=True,
                   capture_output=True)
    imports = {name: round(cpu_of(lambda: subprocess.run([sys.executable, "-c", code],
                                                         check=True)), 2)
               for name, code in IMPORTS.items()}
    with tempfile.TemporaryDirectory() as folder:
        as_processes = cpu_of(lambda: started(Path(folder), args.repeat))
        with_server = cpu_of(lambda: forked(Path(folder), args.repeat))
    server_start = cpu_of(server_alone)
    result = {"machine": machine(), "repeat": args.repeat, "imports_cpu_s": imports,
              "std_and_ddp_runs": {
                  "as_processes_cpu_s": round(as_processes / args.repeat, 2),
                  "forked_cpu_s": round((with_server - server_start) / args.repeat, 2),
                  "fork_server_start_cpu_s": round(server_start, 2)}}
    runs.write_json_atomic(args.out, result)
    print(result)


if __name__ == "__main__":
    main()
