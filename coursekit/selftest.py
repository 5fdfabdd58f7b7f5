"""A self-test for a new cluster, a GPU session or a laptop, before the first course day.

    python -m coursekit selftest                        # this node: one device, then all of them
    sbatch batchfiles/<site>/batch-selftest-2n4g.sh     # two nodes (the batch files run it)

It checks what the lessons need and shows what the hardware gives:
- torch, the devices and the precision they train in; the training data, the GPT-2 tokenizer
  and the Hugging Face cache, offline; the imports of every lesson's first cell;
- every GPT stage for --steps steps on one device (std, ddp, fsdp, lit) and on all of them (ddp,
  fsdp, tp, pp, lit), at the same global batch: their losses must agree with the std stage's
  within a tolerance fit for the precision (bf16 rounds where fp32 does not);
- each run's tokens per second, MFU, step time, compile time, and its peak memory beside the
  one coursekit.memory predicts;
- the all-reduce bus bandwidth between all the devices over message sizes (coursekit.bandwidth,
  computed as nccl-tests computes it).

It writes OUT/selftest.json and OUT/selftest.md, a summary an instructor can read and keep, and
exits with one line naming the first failure when anything failed. The runs train GPT-2 124M on
a GPU (the largest micro-batch its memory holds, by coursekit.memory) and the tiny model on a
CPU, on the builtin corpus (data/builtin): a test needs no download. Their checkpoints are
deleted once measured; their logs and metrics stay under OUT/runs/.
"""
import ast
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from coursekit import (KIT_ROOT, KitError, data, distributed, envcheck, launch, memory, presets,
                       runs, training)

ONE_DEVICE = ("std", "ddp", "fsdp", "lit")  # std first: the reference
ALL_DEVICES = ("ddp", "fsdp", "tp", "pp", "lit")
#: The largest difference from the std stage's loss at any step that still counts as the same
#: training: fp32 differs only in the order of its sums; 16-bit rounds every matmul.
TOLERANCE = {"fp32": 2e-3, "bf16": 0.05, "fp16": 0.05}
LARGEST_MESSAGE = {"cuda": 2**30, "cpu": 2**24}  # bytes: 1 GiB between GPUs, 16 MiB over gloo
MEMORY_STRATEGY = {"std": "ddp", "ddp": "ddp", "lit": "ddp", "fsdp": "fsdp", "tp": "tp",
                   "pp": "pp"}


@dataclass
class Plan:
    """What the self-test runs: where, on how many processes, what model and batch."""
    device: str         # cuda or cpu
    per_node: int       # processes per node in the all-device runs (GPUs, or CPU processes)
    nodes: int
    preset: str
    micro_batch: int
    seq_len: int
    steps: int
    precision: str      # the precision the device trains in: bf16, fp16 or fp32
    data: str
    out: str
    master_addr: str    # the first node: where multi-node runs meet
    stages: tuple = ONE_DEVICE + ALL_DEVICES  # those to run (std, the reference, always runs)
    expected_busbw: float = None  # GB/s the site's interconnect should give (its profile's)

    @property
    def processes(self):
        return self.per_node * self.nodes

    @property
    def batch_tokens(self):
        """One microbatch per process and step on all devices; accumulated on one."""
        return self.micro_batch * self.seq_len * self.processes


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Run:
    stage: str
    processes: int
    ok: bool = False
    detail: str = ""
    losses: list = field(default_factory=list)
    loss_difference: float = None  # the largest |loss - std's| over the steps
    tok_per_s: float = None
    mfu: float = None
    step_ms: float = None
    compile_s: float = None
    peak_bytes: int = None
    peak_kind: str = None
    predicted_bytes: float = None


# --- the plan ---------------------------------------------------------------------------------

