"""What the kernel sees: devices, software versions, CPU cores, Slurm, prepared data, tokenizer.

The first cell a trainee runs on a new machine (``python -m coursekit envcheck``): it answers "is
this session set up for the course?" before anything slow is started.
"""
import os
import platform
import re
import shutil
import sys
from pathlib import Path

import torch

from coursekit import KIT_ROOT, KitError, data, distributed

SLURM_COMMANDS = ("sbatch", "srun", "squeue", "sinfo", "scontrol")
#: Launchers a trainee may type, which start their own Python: a site module's on PATH, before or
#: instead of the course environment's, runs workers that cannot import the kit. {name: the same
#: program, started by this Python}
LAUNCHERS = {"torchrun": "python -m torch.distributed.run",
             "accelerate": "python -m accelerate.commands.accelerate_cli"}


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


#: Where the job's launcher says which GPUs it gave a process: Slurm's count (--gpus, --gres),
#: and the masks that Slurm (CUDA, ROCm) and site wrappers set
GPU_VARIABLES = ("SLURM_GPUS_ON_NODE", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                 "HIP_VISIBLE_DEVICES")
#: The kernel modules' version files: the driver, which no torch API reports
DRIVER_FILES = {"NVIDIA": "/proc/driver/nvidia/version", "AMD": "/sys/module/amdgpu/version"}


def gpus_given(env=None):
    """The first of GPU_VARIABLES that gives this process GPUs, as NAME=value; None if none
    does (unset or empty, a count of 0, or the masks' "hide them all": -1 and NoDevFiles)."""
    env = os.environ if env is None else env
    for name in GPU_VARIABLES:
        value = env.get(name, "").strip()
        none_given = ("", "-1", "NoDevFiles") + (("0",) if name == "SLURM_GPUS_ON_NODE" else ())
        if value not in none_given:
            return f"{name}={value}"
    return None


def driver():
    """The GPU driver's version line, from the kernel module's own file; None without one."""
    for vendor, path in DRIVER_FILES.items():
        if Path(path).exists():
            return f"{vendor} " + Path(path).read_text().splitlines()[0].strip()
    return None


def gpu_architecture(index):
    """NVIDIA's sm_XY or AMD's gfx name of visible GPU ``index``."""
    props = torch.cuda.get_device_properties(index)
    return props.gcnArchName.split(":")[0] if torch.version.hip else f"sm_{props.major}{props.minor}"


def version(arch):
    """The number of an NVIDIA architecture: sm_80 -> 80, compute_90a -> 90."""
    return int(re.sub(r"\D", "", arch))


def missing_architectures():
    """[(index, name, arch)] of the visible GPUs whose architecture this torch was not built for:
    NVIDIA's sm_XY (a compute_XY of a lower or equal version also runs, JIT-compiled from PTX),
    AMD's gfx name (ROCm's torch lists gfx targets)."""
    built_for = torch.cuda.get_arch_list()
    ptx = [version(a) for a in built_for if a.startswith("compute_")]
    missing = []
    for index in range(torch.cuda.device_count()):
        arch = gpu_architecture(index)
        runs = arch in built_for or (arch.startswith("sm_")
                                     and any(v <= version(arch) for v in ptx))
        if not runs:
            missing.append((index, torch.cuda.get_device_name(index), arch))
    return missing


def gpu_problem(env=None):
    """One line saying why this process cannot train on the GPUs it was given, or None: Slurm
    gave it GPUs and torch sees none (a CPU build of torch, one for another vendor, or one that
    the driver is too old for: make setup's PyPI torch over the site's), or torch was not built
    for their architecture."""
    given = gpus_given(env)
    if given and not torch.cuda.is_available():
        built = (f"CUDA {torch.version.cuda or '-'}, "
                 f"ROCm {getattr(torch.version, 'hip', None) or '-'}")
        return (f"the job was given GPUs ({given}) but torch {torch.__version__} sees none "
                f"({built}; driver {driver() or 'not found'}): use the site's PyTorch module or a "
                "build for its driver, as the site profile's comment says")
    if torch.cuda.is_available():
        missing = missing_architectures()
        if missing:
            index, name, arch = missing[0]
            return (f"torch {torch.__version__} was built for "
                    f"{', '.join(torch.cuda.get_arch_list())}, not for GPU {index}'s {arch} "
                    f"({name}): use the site's PyTorch module")
    return None


