"""How every multi-process stage starts: its place in the job, its device, its process group.

    rank, world_size, device = distributed.setup(args.device)

torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or Slurm's `srun python` (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID) says where the process is. Its device comes from its local rank and is made the
current one before the group starts, so that NCCL's communicator and every bare "cuda" tensor
land on this process's GPU rather than all on GPU 0. The group then starts with the backend for
that device and, on GPUs, its device_id. Its collectives give up after KIT_DIST_TIMEOUT seconds
(600 by default, NCCL's own) rather than wait for ever for a process that hung or died.
"""
import gc
import inspect
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from coursekit import KitError
from coursekit.faults import TIMEOUT_VARIABLE

#: The oldest torch the stages run on: FSDP2's fully_shard, get_total_norm and the pipelining
#: schedules' scale_grads are public from 2.6. Clusters bring their own torch: envcheck says it.
MIN_TORCH = (2, 6)
DEFAULT_TIMEOUT_S = 600
#: gloo for tensors on the CPU (also every group on a CPU), the vendor's library for GPU tensors
BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl", "xpu": "cpu:gloo,xpu:xccl"}
ACCELERATORS = {"cuda": "CUDA/ROCm GPU", "xpu": "Intel GPU"}  # in the order --device auto tries


def torch_version(text=torch.__version__):
    """(major, minor) of a torch version string such as "2.6.0+cu124"."""
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch(found=torch.__version__):
    if torch_version(found) < MIN_TORCH:
        raise KitError(f"torch {found} is too old: the course's stages need torch >= "
                       f"{'.'.join(map(str, MIN_TORCH))} (pip install 'torch>=2.6', or load a "
                       "newer module)")


def check_pipeline_schedules(schedule=None):
    """The pp stage needs its schedule's step(return_outputs=False) and eval(): without them the
    last stage keeps every microbatch's logits to return them, out of memory at the first
    evaluation on a GPU. Both came after MIN_TORCH, so they are looked for, not a version."""
    if schedule is None:
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle as schedule
    if "return_outputs" not in inspect.signature(schedule.step).parameters \
            or not hasattr(schedule, "eval"):
        raise KitError(f"torch {torch.__version__}'s pipeline schedules have no "
                       "step(return_outputs=False) or eval(), which keep the last stage from "
                       "holding every microbatch's logits: the pp stage needs a newer torch "
                       "(the kit is tested with the one requirements.txt pins)")


def place():
    """(rank, world_size, local_rank) as torchrun or Slurm's srun says; (0, 1, 0) alone."""
    env = os.environ
    return (int(env.get("RANK", env.get("SLURM_PROCID", 0))),
            int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1))),
            int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0))))


def processes_per_node():
    """How many processes of the job run on this node (torchrun's or Slurm's count)."""
    env = os.environ
    return int(env.get("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", place()[1])))