def make_plan(args):
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise KitError(envcheck.gpu_problem() or f"--device cuda: torch {torch.__version__} sees "
                                                 "no GPU (use --device auto or cpu)")
    per_node = args.per_node or (torch.cuda.device_count() if device == "cuda" else 2)
    preset = presets.get_preset(args.preset or presets.default_preset_name(device == "cuda"))
    precision = training.device_precision(torch.device(device, 0) if device == "cuda"
                                          else torch.device("cpu"))
    if args.nodes > 1 and int(os.environ.get("SLURM_JOB_NUM_NODES", 1)) < args.nodes:
        raise KitError(f"--nodes {args.nodes}: this is not a Slurm job of {args.nodes} nodes or "
                       "more (submit batchfiles/<site>/batch-selftest-*.sh)")
    micro_batch = args.micro_batch or largest_micro_batch(preset, device, precision)
    # absolute: the stages run in the kit's root, wherever the self-test was started
    return Plan(device, per_node, args.nodes, preset.name, micro_batch, preset.seq_len,
                args.steps, precision, str(Path(args.data).absolute()),
                str(Path(args.out).absolute()), os.environ.get("MASTER_ADDR", "127.0.0.1"),
                ("std", *(args.stages or ONE_DEVICE + ALL_DEVICES)), args.expected_busbw)


def largest_micro_batch(preset, device, precision):
    """The preset's micro-batch on a CPU; on a GPU the largest up to it that coursekit.memory says
    one process of the ddp stage fits in (the most any stage holds at that micro-batch)."""
    if device != "cuda":
        return preset.micro_batch
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    counted_as = "fp32" if precision == "fp32" else f"{precision}-mixed"
    for micro in range(preset.micro_batch, 0, -1):
        if memory.micro_batch_fits(preset, "ddp", 1, counted_as, micro, gpu_gb):
            return micro
    raise KitError(f"the {preset.name} preset does not fit this {gpu_gb:.0f} GB GPU even one "
                   "sample at a time: use --preset small")


# --- what the lessons need, offline -------------------------------------------------------------

def environment_checks(plan):
    checks = [check_torch(), check_devices(plan), check_data(plan), check_tokenizer(),
              check_hf_cache(), check_lesson_imports()]
    return checks + ([check_every_node(plan)] if plan.nodes > 1 else [])


def check(name, probe):
    """A Check of ``probe()``, which returns its detail or raises KitError/OSError saying why not."""
    try:
        return Check(name, True, probe())
    except (KitError, OSError) as err:
        return Check(name, False, str(err))


def check_torch():
    def probe():
        distributed.check_torch()
        return f"torch {torch.__version__} (the stages need >= "\
               f"{'.'.join(map(str, distributed.MIN_TORCH))})"
    return check("torch", probe)


def check_devices(plan):
    problem = envcheck.gpu_problem()
    if problem:  # GPUs the job was given, but this torch cannot train on them
        return Check("devices", False, problem)
    if plan.device == "cpu":
        return Check("devices", True, f"CPU ({os.cpu_count()} cores): {plan.per_node} processes "
                                      f"per node, {plan.precision}")
    names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
    archs = {envcheck.gpu_architecture(i) for i in range(torch.cuda.device_count())}
    ok = torch.cuda.device_count() >= plan.per_node
    return Check("devices", ok, f"{torch.cuda.device_count()} x {', '.join(sorted(names))} "
                                f"({', '.join(sorted(archs))}, torch built for "
                                f"{' '.join(torch.cuda.get_arch_list())}; driver "
                                f"{envcheck.driver() or '-'}), {plan.precision}; {plan.per_node} "
                                "processes per node" + ("" if ok else ": more processes than GPUs"))


#: Run on every node of the job: its GPUs (envcheck.gpu_problem) and driver, one line
NODE_PROBE = """
import os, socket
from coursekit import envcheck
print(os.environ.get("SLURMD_NODENAME", socket.gethostname()), envcheck.driver() or "no GPU driver",
      envcheck.gpu_problem() or "ok", sep="\\t")
"""


def check_every_node(plan):
    """What check_devices checks on the batch host, on each node of the job: a node with another
    driver, or GPUs this torch cannot use, fails the job's multi-node runs."""
    result = subprocess.run([*srun(plan, 1), sys.executable, "-c", NODE_PROBE],
                            capture_output=True, text=True, cwd=KIT_ROOT, timeout=600,
                            env=run_environment(plan, plan.processes))
    if result.returncode != 0:
        return Check("every node", False, f"exit {result.returncode}: "
                                          f"{first_error(result.stdout + result.stderr)}")
    nodes = sorted(line.split("\t") for line in result.stdout.splitlines() if "\t" in line)
    failed = [f"{host}: {verdict}" for host, _, verdict in nodes if verdict != "ok"]
    if failed:
        return Check("every node", False, "; ".join(failed))
    drivers = sorted({driver for _, driver, _ in nodes})
    hosts = ", ".join(host for host, _, _ in nodes)
    return Check("every node", True, f"{len(nodes)} nodes ({hosts}): GPUs usable; "
                                     f"{'; '.join(drivers)}")