def usable_cpu_cores():
    """Cores this process may run on (a Slurm allocation or cgroup can give fewer than the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count()


def site_torch():
    """The line `make setup-site` ends with: where this environment's torch lives, its build and
    the devices it sees; a KitError if it lives inside this environment (pip installed one over
    the site's) rather than among the site's packages."""
    location = Path(torch.__file__).parent
    if location.is_relative_to(Path(sys.prefix)):
        raise KitError(f"torch {torch.__version__} is installed inside {sys.prefix} ({location}), "
                       "not the site's: remove the environment and run make setup-site again with "
                       "the site's PyTorch loaded")
    build = (f"CUDA {torch.version.cuda}" if torch.version.cuda else
             f"ROCm {torch.version.hip}" if getattr(torch.version, "hip", None) else "CPU only")
    seen = [name for kind, _, name in devices() if kind != "cpu"]
    return (f"site torch {torch.__version__} ({build}) from {location}; it sees "
            f"{', '.join(seen) if seen else 'no GPU here (a login node?)'}")


def launcher_python(name):
    """(where ``name`` is on PATH, the Python it starts: its #! line), or None if not found."""
    path = shutil.which(name)
    if path is None:
        return None
    with open(path, "rb") as script:
        first = script.readline().decode(errors="replace").strip()
    return path, first.removeprefix("#!").split()[0] if first.startswith("#!") else None


def files_and_bytes_free(folder):
    """(files, bytes) that may still be created on the file system of ``folder`` (a quota, where
    the site sets one per user, may allow fewer: `quota -s` or the centre's own tool says)."""
    status = os.statvfs(folder)
    return status.f_favail, status.f_bavail * status.f_frsize


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
        "gpus_given": gpus_given(),
        "driver": driver(),
        "arch_list": torch.cuda.get_arch_list() if torch.cuda.is_available() else [],
        "capabilities": [gpu_architecture(i) for i in range(torch.cuda.device_count())]
                        if torch.cuda.is_available() else [],
        "gpu_problem": gpu_problem(),
        "cpu_cores": usable_cpu_cores(),
        "machine_cores": os.cpu_count(),
        "slurm_commands": {cmd: shutil.which(cmd) is not None for cmd in SLURM_COMMANDS},
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "data": prepared_data(root),
        "tokenizer_offline": data.tokenizer_available_offline(),
        "tokenizer_cache": str(data.tiktoken_cache_dir()),
        "launchers": {name: launcher_python(name) for name in LAUNCHERS},
        "hf_home": os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface")),
        "hf_offline": os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"),
        "free_here": files_and_bytes_free(KIT_ROOT),
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
    if info["capabilities"]:
        lines.append(f"gpu architecture  {', '.join(sorted(set(info['capabilities'])))}; torch "
                     f"built for {' '.join(info['arch_list'])}; driver {info['driver'] or '-'}")
    if info["gpus_given"] or info["capabilities"]:
        lines.append(f"gpus given        {info['gpus_given'] or 'none named by Slurm'}: "
                     + ("PROBLEM: " + info["gpu_problem"] if info["gpu_problem"] else "usable"))
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
    lines += [launcher_line(name, found) for name, found in info["launchers"].items()]
    lines.append(f"hugging face      cache {info['hf_home']} (HF_HOME); offline: "
                 f"{yes_no[info['hf_offline']]} (HF_HUB_OFFLINE)")
    files, free = info["free_here"]
    lines.append(f"kit's disk        {free / 1e9:,.1f} GB and {files:,} files free on its file "
                 "system; a per-user quota may allow less: `quota -s` or your centre's tool")
    return "\n".join(lines)


def launcher_line(name, found):
    """Whether the ``name`` on PATH runs this Python, which has the course's environment."""
    if found is None:
        return f"{name:<18}not on PATH"
    path, python = found
    if python == sys.executable:
        return f"{name:<18}{path}: this Python's"
    return (f"{name:<18}{path}: PROBLEM: it runs {python or 'no Python named in its #! line'}, "
            f"not this one ({sys.executable}), whose packages its processes would not see: "
            f"use {LAUNCHERS[name]}")