def visible_devices():
    """{kind: how many} of the accelerators this process can see."""
    counts = {"cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        counts["xpu"] = torch.xpu.device_count()
    return counts


def device_for(local_rank, requested="auto", visible=None):
    """The device of the process with this local rank: one accelerator per process, the
    local_rank-th this process sees, or the only one where a process sees one (a site that
    binds each task to its GPU: --gpus-per-task=1, LUMI's select_gpu wrapper, which sets
    ROCR_VISIBLE_DEVICES to the task's local id); ``requested`` is --device (auto, cuda, xpu or
    cpu)."""
    visible = visible_devices() if visible is None else visible
    kind = requested
    if requested == "auto":
        kind = next((k for k in ACCELERATORS if visible.get(k)), "cpu")
    if kind == "cpu":
        return torch.device("cpu")
    count = visible.get(kind, 0)
    if count == 0:
        raise KitError(f"--device {kind}: no {ACCELERATORS[kind]} is visible to this process "
                       "(use --device auto or cpu)")
    if count == 1:
        return torch.device(kind, 0)
    if local_rank >= count:
        raise KitError(f"local rank {local_rank} has no {kind} device of its own: this process "
                       f"sees {count}; start at most {count} processes per node, or use "
                       "--device cpu")
    return torch.device(kind, local_rank)


def use_device(device):
    """Make ``device`` the current one of its kind (what a bare "cuda" means in this process)."""
    if device.type != "cpu":
        getattr(torch, device.type).set_device(device)


def dist_timeout():
    """How long a collective waits for the other processes: KIT_DIST_TIMEOUT seconds."""
    text = os.environ.get(TIMEOUT_VARIABLE, str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0
    if not seconds > 0:
        raise KitError(f"{TIMEOUT_VARIABLE}={text!r}: expected a number of seconds > 0")
    return timedelta(seconds=seconds)


def rendezvous_store(rank, world_size, timeout):
    """The key-value store where a group's processes meet: torchrun's at MASTER_ADDR:MASTER_PORT
    (its agent on the first node holds it), one that rank 0 holds under `srun python`, or one in
    memory for a group of one. Each launch keeps its keys apart: torchrun's static rendezvous
    keeps one store for all of its --max-restarts, and a process of a restarted group could
    otherwise read the address a process of the crashed one left there (torch 2.13)."""
    if world_size == 1:
        return dist.HashStore()
    agent_holds_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_holds_it, timeout=timeout,
                          multi_tenant=True)
    launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"launch_{launch}", store)


#: What gloo raises when a peer's address in the store is not one a process wrote: C++'s length
#: and allocation errors on a size read from the bytes (ValueError "basic_string::_M_create",
#: MemoryError "std::bad_alloc"), or one of its own checks ("[enforce fail at ...]").
UNREADABLE_START = (ValueError, MemoryError)
GLOO_CHECK = "enforce fail"


def start_group(device, rank, world_size, timeout):
    """init_process_group on the launch's store. The store takes any connection (torch has no
    password for it), so another user of the node can write garbage over the addresses the
    processes leave there for each other: gloo then fails with C++'s error, a traceback, and
    torchrun would start the group again into the same store. Instead: one line, no restart."""
    store = rendezvous_store(rank, world_size, timeout)
    try:
        dist.init_process_group(BACKENDS[device.type], rank=rank, world_size=world_size,
                                timeout=timeout, store=store,
                                device_id=device if device.type != "cpu" else None)
    except (*UNREADABLE_START, RuntimeError) as err:
        if isinstance(err, RuntimeError) and GLOO_CHECK not in str(err):
            raise  # a timeout or a lost peer: faults says which, and a restart may mend it
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        cause = str(err).splitlines()[0][:200]
        raise KitError(f"rank {rank} could not start its process group from what it read in the "
                       f"launch's store at {where} ({type(err).__name__}: {cause}): the store "
                       "accepts any connection, so another process on this node may have written "
                       "into it; see the cluster chapter, 'What PyTorch assumes'") from err


def setup(requested_device="auto"):
    """Start this process's part of the job: (rank, world_size, device). Every process but rank
    0 prints nothing (one log, rank 0's). A single process gets a group of one, so that the same
    code (DDP, sharding, sharded checkpoints) runs alone."""
    check_torch()
    rank, world_size, local_rank = place()
    device = device_for(local_rank, requested_device)
    use_device(device)  # before the group: NCCL sets up its communicator on the current device
    sys.stdout = open(os.devnull, "w") if rank else sys.stdout
    timeout = dist_timeout()
    start_group(device, rank, world_size, timeout)
    print(f"{world_size} processes, backend {BACKENDS[device.type]}, rank 0 on {device}")
    return rank, world_size, device


def all_reduce_mean(tensor):
    """The mean over every process (gloo has no AVG: divide by the world size, then sum)."""
    dist.all_reduce(tensor.div_(dist.get_world_size()), op=dist.ReduceOp.SUM)
    return tensor


def finish():
    """Wait for every process, free what still holds the group (DDP's reducer: a hang at exit
    with compile and gloo otherwise), then end the group."""
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