def check_data(plan):
    """The data is there, and each split holds a microbatch for every process of the largest
    run: GPT-2 124M's micro-batch of 64 x 1024 tokens is more than the builtin corpus's whole
    validation split (35,134 tokens)."""
    def probe():
        meta = data.read_meta(plan.data)
        needed = plan.batch_tokens + 1
        for split, info in meta["splits"].items():
            if info["tokens"] < needed:
                raise KitError(
                    f"the {split} split of {plan.data} has {info['tokens']:,} tokens, fewer than "
                    f"a microbatch of {plan.micro_batch} x {plan.seq_len} tokens on each of "
                    f"{plan.processes} processes needs ({needed:,}): prepare the site's data "
                    "(batch-data.sh) and pass it with --data, or lower --micro-batch")
        return f"{plan.data}: " + ", ".join(f"{split} {info['tokens']:,} tokens"
                                            for split, info in meta["splits"].items())
    return check("data", probe)


def check_tokenizer():
    def probe():
        if not data.tokenizer_available_offline():
            raise KitError(f"the GPT-2 tokenizer files are not in {data.tiktoken_cache_dir()}: "
                           "run `python -m coursekit tokenizer fetch` on a login node")
        tokens = data.gpt2_encoding().encode_ordinary("Hello, cluster")
        return f"offline in {data.tiktoken_cache_dir()} ({len(tokens)} tokens for a test phrase)"
    return check("tokenizer", probe)


def check_hf_cache():
    """The Hugging Face cache can be read offline; whether it holds the model lesson 05
    fine-tunes on a GPU is reported, not required (a CPU fine-tunes the kit's own model)."""
    def probe():
        from huggingface_hub import constants, scan_cache_dir
        cache = Path(constants.HF_HUB_CACHE)
        if not cache.exists():
            return f"{cache}: none yet (lesson 05 on a GPU needs openai-community/gpt2 in it)"
        if not os.access(cache, os.R_OK | os.X_OK):
            raise KitError(f"{cache} is not readable by {os.environ.get('USER', 'this user')}")
        repos = {repo.repo_id for repo in scan_cache_dir(cache).repos}
        has_gpt2 = "openai-community/gpt2" in repos
        return (f"{cache}: {len(repos)} repositories; openai-community/gpt2 "
                f"{'cached' if has_gpt2 else 'missing (lesson 05 on a GPU needs it)'}")
    return check("Hugging Face cache", probe)


def first_cell_imports(lesson_source):
    """The import statements of a lesson's first code cell (its py:percent text)."""
    cells = lesson_source.split("\n# %%")
    code = next(cell for cell in cells[1:] if not cell.lstrip(" ").startswith("[markdown]"))
    tree = ast.parse(code.split("\n", 1)[1])
    return [ast.unparse(node) for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom))]


#: Run in a fresh interpreter, offline: each lesson's imports, and what failed
IMPORT_PROBE = """
import json, sys, traceback
failed = {}
for lesson, statements in json.loads(sys.argv[1]).items():
    try:
        exec("\\n".join(statements), {})
    except Exception as err:
        failed[lesson] = f"{type(err).__name__}: {err}"
print(json.dumps(failed))
"""


def check_lesson_imports():
    lessons = {path.stem: first_cell_imports(path.read_text())
               for path in sorted(KIT_ROOT.glob("notebooks/[0-9]*/[0-9]*.py"))}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(KIT_ROOT), str(KIT_ROOT / "solutions")])}
    result = subprocess.run([sys.executable, "-c", IMPORT_PROBE, json.dumps(lessons)],
                            capture_output=True, text=True, env=env, timeout=600)
    if result.returncode != 0:
        return Check("lesson imports", False, last_line(result.stderr))
    failed = json.loads(result.stdout.strip().splitlines()[-1])
    if failed:
        lesson, reason = next(iter(failed.items()))
        return Check("lesson imports", False, f"{len(failed)} of {len(lessons)} lessons fail, "
                                              f"{lesson} first: {reason}")
    return Check("lesson imports", True, f"the first cells of {len(lessons)} lessons import")


