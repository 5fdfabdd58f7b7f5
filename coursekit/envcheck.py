"""What the kernel sees: devices, software versions, CPU cores, Slurm, prepared data, tokenizer.

The first cell a trainee runs on a new machine (``python -m coursekit envcheck``): it answers "is
this session set up for the course?" before anything slow is started.
"""
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

from coursekit import KIT_ROOT, data, distributed

SLURM_COMMANDS = ("sbatch", "srun", "squeue", "sinfo", "scontrol")


def devices():
    """(kind, index, name) of every accelerator torch can use, CPUs last."""
    found = []
    if torch.cuda.is_available():  # NVIDIA, and AMD through ROCm's HIP build of the cuda API
        found += [("cuda", i, torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        found += [("xpu", i, torch.xpu.get_device_name(i)) for i in range(torch.xpu.device_count())]
    if torch.backends.mps.is_available():
        found.append(("mps", 0, "Apple GPU"))
    found.append(("cpu", 0, platform.processor() or platform.machine()))
    return found


def usable_cpu_cores():
    """Cores this process may run on (a Slurm allocation or cgroup can give fewer than the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count()


def prepared_data(root=None):
    """{directory: meta.json contents} of every prepared data directory under ./data and the kit's data/."""
    roots = [Path(root)] if root else [Path.cwd(), KIT_ROOT]
    found = {}
    for meta_path in sorted({m.absolute() for r in roots for m in r.glob("data/*/meta.json")}):
        found[str(meta_path.parent)] = data.read_meta(meta_path.parent)
    return found


def collect(root=None):
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_needed": ".".join(map(str, distributed.MIN_TORCH)),
        "torch_new_enough": distributed.torch_version() >= distributed.MIN_TORCH,
        "cuda": torch.version.cuda,
        "rocm": getattr(torch.version, "hip", None),
        "devices": devices(),
        "cpu_cores": usable_cpu_cores(),
        "machine_cores": os.cpu_count(),
        "slurm_commands": {cmd: shutil.which(cmd) is not None for cmd in SLURM_COMMANDS},
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "data": prepared_data(root),
        "tokenizer_offline": data.tokenizer_available_offline(),
        "tokenizer_cache": str(data.tiktoken_cache_dir()),
    }


#: What a prepared split counts: a pretraining corpus, an instruction set (lesson 05), images
#: (lesson 08)
SIZE_UNITS = ("tokens", "examples", "images")


def size_of(split):
    """A split's size, in the unit its data set counts."""
    unit = next(unit for unit in SIZE_UNITS if unit in split)
    return f"{split[unit]:,} {unit}"


def report(info):
    """The collected facts as a short, aligned text report."""
    yes_no = {True: "yes", False: "no"}
    lines = [
        f"python            {info['python']}",
        f"torch             {info['torch']} (CUDA {info['cuda'] or '-'}, ROCm {info['rocm'] or '-'}; "
        f"the stages need >= {info['torch_needed']}"
        f"{'' if info['torch_new_enough'] else ': TOO OLD, load or install a newer torch'})",
        f"cpu cores         {info['cpu_cores']} usable of {info['machine_cores']}",
    ]
    lines += [f"device            {kind}:{index}  {name}" for kind, index, name in info["devices"]]
    slurm = info["slurm_commands"]
    present = [cmd for cmd, ok in slurm.items() if ok]
    lines.append(f"slurm commands    {', '.join(present) if present else 'none'}"
                 + (f" (inside job {info['slurm_job']})" if info["slurm_job"] else ""))
    if info["data"]:
        for directory, meta in info["data"].items():
            lines.append(f"prepared data     {directory}: {meta['source']}, "
                         + ", ".join(f"{split} {size_of(s)}" for split, s in meta["splits"].items()))
    else:
        lines.append(f"prepared data     none under ./data or the kit's data/ (run `{data.prepare_command('data/builtin')}`)")
    lines.append(f"gpt-2 tokenizer   offline: {yes_no[info['tokenizer_offline']]} "
                 f"({info['tokenizer_cache']})")
    return "\n".join(lines)