ERROR_LINE = re.compile(r"^(error: |\w+(Error|Exception): )")


def first_error(output):
    """The line of a failed run's output that says why: the stage's one-line error or the
    exception that ended it (each process prints its own), else the last line."""
    found = [line for line in output.splitlines() if ERROR_LINE.match(line.strip())]
    return found[0].strip() if found else last_line(output)


def last_line(text):
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


# --- the training runs ---------------------------------------------------------------------------

def planned_runs(plan):
    """(stage, processes) of every run of the plan's stages: one device first, std (the reference)
    leading."""
    planned = [(stage, 1) for stage in ONE_DEVICE if stage in plan.stages]
    if plan.processes > 1:
        n_layer = presets.get_preset(plan.preset).n_layer
        runnable = {"pp": plan.processes <= n_layer,  # a block per stage at least
                    "tp": tensor_parallel_size(plan) > 1}  # a node's GPUs share the heads
        planned += [(stage, plan.processes) for stage in ALL_DEVICES
                    if stage in plan.stages and runnable.get(stage, True)]
    return planned


def tensor_parallel_size(plan):
    """The most of a node's processes that divide the attention heads (lesson 04's rule)."""
    heads = presets.get_preset(plan.preset).n_head
    return max(n for n in range(1, plan.per_node + 1)
               if plan.per_node % n == 0 and heads % n == 0)


def stage_arguments(plan, stage, processes, out):
    args = [str(KIT_ROOT / "solutions" / f"train_gpt2_{stage}.py"), "--preset", plan.preset,
            "--data", plan.data, "--out", str(out), "--device", plan.device,
            "--max-steps", str(plan.steps), "--micro-batch", str(plan.micro_batch),
            "--batch-tokens", str(plan.batch_tokens), "--eval-interval", str(plan.steps),
            "--eval-steps", "2", "--ckpt-interval", str(plan.steps), "--sample-tokens", "0"]
    if stage == "tp":
        args += ["--tp", str(tensor_parallel_size(plan))]
    if stage == "lit":
        nodes = plan.nodes if processes > 1 else 1
        args += ["--devices", str(processes // nodes), "--num-nodes", str(nodes)]
    return args


def launch_command(plan, stage, processes, out):
    """One process alone; on one node torchrun (Lightning starts its own); on several, srun
    starts a torchrun per node (Lightning: a task per device), as the batch files do."""
    args = stage_arguments(plan, stage, processes, out)
    if processes == 1 or (stage == "lit" and plan.nodes == 1):
        return [sys.executable, *args]
    if plan.nodes == 1:
        return [*launch.torchrun(processes), *args]
    if stage == "lit":  # the node's cores shared out among its tasks
        cores = int(os.environ.get("SLURM_CPUS_PER_TASK", plan.per_node)) // plan.per_node
        return [*srun(plan, plan.per_node), f"--cpus-per-task={max(1, cores)}", sys.executable,
                *args]
    return [*srun(plan, 1), *launch.PER_NODE,
            *launch.torchrun(plan.per_node, plan.nodes, plan.master_addr), *args]


def srun(plan, tasks_per_node):
    """srun over the job's nodes with this many tasks on each: the counts given in full, as the
    job's own (SLURM_NTASKS, one task a node) would otherwise cap the step."""
    return ["srun", "--kill-on-bad-exit=1", f"--nodes={plan.nodes}",
            f"--ntasks={plan.nodes * tasks_per_node}", f"--ntasks-per-node={tasks_per_node}"]


def run_environment(plan, processes, stage=None):
    """The environment of a run. One that this host starts alone (not through srun) gets none of
    the Slurm job's task variables, which would tell it that it is one of the job's tasks;
    Lightning under srun reads its tasks per node from the job's, one, unless told the step's."""
    local = processes == 1 or plan.nodes == 1
    env = {name: value for name, value in os.environ.items()
           if not (local and name.startswith("SLURM_"))}
    if stage == "lit" and not local:
        env["SLURM_NTASKS_PER_NODE"] = str(plan.per_node)
    if plan.device == "cpu":  # the cores shared out, as the batch files do
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // processes))
    env["MASTER_ADDR"], env["MASTER_PORT"] = plan.master_addr, str(launch.free_port())
    return env


def train(plan, stage, processes, timeout):
    """Run the stage; the Run with its measurements, or with why it failed."""
    out = Path(plan.out) / "runs" / f"{stage}-{processes}"
    shutil.rmtree(out, ignore_errors=True)  # the self-test's own run of an earlier time
    out.parent.mkdir(parents=True, exist_ok=True)
    run = Run(stage, processes)
    try:
        result = subprocess.run(launch_command(plan, stage, processes, out), capture_output=True,
                                text=True, timeout=timeout, cwd=KIT_ROOT,
                                env=run_environment(plan, processes, stage))
    except subprocess.TimeoutExpired:
        run.detail = f"did not finish within {timeout} s (--timeout)"
        return run
    out.mkdir(parents=True, exist_ok=True)
    (out / "output.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        run.detail = f"exit {result.returncode}: {first_error(result.stdout + result.stderr)}"
        return run
    measure(plan, run, out)
    shutil.rmtree(out / "ckpt", ignore_errors=True)  # measured: the disk space goes back
    return run


def measure(plan, run, out):
    """Fill in the run's numbers from what the stage wrote: metrics.jsonl, config.json and (all
    but lit) memory.json. Step times leave out the first two steps (compiling, warming up)."""
    metrics = runs.read_metrics(out)
    config = runs.read_json(out / "config.json")
    run.losses = [record["loss"] for record in metrics]
    steady = metrics[2:] or metrics
    run.tok_per_s = statistics.median(r["tok_per_s"] for r in steady)
    run.mfu = statistics.median(r["mfu"] for r in steady)
    run.step_ms = statistics.median(r["ms"] for r in steady)
    if config["args"]["compile"]:
        run.compile_s = (metrics[0]["ms"] - run.step_ms) / 1000
    if (out / "memory.json").exists():
        every_rank = runs.read_json(out / "memory.json")
        run.peak_bytes = max(rank["peak"] for rank in every_rank)
        run.peak_kind = every_rank[0]["peak_kind"]
    run.predicted_bytes = predicted_peak(plan, run)
    run.ok, run.detail = len(metrics) == plan.steps, f"{len(metrics)} steps"
    if not 0 < run.mfu <= 1:  # more arithmetic than the device can do: a wrong peak
        run.ok, run.detail = False, (f"its MFU is {run.mfu:.0%}, outside 0-100%: the peak it is "
                                     f"measured against ({config['peak_source']}, "
                                     f"{config['peak_flops'] / 1e12:.2f} TFLOP/s) is wrong")


def predicted_peak(plan, run):
    strategy = MEMORY_STRATEGY[run.stage]
    ranks = tensor_parallel_size(plan) if strategy == "tp" else run.processes
    precision = "fp32" if plan.precision == "fp32" else f"{plan.precision}-mixed"
    model = memory.Model.from_preset(presets.get_preset(plan.preset))
    return memory.per_rank_bytes(model, strategy, ranks, precision, plan.micro_batch,
                                 plan.seq_len)["total"]


def compare_losses(plan, reference, trained):
    """Fail a run whose losses stray from the std stage's further than the precision allows."""
    if not (trained.ok and reference.ok) or trained is reference:
        return
    trained.loss_difference = max(abs(a - b) for a, b in zip(trained.losses, reference.losses))
    if trained.loss_difference > TOLERANCE[plan.precision]:
        trained.ok = False
        trained.detail = (f"its loss differs from the std stage's by up to "
                          f"{trained.loss_difference:.4f} (more than {TOLERANCE[plan.precision]} "
                          f"for {plan.precision})")


# --- all-reduce bandwidth ----------------------------------------------------------------------

def bandwidth(plan, timeout):
    """coursekit.bandwidth over all the devices, NCCL telling which transports it chose
    (NCCL_DEBUG=INFO; its log kept in OUT/allreduce.log): (Check, {ranks, backend, sizes: [...],
    transports} or None)."""
    out = Path(plan.out) / "allreduce.json"
    args = ["-m", "coursekit.bandwidth", "--out", str(out), "--device", plan.device,
            "--largest", str(LARGEST_MESSAGE[plan.device])]
    if plan.nodes == 1:
        command = [*launch.torchrun(plan.per_node), *args]
    else:
        command = [*srun(plan, 1), *launch.PER_NODE,
                   *launch.torchrun(plan.per_node, plan.nodes, plan.master_addr), *args]
    env = {**run_environment(plan, plan.processes), "NCCL_DEBUG": "INFO"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=KIT_ROOT,
                            env=env)
    log = result.stdout + result.stderr
    (Path(plan.out) / "allreduce.log").write_text(log)
    if result.returncode != 0:
        return Check("all-reduce", False, f"exit {result.returncode}: {first_error(log)}"), None
    measured = {**runs.read_json(out), "transports": nccl_transports(log)}
    best = max(size["busbw"] for size in measured["sizes"]) / 1e9
    return bandwidth_verdict(best, plan, measured), measured


#: NCCL's names of its network plugins, as the course names them
NETWORKS = {"AWS Libfabric": "OFI", "Libfabric": "OFI"}


def nccl_transports(log):
    """The transports NCCL's INFO log says it connected the ranks with: P2P/IPC, P2P/CUMEM or SHM
    inside a node; NET/IB (InfiniBand, RoCE), NET/OFI (Slingshot's libfabric plugin) or
    NET/Socket (TCP: no plugin, no InfiniBand) between nodes. Empty under gloo."""
    via = re.findall(r" via (P2P|SHM|NET)/([A-Za-z][A-Za-z ]*[A-Za-z])", log)
    networks = re.findall(r"Using network ([A-Za-z][A-Za-z ]*[A-Za-z])", log)
    return sorted({f"{kind}/{NETWORKS.get(name, name)}" for kind, name in via}
                  | {f"NET/{NETWORKS.get(name, name)}" for name in networks})


def bandwidth_verdict(best_gbps, plan, measured):
    """The all-reduce Check: a bus bandwidth below half of what the site's interconnect gives
    (--expected-busbw, from its profile) fails, with the likely cause."""
    transports = measured["transports"] or [measured["backend"]]
    detail = (f"{measured['ranks']} ranks over {measured['backend']} "
              f"({', '.join(transports)}): bus bandwidth up to {best_gbps:.2f} GB/s")
    if plan.expected_busbw is None:
        return Check("all-reduce", True, detail + " (no expected figure: --expected-busbw)")
    detail += f" of {plan.expected_busbw:g} GB/s expected"
    if best_gbps >= plan.expected_busbw / 2:
        return Check("all-reduce", True, detail)
    return Check("all-reduce", False, f"{detail}, below half: {slow_link_cause(plan, transports)}")


def slow_link_cause(plan, transports):
    """The likeliest reason for a slow all-reduce, from what NCCL connected the ranks with."""
    if "NET/Socket" in transports:
        return ("NCCL fell back to TCP sockets: it found no InfiniBand or OFI (Slingshot) "
                "network; load the site's NCCL plugin (aws-ofi-nccl on Slingshot) as its "
                "documentation says, and check NCCL_SOCKET_IFNAME and NCCL_NET")
    if plan.nodes == 1 and not any(t.startswith("P2P/") for t in transports):
        return ("the GPUs of the node do not talk peer to peer (NCCL_P2P_DISABLE set, or no "
                "NVLink/xGMI between them: nvidia-smi topo -m, rocm-smi --showtopo)")
    return ("a slow, shared or misconfigured link: run nccl-tests' all_reduce_perf on the same "
            "nodes, and compare allreduce.log with the site's documented NCCL settings")


# --- the report --------------------------------------------------------------------------------

def report(plan, checks, trained, allreduce):
    failures = [f"{c.name}: {c.detail}" for c in checks if not c.ok]
    failures += [f"{r.stage} on {r.processes}: {r.detail}" for r in trained if not r.ok]
    return {"ok": not failures, "failures": failures, "host": socket.gethostname(),
            "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "platform": platform.platform(),
            "plan": {**asdict(plan), "processes": plan.processes, "batch_tokens": plan.batch_tokens},
            "checks": [asdict(c) for c in checks],
            "runs": [asdict(r) for r in trained], "allreduce": allreduce}


def binary_size(size):
    """1024 -> "1 KiB", 4 MiB -> "4 MiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:g} {unit}"
        size /= 1024


def gigabytes(value):
    return "-" if value is None else f"{value / 1e9:.2f} GB"


def number(value, text):
    return "-" if value is None else text.format(value)


def markdown(result):
    plan = result["plan"]
    verdict = "**PASS**" if result["ok"] else f"**FAIL**: {result['failures'][0]}"
    lines = [f"# Self-test of {result['host']}, {result['when']}", "", verdict, "",
             "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {c['name']} | {'ok' if c['ok'] else 'FAILED'} | {c['detail']} |"
              for c in result["checks"]]
    lines += ["", f"## Training: {plan['preset']}, micro-batch {plan['micro_batch']} x "
                  f"{plan['seq_len']} tokens, {plan['batch_tokens']:,} tokens per step, "
                  f"{plan['steps']} steps, {plan['precision']}", "",
              "Losses are compared with the std stage's at every step (tolerance "
              f"{TOLERANCE[plan['precision']]}); times are medians after the first two steps.", "",
              "| stage | processes | result | loss vs std | tok/s | MFU | step | compile | "
              "peak memory | predicted |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(
            f"| {r['stage']} | {r['processes']} | {'ok' if r['ok'] else 'FAILED: ' + r['detail']} "
            f"| {number(r['loss_difference'], '{:.1e}')} | {number(r['tok_per_s'], '{:,.0f}')} "
            f"| {number(r['mfu'], '{:.1%}')} | {number(r['step_ms'], '{:.0f} ms')} "
            f"| {number(r['compile_s'], '{:.1f} s')} "
            f"| {gigabytes(r['peak_bytes'])}{' ' + r['peak_kind'] if r['peak_kind'] else ''} "
            f"| {gigabytes(r['predicted_bytes'])} |")
    if result["allreduce"]:
        sizes = result["allreduce"]["sizes"]
        transports = ", ".join(result["allreduce"]["transports"]) or "no NCCL"
        lines += ["", f"## All-reduce: {result['allreduce']['ranks']} ranks, "
                      f"{result['allreduce']['backend']} ({transports})", "",
                  "| message | time | algbw | busbw |", "|---|---|---|---|"]
        lines += [f"| {binary_size(s['bytes'])} | {s['seconds'] * 1e6:,.0f} us "
                  f"| {s['algbw'] / 1e9:.2f} GB/s | {s['busbw'] / 1e9:.2f} GB/s |" for s in sizes]
    return "\n".join(lines) + "\n"


# --- the whole test --------------------------------------------------------------------------------

def run_all(args):
    """Run every check and training run, write the reports; raise KitError if anything failed."""
    plan = make_plan(args)
    out = Path(plan.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"self-test: {plan.processes} process(es) on {plan.nodes} node(s), {plan.device}, "
          f"{plan.preset}, {plan.steps} steps; reports in {out}/", flush=True)
    checks = environment_checks(plan)
    for c in checks:
        print(f"  {c.name:20s} {'ok    ' if c.ok else 'FAILED'} {c.detail}", flush=True)
    trained, allreduce = [], None
    if all(c.ok for c in checks if c.name in ("torch", "devices", "every node", "data",
                                              "tokenizer")):
        for stage, processes in planned_runs(plan):
            trained.append(train(plan, stage, processes, args.timeout))
            compare_losses(plan, trained[0], trained[-1])
            r = trained[-1]
            print(f"  {stage:4s} x{processes:<3d} {'ok    ' if r.ok else 'FAILED'} {r.detail}"
                  + (f" | {r.tok_per_s:,.0f} tok/s, MFU {r.mfu:.1%}" if r.tok_per_s else ""),
                  flush=True)
        if plan.processes > 1:
            allreduce_check, allreduce = bandwidth(plan, args.timeout)
            checks.append(allreduce_check)
            print(f"  {'all-reduce':20s} {'ok    ' if checks[-1].ok else 'FAILED'} "
                  f"{checks[-1].detail}", flush=True)
    result = report(plan, checks, trained, allreduce)
    runs.write_json_atomic(out / "selftest.json", result)
    (out / "selftest.md").write_text(markdown(result))
    if not result["ok"]:
        raise KitError(f"self-test failed: {result['failures'][0]} ({len(result['failures'])} "
                       f"failure(s); {out}/selftest.md has them all)")
    print(f"self-test passed: {out}/selftest.md")
