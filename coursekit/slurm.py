"""Slurm batch files for every stage script and topology, generated from a site profile.

    batchfiles/sites/<site>.yml                   what a cluster needs (see generic.yml)
    batchfiles/<site>/batch-<stage>-<N>n<G>g.sh   one job: stage script on N nodes x G GPUs
    batchfiles/<site>/batch-data.sh               prepares the training data once
    batchfiles/<site>/batch-images.sh             prepares lesson 08's images once
    batchfiles/<site>/batch-course-files.sh       make course-files: what the lessons read
    batchfiles/<site>/batch-autograde.sh LESSON   autogrades a lesson's submissions
    batchfiles/<site>/batch-mlflow-ui.sh          the MLflow UI over runs/mlflow.db, on 127.0.0.1
    batchfiles/<site>/batch-lab.sh                JupyterLab on a GPU node, on 127.0.0.1, for an
                                                  SSH tunnel (centres without a portal)
    batchfiles/<site>/batch-hpo-1n1g.sh           an Optuna study: a job array, a worker per task
    batchfiles/<site>/batch-hpo-2n<G>g.sh         the same, each trial a DDP run on 2 nodes x G
    batchfiles/<site>/batch-selftest-<N>n<G>g.sh  coursekit selftest: the widest shapes on one
                                                  node and across nodes
    batchfiles/<site>/batch-ray-<N>n<G>g.sh       a Ray cluster of the same shapes, for a driver

How the stages start:
    std   one process:                    srun python train_gpt2_std.py
    lit   one task per GPU, Lightning     srun python train_gpt2_lit.py --devices G --num-nodes N
    other launcher torchrun (the default): one torchrun per node, srun python -m
          torch.distributed.run --nnodes N
          --nproc-per-node G, static rendezvous (node rank from Slurm) on the allocation's first
          host, at a port free there when the job starts;
          launcher srun: one task per GPU, srun python, so that Slurm binds each task to the
          cores next to its GPU (LUMI's CPU-binding masks)
The model-parallel stages need two processes or more: tp runs tensor parallelism inside a node
(--tp: the most GPUs of a node that divide the attention heads) and FSDP across the groups; pp
runs one pipeline stage per process, at most one per transformer block, with at least as many
microbatches per step as stages.
lora  Accelerate: one `accelerate launch` per node (srun bash -c, so that each node passes its own
      $SLURM_NODEID as --machine_rank); the Accelerate config (DDP, FSDP, DeepSpeed ZeRO) is a
      variable chosen at submission: sbatch --export=ALL,ACCELERATE_CONFIG=solutions/accelerate/
      zero3.yaml batch-lora-2n4g.sh
hpo   solutions/hpo_optuna.py in a job array: every array task is a worker of one study, and all
      of them share its journal file on the shared file system; a trial runs as the task's child
      (1n1g) or with srun + torchrun over the task's 2 nodes (2nGg): two levels of parallelism.
On GPU sites every training job samples GPU utilisation and memory every 10 s on its first node
(nvidia-smi or rocm-smi) into RUN_DIR/gpu-<job id>.csv.
Every training job asks Slurm for SIGUSR1 before its time limit (--signal=B:USR1@S), passes it on
to the training processes, which checkpoint and exit, and requeues itself; `--resume` continues.
"""
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from coursekit import KIT_ROOT, KitError, launch, memory, presets, stages

TOPOLOGY = re.compile(r"^(\d+)n(\d+)g$")
VENDORS = ("nvidia", "amd", "none")
LAUNCHERS = ("torchrun", "srun")
#: field: (type, what it holds); every field is required, an empty string or list means "none"
FIELDS = {
    "description": (str, "one line about the cluster"),
    "account": (str, "the #SBATCH --account value, a placeholder the instructor fills in once"),
    "partition": (str, "the partition of its GPU nodes"),
    "qos": (str, "a quality of service, or empty"),
    "cpu_partition": (str, "the partition of the jobs without GPUs (data, images, course files, "
                           "grading, the MLflow UI), or empty: 'partition'"),
    "cpu_setup": (list, "the setup lines of those jobs, where their nodes need their own (another "
                        "architecture's environment), or empty: 'setup'"),
    "shape_partitions": (dict, "NnGg: partition, for shapes the site runs in another partition "
                               "than 'partition' (gpusmall for 1 or 2 GPUs, say), or empty"),
    "test_partition": (str, "the partition of the self-test, a short job, or empty: its shape's"),
    "test_time": (str, "the self-test's time limit, HH:MM:SS"),
    "time": (str, "the time limit of a training job, HH:MM:SS"),
    "max_time": (str, "the longest time limit the partition (and QoS) allows, [D-]HH:MM:SS"),
    "gpu_vendor": (str, f"one of {', '.join(VENDORS)} (none: CPU processes over gloo)"),
    "gpus_per_node": (int, "GPUs in a node (for none: processes a node can run)"),
    "gpu_memory_gb": (int, "GB of memory of each GPU (for none: GB each process may use); the "
                           "batch files use the largest micro-batch that fits it"),
    "cpus_per_gpu": (int, "CPU cores that go with each GPU"),
    "cpus_per_node": (int, "CPU cores Slurm can give the jobs in a node"),
    "memory_per_node": (int, "MB of memory Slurm can give jobs in a node"),
    "gpu_request": (str, "how a job asks for G GPUs per node, with {gpus}, or empty"),
    "topologies": (list, "NnGg shapes to generate, such as 2n4g"),
    "setup": (list, "shell lines that make the course environment available in a job"),
    "env": (dict, "variables every job exports"),
    "launcher": (str, f"how the DDP-style stages start: one of {', '.join(LAUNCHERS)}"),
    "srun_args": (str, "extra srun options for training steps (CPU binding, ...)"),
    "master_addr": (str, "the rendezvous host as the other nodes reach it: {host} (the "
                         "allocation's first node), or a name made from it, such as {host}i "
                         "for JURECA-DC's InfiniBand names"),
    "preset": (str, "the stage scripts' --preset"),
    "data": (str, "the prepared data directory, relative to the kit's root"),
    "data_command": (str, "the command that prepares it"),
    "train_args": (str, "extra stage-script flags, or empty"),
    "finetune_args": (str, "extra flags of the lora stage (solutions/finetune_lora.py), or empty"),
    "hpo_args": (str, "flags of the Optuna study (solutions/hpo_optuna.py): --trials, budgets"),
    "hpo_workers": (int, "array tasks of an hpo job: the study's workers"),
    "images": (str, "lesson 08's prepared images (the resnet stage's --data), relative to the "
                    "kit's root"),
    "images_command": (str, "the command that prepares them"),
    "resnet_args": (str, "extra flags of the resnet stage (solutions/train_resnet_ddp.py), or "
                         "empty"),
    "signal_seconds": (int, "seconds before the time limit at which the job checkpoints"),
    "busbw_intra_node": ((int, float), "the all-reduce bus bandwidth expected between the GPUs of "
                                       "a node, GB/s, or null where none is known"),
    "busbw_inter_node": ((int, float), "the all-reduce bus bandwidth expected across nodes, GB/s, "
                                       "or null where none is known"),
}
#: The fields the self-test compares a measured bus bandwidth with (below half: flagged)
BANDWIDTH_FIELDS = ("busbw_intra_node", "busbw_inter_node")

#: What the text fields may hold. Every value ends up in a batch file, so a character that means
#: something to the shell (a newline, a quote, `$(`, `;`) would let a profile run commands where
#: it meant to set an option: {field: (pattern, what is allowed)}.
SITE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")
ONE_LINE = re.compile(r"[^\x00-\x1f\x7f]*")  # no newline, no control character
SLURM_NAME = (re.compile(r"[A-Za-z0-9_.-]*"), "letters, digits, '_', '.' and '-'")
SLURM_TIME = (re.compile(r"(\d+-)?\d{1,2}:\d{2}:\d{2}"), "HH:MM:SS or D-HH:MM:SS")
SHELL_WORDS = (re.compile(r'[A-Za-z0-9 _./:=,@%+"-]*'),
               "options and words of letters, digits, spaces and _./:=,@%+-, grouped with \"...\"")
DATA_PATH = (re.compile(r"[A-Za-z0-9_./-]+"), "a path of letters, digits and _./-")
TEXT_FIELDS = {
    "description": (ONE_LINE, "one line of text"),
    "account": SLURM_NAME, "partition": SLURM_NAME, "qos": SLURM_NAME,
    "cpu_partition": SLURM_NAME, "test_partition": SLURM_NAME,
    "time": SLURM_TIME, "max_time": SLURM_TIME, "test_time": SLURM_TIME,
    "gpu_request": (re.compile(r"(--[a-z-]+=[A-Za-z0-9_:.,-]*\{gpus\}[A-Za-z0-9_:.,-]*)?"),
                    "one --option=value with {gpus} in the value, or empty"),
    "data": DATA_PATH, "images": DATA_PATH,
    "master_addr": (re.compile(r"[A-Za-z0-9_.-]*\{host\}[A-Za-z0-9_.-]*"),
                    "a host name with {host} in it, such as {host} or {host}i"),
    "srun_args": SHELL_WORDS, "train_args": SHELL_WORDS, "finetune_args": SHELL_WORDS,
    "hpo_args": SHELL_WORDS, "data_command": SHELL_WORDS, "images_command": SHELL_WORDS,
    "resnet_args": SHELL_WORDS,
}
#: The text fields that may be left empty (YAML reads a field with nothing after it as null)
MAY_BE_EMPTY = ("account", "qos", "gpu_request", "srun_args", "train_args", "finetune_args",
                "resnet_args", "cpu_partition", "test_partition")
SETUP_LINE = (ONE_LINE, "one line of shell each")
ENV_NAME = (re.compile(r"[A-Za-z_][A-Za-z0-9_]*"), "a shell variable name")
ENV_VALUE = (re.compile(r"([A-Za-z0-9 _./:=,@%+-]|\$[A-Za-z_][A-Za-z0-9_]*|\$\{[A-Za-z_][A-Za-z0-9_]*\})*"),
             "letters, digits, spaces, _./:=,@%+- and $NAME or ${NAME}")


@dataclass(frozen=True)
class Topology:
    nodes: int
    gpus: int  # per node

    @property
    def name(self):
        return f"{self.nodes}n{self.gpus}g"

    @property
    def processes(self):
        return self.nodes * self.gpus


def sites_dir(root=KIT_ROOT):
    return Path(root) / "batchfiles" / "sites"


def site_names(root=KIT_ROOT):
    return sorted(p.stem for p in sites_dir(root).glob("*.yml"))


def check_site_name(name):
    """A site is a simple name: it becomes a file name and a folder under batchfiles/."""
    if not SITE_NAME.fullmatch(name):
        raise KitError(f"site {name!r}: use a simple name of lower-case letters, digits, '_' and "
                       "'-', such as generic")


def check_text(path, field, value, rule):
    pattern, allowed = rule
    if not pattern.fullmatch(str(value)):
        raise KitError(f"{path}: field '{field}' is {value!r}; it may hold {allowed}")


def check_shell_text(path, profile):
    """Every text that reaches the batch files holds only what its field may contain."""
    for field, rule in TEXT_FIELDS.items():
        check_text(path, field, profile[field], rule)
        if rule is SHELL_WORDS:
            try:
                shlex.split(profile[field])
            except ValueError:
                raise KitError(f"{path}: field '{field}' is {profile[field]!r}; its quotes do "
                               "not pair up") from None
    for field in ("setup", "cpu_setup"):
        for line in profile[field]:
            check_text(path, field, line, SETUP_LINE)
    for shape, partition in profile["shape_partitions"].items():
        check_text(path, f"shape_partitions {shape}", partition, SLURM_NAME)
    for name, value in profile["env"].items():
        check_text(path, "env", name, ENV_NAME)
        check_text(path, f"env {name}", value, ENV_VALUE)


def load_site(name, root=KIT_ROOT):
    """The profile of a site, checked field by field (a KitError names the first bad one)."""
    check_site_name(name)
    path = sites_dir(root) / f"{name}.yml"
    if not path.exists():
        raise KitError(f"no site profile {path}: sites are {', '.join(site_names(root))}")
    try:
        profile = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise KitError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(profile, dict):
        raise KitError(f"{path} must be a mapping of the fields {', '.join(FIELDS)}")
    for field, (kind, meaning) in FIELDS.items():
        if field not in profile:
            raise KitError(f"{path}: field '{field}' is missing ({meaning})")
        if profile[field] is None and (field in MAY_BE_EMPTY or kind in (list, dict)):
            profile[field] = kind() if kind in (list, dict) else ""  # `qos:` with nothing after
        check_yaml_reading(path, field, profile[field])
        if field in BANDWIDTH_FIELDS:
            check_bandwidth(path, field, profile[field])
        elif not isinstance(profile[field], kind) or isinstance(profile[field], bool):
            raise KitError(f"{path}: field '{field}' must be a {kind.__name__} ({meaning}), "
                           f"got {profile[field]!r}")
    unknown = sorted(set(profile) - set(FIELDS))
    if unknown:
        raise KitError(f"{path}: unknown field '{unknown[0]}' (fields: {', '.join(FIELDS)})")
    for field, allowed in (("gpu_vendor", VENDORS), ("launcher", LAUNCHERS)):
        if profile[field] not in allowed:
            raise KitError(f"{path}: field '{field}' is {profile[field]!r}; "
                           f"use one of {', '.join(allowed)}")
    check_shell_text(path, profile)
    check_side_channel(path, profile["env"])
    presets.get_preset(profile["preset"])
    profile["name"] = name
    profile["topologies"] = [parse_topology(t, path, profile["gpus_per_node"])
                             for t in profile["topologies"]]
    listed = {t.name for t in profile["topologies"]}
    for shape in profile["shape_partitions"]:
        if shape not in listed:
            raise KitError(f"{path}: shape_partitions names {shape}, which is not among the "
                           f"topologies ({', '.join(sorted(listed))})")
    return profile


def check_yaml_reading(path, field, value):
    """Catch what YAML makes of unquoted text that looks like something else: a time of day is a
    number of seconds to it (4:00:00 is 14400, read in base 60), and a line of shell holding ': '
    is a mapping."""
    if TEXT_FIELDS.get(field) is SLURM_TIME and isinstance(value, int) \
            and not isinstance(value, bool):
        minutes, seconds = divmod(value, 60)
        hours, minutes = divmod(minutes, 60)
        meant = f"{hours:02d}:{minutes:02d}:{seconds:02d}"
        raise KitError(f"{path}: field '{field}' is {value}: YAML reads an unquoted time as a "
                       f"number of seconds; quote it: {field}: \"{meant}\"")
    if field in ("setup", "cpu_setup") and isinstance(value, list):
        for number, line in enumerate(value, 1):
            if isinstance(line, dict):
                text = ", ".join(f"{key}: {item}" for key, item in line.items())
                raise KitError(f"{path}: field '{field}', line {number} ({text}) holds ': ', which "
                               f"YAML reads as a mapping; quote the line: - \"{text}\"")
            if not isinstance(line, str):
                raise KitError(f"{path}: field '{field}', line {number} is {line!r}; each line "
                               "is one line of shell")


def profile_warnings(profile, root=KIT_ROOT):
    """What a profile that loads may still get wrong at the site: one line each."""
    path = sites_dir(root) / f"{profile['name']}.yml"
    found = [f"{path}: field '{field}' is {value!r}: fill in the placeholder, or the site will "
             "refuse the jobs" for field, value in profile.items()
             if isinstance(value, str) and "CHANGE_ME" in value]
    if slurm_seconds(profile["time"]) > slurm_seconds(profile["max_time"]):
        found.append(f"{path}: field 'time' ({profile['time']}) is longer than 'max_time' "
                     f"({profile['max_time']}): the partition will refuse the training jobs")
    if profile["gpu_vendor"] != "none" and not profile["cpu_partition"]:
        found.append(f"{path}: the jobs without GPUs ({', '.join(CPU_JOBS)}) go to partition "
                     f"'{profile['partition']}': if it takes only jobs that ask for GPUs, name the "
                     "site's CPU partition in 'cpu_partition'")
    return found


def slurm_seconds(text):
    """Seconds of a Slurm time limit, HH:MM:SS or D-HH:MM:SS."""
    days, _, clock = text.rpartition("-")
    hours, minutes, seconds = map(int, clock.split(":"))
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def check_bandwidth(path, field, value):
    """A bus bandwidth is a number of GB/s above 0, or null: none known, so no threshold."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value < math.inf:
        raise KitError(f"{path}: field '{field}' is {value!r}; use the expected all-reduce bus "
                       "bandwidth in GB/s, a number above 0, or null where none is known")


def check_side_channel(path, env):
    """A site that tells NCCL which network interface to use tells gloo too: gloo carries the
    barriers, the checkpoints' plans and the object collectives, and on a node whose hostname
    resolves to a management network it would try that one, and hang."""
    if "NCCL_SOCKET_IFNAME" in env and "GLOO_SOCKET_IFNAME" not in env:
        raise KitError(f"{path}: env sets NCCL_SOCKET_IFNAME but not GLOO_SOCKET_IFNAME; set both "
                       "(to the same interfaces, as a rule)")


def parse_topology(text, path, gpus_per_node):
    match = TOPOLOGY.match(str(text))
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise KitError(f"{path}: topology {text!r} is not of the form NnGg, such as 2n4g")
    topology = Topology(int(match.group(1)), int(match.group(2)))
    if topology.gpus > gpus_per_node:
        raise KitError(f"{path}: topology {text} asks for {topology.gpus} GPUs per node; "
                       f"'gpus_per_node' is {gpus_per_node}")
    return topology


def topology_problem(stage, profile, topology):
    """Why the stage cannot run on the topology, or None: std trains on one device, tp on two
    processes or more, pp on two or more and at most one stage per block."""
    if stage == "std" and topology.processes != 1:
        return "the std stage trains on one device: use 1 node and 1 GPU"
    if stage == "tp" and topology.processes < 2:
        return "the tp stage splits the model over 2 processes or more"
    blocks = presets.get_preset(profile["preset"]).n_layer
    if stage == "pp" and not 2 <= topology.processes <= blocks:
        return f"the pp stage needs 2 to {blocks} processes (one stage per block at most)"
    return None


def topologies_for(stage, profile):
    """The topologies a site gets batch files for: 1n1g for std, else the profile's own that
    the stage can run on."""
    if stage == "std":
        return [Topology(1, 1)]
    return [t for t in profile["topologies"] if topology_problem(stage, profile, t) is None]


def tensor_parallel_size(profile, topology):
    """The largest number of a node's GPUs that splits the attention heads evenly."""
    heads = presets.get_preset(profile["preset"]).n_head
    return max(n for n in range(1, topology.gpus + 1) if topology.gpus % n == 0 and heads % n == 0)


def model_parallel_flags(stage, profile, topology):
    """The stage's flags for the processes the job runs, and the data-parallel replicas left."""
    if stage == "tp":
        tp = tensor_parallel_size(profile, topology)
        return [f"--tp {tp}"], topology.processes // tp
    if stage == "pp":  # every process is a stage: one replica, at least a microbatch per stage
        return pipeline_flags(profile, topology), 1
    return [], topology.processes


def pipeline_flags(profile, topology):
    """The pp stage cuts the minibatch into M microbatches: at least one per stage, more (each
    smaller) until the busiest stage fits the GPU."""
    preset = presets.get_preset(profile["preset"])
    samples = preset.batch_tokens // preset.seq_len
    default = samples // preset.micro_batch
    for microbatches in range(max(default, topology.processes), samples + 1):
        micro = samples // microbatches
        if samples % microbatches == 0 and fits_gpu("pp", profile, topology, micro):
            return [f"--micro-batch {micro}"] if micro != preset.micro_batch else []
    raise too_big("pp", profile, topology)


# --- what fits a GPU's memory ---------------------------------------------------------------------
def memory_model(stage, profile, topology):
    """(strategy, ranks) as coursekit.memory models the stage on the topology. tp is counted
    without the FSDP that shards its replicas too: an upper bound."""
    if stage == "tp":
        return "tp", tensor_parallel_size(profile, topology)
    return {"fsdp": "fsdp", "pp": "pp"}.get(stage, "ddp"), topology.processes


def fits_gpu(stage, profile, topology, micro_batch):
    """Does a process of the stage fit the profile's GPU memory at ``micro_batch``, by
    coursekit.memory's count of its peak, a tenth of the GPU to spare? 16-bit on GPUs."""
    strategy, ranks = memory_model(stage, profile, topology)
    precision = "fp32" if profile["gpu_vendor"] == "none" else "bf16-mixed"
    return memory.micro_batch_fits(presets.get_preset(profile["preset"]), strategy, ranks,
                                   precision, micro_batch, profile["gpu_memory_gb"])


def fitting_micro_batches(stage, profile, topology):
    """The micro-batches up to the preset's that fit the GPU, largest first; none: a KitError."""
    preset = presets.get_preset(profile["preset"])
    fitting = [m for m in range(preset.micro_batch, 0, -1) if fits_gpu(stage, profile, topology, m)]
    if not fitting:
        raise too_big(stage, profile, topology)
    return fitting


def too_big(stage, profile, topology):
    return KitError(f"the {profile['preset']} preset does not fit a {profile['gpu_memory_gb']} GB "
                    f"GPU with the {stage} stage on {topology.name}, even one sample at a time: "
                    "use more GPUs, a sharding stage (fsdp), or a smaller preset")


# --- the text of a batch file -------------------------------------------------------------------
def gpu_place(profile, topology):
    """(partition, time limit) of a job of this shape: its own partition where the site splits
    them by shape, the profile's otherwise."""
    return profile["shape_partitions"].get(topology.name) or profile["partition"], profile["time"]


def test_place(profile, topology):
    """(partition, time limit) of the self-test, a short job: the test partition, if any."""
    return profile["test_partition"] or gpu_place(profile, topology)[0], profile["test_time"]


def cpu_place(profile):
    """(partition, time limit) of a job without GPUs: the CPU partition, if any."""
    return profile["cpu_partition"] or profile["partition"], profile["time"]


def sbatch_lines(profile, place, job_name, nodes, tasks_per_node, cpus_per_task, gpus=0,
                 requeue=True, array_tasks=0, warned=False):
    """#SBATCH lines of a job in ``place`` (partition, time limit); a requeued job (and a
    ``warned`` one) gets SIGUSR1 before its time limit."""
    partition, time_limit = place
    lines = [f"--job-name={job_name}"]
    lines += [f"--{key}={value}" for key, value in (("account", profile["account"]),
                                                    ("partition", partition),
                                                    ("qos", profile["qos"])) if value]
    lines += [f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}",
              f"--cpus-per-task={cpus_per_task}"]
    if gpus and profile["gpu_request"]:
        lines.append(profile["gpu_request"].format(gpus=gpus))
    lines.append(f"--time={time_limit}")
    if array_tasks:  # a log per array task: %A the array's job id, %a the task's index
        lines += [f"--array=0-{array_tasks - 1}", "--output=%x-%A_%a.out"]
    else:
        lines.append("--output=%x-%j.out")
    if requeue:  # a requeued job appends to the same log
        lines += ["--open-mode=append", f"--signal=B:USR1@{profile['signal_seconds']}",
                  "--requeue"]
    elif warned:
        lines.append(f"--signal=B:USR1@{profile['signal_seconds']}")
    return [f"#SBATCH {line}" for line in lines]


def batch_split(stage, profile, topology, replicas):
    """(micro-batch, tokens per step) that split the preset's minibatch evenly over the
    data-parallel replicas, in micro-batches that fit the GPU: the largest up to the preset's that
    does both keeps the recipe (the same tokens per step, only the memory changes). When none
    splits evenly, the minibatch grows to the next multiple of micro-batch x sequence x replicas."""
    preset = presets.get_preset(profile["preset"])
    fitting = fitting_micro_batches(stage, profile, topology)
    per_sample = preset.seq_len * replicas
    for micro in fitting:
        if preset.batch_tokens % (micro * per_sample) == 0:
            return micro, preset.batch_tokens
    per_step = fitting[0] * per_sample
    return fitting[0], -(-preset.batch_tokens // per_step) * per_step


def batch_split_flags(stage, profile, topology, replicas):
    """The flags of batch_split's micro-batch and tokens per step where they are not the preset's."""
    preset = presets.get_preset(profile["preset"])
    micro, batch_tokens = batch_split(stage, profile, topology, replicas)
    flags = [f"--micro-batch {micro}"] if micro != preset.micro_batch else []
    flags += [f"--batch-tokens {batch_tokens}"] if batch_tokens != preset.batch_tokens else []
    return " ".join(flags)


def one_task_per_gpu(stage, profile):
    """Does srun start every training process itself (rather than one launcher per node)?"""
    return stage in ("std", "lit") or (profile["launcher"] == "srun" and stage != "lora")


def launch_command(stage, profile, topology, run_dir):
    """The job step, one shell line per part, continued with backslashes."""
    # one task that fails ends the step at once: the others would wait for it until a timeout
    srun = " ".join(["srun --kill-on-bad-exit=1", profile["srun_args"]]).strip()
    if stage == "lora":  # one task per node: a site's per-GPU binding (launcher srun) fits not
        return accelerate_command("srun" if profile["launcher"] == "srun" else srun, profile,
                                  topology, run_dir)
    if one_task_per_gpu(stage, profile):  # the processes read their rank from Slurm's variables
        launcher = [f"{srun} python"]
    else:  # torchrun passes SIGUSR1 on to its workers: they checkpoint and exit
        options = launch.torchrun_options(topology.gpus, topology.nodes, '"$MASTER_ADDR"',
                                          '"$MASTER_PORT"', launch.BATCH_RESTARTS)
        launcher = [RESTARTS_NOTE + SINGLE_QUOTED_NOTE + TORCHRUN_NOTE
                    + f"{srun} {launch.PER_NODE_SHELL} {TORCHRUN}",
                    " ".join(options[:-2]), " ".join(options[-2:])]
    script, extra = training_arguments(stage, profile, topology, run_dir)
    # a GPU site names its device: a torch without GPU support then fails at once, rather than
    # training on the CPU (ROCm's torch calls its GPUs cuda too)
    extra += ["--device", "cpu" if profile["gpu_vendor"] == "none" else "cuda"]
    if stage == "lit":
        extra += ["--devices", str(topology.gpus), "--num-nodes", str(topology.nodes)]
    return " \\\n    ".join(launcher + [script] + ([" ".join(extra)] if extra else []))


def training_arguments(stage, profile, topology, run_dir):
    """The stage's script with its data and run directory, and its further flags (a list)."""
    if stage == "resnet":
        script = (f"solutions/train_resnet_ddp.py --data {profile['images']} --out {run_dir} "
                  "--resume")
        return script, [f"--workers {loader_workers(profile)}", *profile["resnet_args"].split()]
    script = (f"solutions/train_gpt2_{stage}.py --preset {profile['preset']} "
              f"--data {profile['data']} --out {run_dir} --resume")
    parallel, replicas = model_parallel_flags(stage, profile, topology)
    if stage != "pp":  # pp's flags cut its minibatch into microbatches already
        parallel.append(batch_split_flags(stage, profile, topology, replicas))
    return script, " ".join(parallel).split() + profile["train_args"].split()


#: The most DataLoader workers a resnet process starts: each is a Python process with a copy of
#: the loader's state, and past about this many a GPU's images/s is bound by something else.
MAX_LOADER_WORKERS = 16


def loader_workers(profile):
    """The resnet stage's decoding workers: every core of a process's share but the one that
    runs the training loop, at most MAX_LOADER_WORKERS."""
    return min(profile["cpus_per_gpu"] - 1, MAX_LOADER_WORKERS)


#: torchrun, started by the job's own Python: the `torchrun` on PATH may be a site module's, whose
#: processes would run that module's Python without the course's environment (import coursekit
#: fails); `python -m torch.distributed.run` is the same program.
TORCHRUN = "python -m torch.distributed.run"
TORCHRUN_NOTE = "# torchrun, as the course environment's Python runs it\n"

#: Above a torchrun launch: what --max-restarts does.
RESTARTS_NOTE = ("# a process that crashes restarts the group, which resumes from the last "
                 f"checkpoint, at most\n# {launch.BATCH_RESTARTS} times in this job "
                 "(--max-restarts); a crash after that fails the job, its checkpoint kept.\n"
                 "# An error a restart cannot mend (a bad value, out of memory) fails it at once\n")

#: Above a command whose single quotes keep $SLURM_NODEID for each node's own shell.
SINGLE_QUOTED_NOTE = "# shellcheck disable=SC2016  # each node's shell expands them, not this one\n"


def accelerate_command(srun, profile, topology, run_dir):
    """One `accelerate launch` per node; the single quotes keep $SLURM_NODEID for each node's
    shell. Accelerate's embedded torchrun forwards SIGUSR1 to the workers (PET_SIGNALS_TO_HANDLE,
    exported by the job), as `torchrun --signals-to-handle` does for the other stages."""
    launch = [f"{srun} bash -c 'accelerate launch --config_file \"$ACCELERATE_CONFIG\"",
              f"--num_machines {topology.nodes} --num_processes {topology.processes} "
              '--machine_rank "$SLURM_NODEID"',
              '--main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT"']
    args = [f"solutions/finetune_lora.py --preset {profile['preset']} --data data/instruct "
            f"--out {run_dir} --resume"]
    if profile["finetune_args"]:
        args.append(profile["finetune_args"])
    return SINGLE_QUOTED_NOTE + " \\\n    ".join(launch + args) + "'"


#: Where `make` builds DeepSpeed's op (the Makefile's TORCH_EXTENSIONS_DIR), from the kit's root
TORCH_EXTENSIONS = ".cache/torch_extensions"


def finetune_environment(topology):
    """What the lora stage's job exports: its Accelerate config, offline hub access."""
    config = "single" if topology.processes == 1 else "ddp"
    return ["# the Accelerate config: ddp, fsdp, zero2 or zero3 for 2 processes or more, e.g.",
            "#   sbatch --export=ALL,ACCELERATE_CONFIG=solutions/accelerate/zero3.yaml <this file>",
            f'export ACCELERATE_CONFIG="${{ACCELERATE_CONFIG:-solutions/accelerate/{config}.yaml}}"',
            "# compute nodes are often offline: the model and data set come from the hub cache,",
            "# filled beforehand on a login node (README: Using the kit on a cluster)",
            "export HF_HUB_OFFLINE=1",
            "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            "# DeepSpeed's CPU op (the ZeRO configs), built once by make into the kit's cache:",
            "# not again on GPU time into ~/.cache/torch_extensions",
            f'export TORCH_EXTENSIONS_DIR="$PWD/{TORCH_EXTENSIONS}"',
            ""]


def header(description, profile, site, arguments=""):
    return ["#!/bin/bash",
            "# shellcheck disable=SC1091  # the environment this job sources lives on the cluster",
            f"# {description}",
            f"# Site: {site} ({profile['description']}).",
            f"# Generated by `python -m coursekit batchfiles --site {site}` from "
            f"batchfiles/sites/{site}.yml: change the profile, not this file.",
            f"# Submit from the kit's root: sbatch batchfiles/{site}/<this file>{arguments}"]


def training_job(stage, topology, profile):
    site = profile["name"]
    tasks_per_node = topology.gpus if one_task_per_gpu(stage, profile) else 1
    gpus_per_task = topology.gpus // tasks_per_node
    cpus_per_task = profile["cpus_per_gpu"] * gpus_per_task
    threads = ("$SLURM_CPUS_PER_TASK" if gpus_per_task == 1
               else f"$((SLURM_CPUS_PER_TASK / {gpus_per_task}))")
    job_name = f"{'resnet' if stage == 'resnet' else 'gpt2-' + stage}-{topology.name}"
    run_dir = f"runs/{site}-{stage}-{topology.name}"
    lines = header(f"The {stage} stage on {topology.nodes} node(s) x {topology.gpus} "
                   f"{'GPU(s)' if profile['gpu_vendor'] != 'none' else 'process(es)'}; "
                   f"checkpoints in {run_dir}/, requeued on pre-emption.", profile, site)
    lines += sbatch_lines(profile, gpu_place(profile, topology), job_name, topology.nodes,
                          tasks_per_node, cpus_per_task,
                          topology.gpus)
    lines += [*job_preamble(profile, threads),
              *gpu_monitor(profile, run_dir),
              "# rendezvous: the allocation's first host (where this shell runs), on a port free",
              "# there now, not one derived from the job id, which another user could take first",
              master_addr_line(profile),
              "MASTER_PORT=$(python -m coursekit free-port)",
              "export MASTER_ADDR MASTER_PORT",
              'echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, '
              'rendezvous $MASTER_ADDR:$MASTER_PORT"',
              "",
              *(finetune_environment(topology) if stage == "lora" else []),
              "# Slurm sends SIGUSR1 to this shell before the time limit: pass it on to the training",
              "# processes (every step of the job), let them checkpoint and exit, then requeue.",
              "preempted=0",
              'trap \'preempted=1; scancel --signal=USR1 "$SLURM_JOB_ID"\' USR1',
              f"{launch_command(stage, profile, topology, run_dir)} &",
              "step=$!",
              "status=0",
              'wait "$step" || status=$?',
              'if [ "$preempted" = 1 ]; then',
              '  wait "$step" || true  # the training processes checkpoint and exit',
              '  echo "pre-empted: requeueing job $SLURM_JOB_ID, which resumes from its checkpoint"',
              '  scontrol requeue "$SLURM_JOB_ID"',
              'elif [ "$status" != 0 ]; then',
              f'  echo "training failed (exit $status; the errors above say why); {run_dir}/ckpt '
              'keeps the last checkpoint: sbatch this file again to resume from it" >&2',
              "fi",
              'exit "$status"']
    return "\n".join(lines) + "\n"


GPU_SAMPLERS = {
    "nvidia": "nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used,memory.total "
              "--format=csv -l 10",
    "amd": "while true; do rocm-smi --showuse --showmemuse --csv; sleep 10; done",
}


def gpu_monitor(profile, run_dir):
    """Lines that sample the first node's GPUs in the background until the job ends."""
    if profile["gpu_vendor"] not in GPU_SAMPLERS:
        return []
    return ["# GPU utilisation and memory every 10 s on this (the first) node, while the job runs",
            f"mkdir -p {run_dir} && chmod 700 {run_dir}",
            f'{GPU_SAMPLERS[profile["gpu_vendor"]]} > "{run_dir}/gpu-$SLURM_JOB_ID.csv" &',
            "monitor=$!",
            """trap 'kill "$monitor" 2>/dev/null || true' EXIT""",
            ""]


def cpu_setup(profile):
    """The setup lines of a job without GPUs: their own where the CPU nodes need them."""
    return profile["cpu_setup"] or profile["setup"]


def job_preamble(profile, threads, setup=None):
    """Stop on errors, insist on the kit's root, set up the environment (``setup``: the profile's
    setup lines, or those given)."""
    return ["set -euo pipefail",
            'test -f solutions/train_gpt2_std.py || { echo "submit from the kit\'s root" >&2; exit 2; }',
            *(setup or profile["setup"]),
            *(f'export {name}="{value}"' for name, value in profile["env"].items()),
            *PRIVATE_COMPILE_CACHE,
            *(private_miopen_cache() if profile["gpu_vendor"] == "amd" else []),
            *SRUN_CPUS,
            f"export OMP_NUM_THREADS={threads}  # the CPU cores each process was given"]


#: srun passes the job's --cpus-per-task to its steps only when told to on Slurm 22.05 to 23.02:
#: without it, a step's processes (torchrun, its workers, their compile workers) share one core.
SRUN_CPUS = ["# srun steps get the job's cores per task: Slurm 22.05 stopped passing them on (release",
             "# notes: https://github.com/SchedMD/slurm/blob/slurm-22.05/RELEASE_NOTES; srun(1):",
             "# https://slurm.schedmd.com/srun.html#OPT_SRUN_CPUS_PER_TASK)",
             'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"']


#: torch.compile's caches: a folder of the user's own, checked before the job uses it, not
#: /tmp/torchinductor_$USER, which another user of a node can create first and fill with code.
PRIVATE_COMPILE_CACHE = ["compile_caches=$(python -m coursekit compile-cache)  # yours, mode 0700",
                         'eval "$compile_caches"']


def private_miopen_cache():
    """MIOpen's kernel cache on node-local storage, in a directory with a name no other user can
    guess: a predictable /tmp path could be created first, and filled, by someone else."""
    return ["# MIOpen's kernel cache: node-local, private to this job (mktemp -d: mode 0700)",
            'MIOPEN_USER_DB_PATH=$(mktemp -d "${TMPDIR:-/tmp}/miopen-$SLURM_JOB_ID-XXXXXXXX")',
            'export MIOPEN_USER_DB_PATH MIOPEN_CUSTOM_CACHE_DIR="$MIOPEN_USER_DB_PATH"']


#: What a data job prepares: {file: (job name, the profile's folder field, its command field)}
DATA_JOBS = {"batch-data.sh": ("gpt2-data", "data", "data_command"),
             "batch-images.sh": ("images-data", "images", "images_command")}


#: The jobs that ask for no GPU, in the CPU partition
CPU_JOBS = (*DATA_JOBS, "batch-course-files.sh", "batch-autograde.sh", "batch-mlflow-ui.sh")


def cpu_job(profile, description, job_name, cores, threads, commands, arguments=""):
    """A one-task job without GPUs in the profile's CPU partition, with its setup: ``commands``
    after the preamble, ``threads`` per process."""
    lines = header(description, profile, profile["name"], arguments)
    lines += sbatch_lines(profile, cpu_place(profile), job_name, 1, 1, cores, requeue=False)
    lines += [*job_preamble(profile, threads, cpu_setup(profile)), *commands]
    return "\n".join(lines) + "\n"


def data_job(profile, file):
    """A job that prepares the data the training jobs read, once, with the cores it is given."""
    job_name, folder, command = DATA_JOBS[file]
    return cpu_job(profile, f"Prepares {profile[folder]} once, before the training jobs.",
                   job_name, profile["cpus_per_gpu"], "$SLURM_CPUS_PER_TASK", [
                       "# this job is the one that downloads: the profile's offline switches are "
                       "for training",
                       "unset HF_HUB_OFFLINE HF_DATASETS_OFFLINE",
                       f'{profile[command]} --workers "$SLURM_CPUS_PER_TASK"'])


def course_files_job(profile):
    """`make course-files` on a compute node: lesson 05's base model alone is minutes of a few
    cores, more than many centres allow on a login node (a core, for minutes, under 1 GiB)."""
    return cpu_job(profile, "Makes the files the lessons read, once per checkout (make "
                   "course-files): the corpus, lesson 05's base model, lesson 08's images, lesson "
                   "09's retriever.", "course-files", profile["cpus_per_gpu"],
                   "$SLURM_CPUS_PER_TASK", ["make course-files"])


#: What an instructor gives the autograde job: the lesson, and where the course is if elsewhere
AUTOGRADE_USAGE = "LESSON [--root COURSE_DIR]"


def autograde_job(profile):
    """`coursekit autograde` on a compute node, on two cores (nbgrader, and the trainee's kernel
    it grades): a class of 80 is several minutes of a core, and each notebook's kernel runs in its
    own sandbox there (coursekit/sandbox.py)."""
    usage = f"sbatch batchfiles/{profile['name']}/batch-autograde.sh {AUTOGRADE_USAGE}"
    return cpu_job(profile, "Autogrades a lesson's submissions in the course directory, then "
                   "prints the class summary.", "autograde", 2, "1", [
                       f'test $# -gt 0 || {{ echo "usage: {usage}" >&2; exit 2; }}',
                       'python -m coursekit autograde "$@"'], arguments=f" {AUTOGRADE_USAGE}")


def mlflow_ui_job(profile):
    """The MLflow UI as a job, bound to the compute node's 127.0.0.1 and behind a password only
    the job's owner can read (coursekit/mlflow_server.py): other users of the node reach
    127.0.0.1 too. The trainee tunnels to it through the login node."""
    return cpu_job(profile, "The MLflow UI over the runs' tracking store (runs/mlflow.db), on the "
                   "compute node's 127.0.0.1 only, behind your own password.", "mlflow-ui", 1,
                   "$SLURM_CPUS_PER_TASK", [
                       'echo "scancel $SLURM_JOB_ID when done."',
                       "# the port: one free now, not one another user can work out; the "
                       "password: in",
                       "# runs/mlflow-server/password, which only you can read (this log names "
                       "the file)",
                       'exec python -m coursekit mlflow-server --artifacts '
                       '"$PWD/runs/mlartifacts"'])


#: GPUs of a lab session (batch-lab.sh): the lessons' multi-process demonstrations start 2
LAB_GPUS = 2


def lab_job(profile):
    """JupyterLab on a GPU node for the lessons, where a centre has no portal: on the node's
    127.0.0.1, behind a token only the job's owner can read (coursekit/lab_job.py), reached
    through an SSH tunnel that the log prints. Not requeued: at the time limit Slurm's SIGTERM
    stops JupyterLab, which shuts its kernels down."""
    topology = Topology(1, min(LAB_GPUS, profile["gpus_per_node"]))
    lines = header(f"JupyterLab on {topology.gpus} "
                   f"{'GPU(s)' if profile['gpu_vendor'] != 'none' else 'process(es)'} of a "
                   "compute node, on its 127.0.0.1 only, behind a token of your own: the log "
                   "says how to reach it through an SSH tunnel.", profile, profile["name"])
    lines += sbatch_lines(profile, gpu_place(profile, topology), "lab", 1, 1,
                          profile["cpus_per_gpu"] * topology.gpus, topology.gpus, requeue=False)
    lines += [*job_preamble(profile, "$SLURM_CPUS_PER_TASK"),
              "# the port: one free now; the token: in runs/lab/token, which only you can read",
              "# (this log names the file and never holds the token)",
              "exec python -m coursekit lab --tunnel"]
    return "\n".join(lines) + "\n"


def hpo_topologies(profile):
    """One GPU per trial, and each trial on 2 nodes (the most GPUs of the site's 2-node shapes)."""
    two_nodes = [t for t in profile["topologies"] if t.nodes == 2]
    return [Topology(1, 1)] + ([max(two_nodes, key=lambda t: t.gpus)] if two_nodes else [])


def hpo_job(profile, topology):
    """A job array of study workers; the trap passes the time-limit signal to the worker, which
    stops its trial (checkpointed, queued again in the study) before the task requeues."""
    site = profile["name"]
    study_dir = f"runs/{site}-hpo-{topology.name}"
    lines = header(f"An Optuna study in {study_dir}/: {profile['hpo_workers']} array tasks, each a "
                   f"worker; every trial on {topology.nodes} node(s) x {topology.gpus} "
                   f"{'GPU(s)' if profile['gpu_vendor'] != 'none' else 'process(es)'}.",
                   profile, site)
    lines += ["# More or fewer workers at submission: sbatch --array=0-7%4 <this file> (at most 4 at "
              "once)"]
    lines += sbatch_lines(profile, gpu_place(profile, topology), f"gpt2-hpo-{topology.name}",
                          topology.nodes, 1,
                          profile["cpus_per_gpu"] * topology.gpus, topology.gpus,
                          array_tasks=profile["hpo_workers"])
    driver = [f"python solutions/hpo_optuna.py --preset {profile['preset']} "
              f"--data {profile['data']} --study-dir {study_dir}"]
    if topology.nodes > 1:
        srun_args = profile["srun_args"] if profile["launcher"] == "torchrun" else ""
        driver.append(f"--nodes {topology.nodes} --nproc-per-node {topology.gpus}"
                      + (f" --srun-args='{srun_args}'" if srun_args else ""))
    # what a trial's processes hold: a divisor of the preset's, so that the study's batch sizes
    # (multiples of micro-batch x sequence x processes) stay those of the preset's
    preset_micro = presets.get_preset(profile["preset"]).micro_batch
    micro_batch = next(m for m in fitting_micro_batches("ddp", profile, topology)
                       if preset_micro % m == 0)
    if micro_batch != preset_micro:
        driver.append(f"--micro-batch {micro_batch}")
    driver.append(profile["hpo_args"])
    threads = ("$SLURM_CPUS_PER_TASK" if topology.gpus == 1
               else f"$((SLURM_CPUS_PER_TASK / {topology.gpus}))")  # a trial's G processes a node
    lines += [*job_preamble(profile, threads),
              *(["# a trial's processes meet at the allocation's first host, where this shell runs",
                 master_addr_line(profile), "export MASTER_ADDR"] if topology.nodes > 1 else []),
              'echo "array task $SLURM_ARRAY_TASK_ID: job $SLURM_JOB_ID (restart '
              '${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST"',
              "",
              "# Slurm sends SIGUSR1 to this shell before the time limit: the worker stops its trial",
              "# (which checkpoints and waits in the study to be resumed), then the task requeues.",
              "preempted=0",
              """trap 'preempted=1; kill -USR1 "$worker"' USR1""",
              " \\\n    ".join(driver) + " &",
              "worker=$!",
              "status=0",
              'wait "$worker" || status=$?',
              'if [ "$preempted" = 1 ]; then',
              '  wait "$worker" || true',
              '  echo "pre-empted: requeueing array task $SLURM_ARRAY_TASK_ID ($SLURM_JOB_ID)"',
              '  scontrol requeue "$SLURM_JOB_ID"',
              "fi",
              'exit "$status"']
    return "\n".join(lines) + "\n"


#: The allocation's first host, where the batch script runs, as Slurm names it
FIRST_HOST = '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)'


def master_addr_line(profile):
    """MASTER_ADDR: the first host, or the name the profile makes from it (its InfiniBand one)."""
    return f"MASTER_ADDR={profile['master_addr'].replace('{host}', FIRST_HOST)}"


def selftest_job(profile, topology):
    """`python -m coursekit selftest` on every GPU of one node, or of two."""
    site = profile["name"]
    out = f"runs/{site}-selftest-{topology.name}"
    lines = header(f"The self-test on {topology.nodes} node(s) x {topology.gpus} "
                   f"{'GPU(s)' if profile['gpu_vendor'] != 'none' else 'process(es)'}: every "
                   f"stage on one device and on all, all-reduce bandwidth, offline files; the "
                   f"report in {out}/selftest.md.", profile, site)
    lines += [f"# It trains on {profile['data']}, which batch-data.sh prepares: submit that first."]
    lines += sbatch_lines(profile, test_place(profile, topology), f"selftest-{topology.name}",
                          topology.nodes, 1,
                          profile["cpus_per_gpu"] * topology.gpus, topology.gpus, requeue=False)
    threads = ("$SLURM_CPUS_PER_TASK" if topology.gpus == 1
               else f"$((SLURM_CPUS_PER_TASK / {topology.gpus}))")
    lines += [*job_preamble(profile, threads),
              "# runs on several nodes meet at the allocation's first host, where this shell runs",
              master_addr_line(profile),
              "export MASTER_ADDR",
              f"python -m coursekit selftest --nodes {topology.nodes} --per-node {topology.gpus} "
              f"--preset {profile['preset']} --data {profile['data']} --out {out} "
              f"{selftest_flags(profile, topology)}"]
    return "\n".join(lines) + "\n"


def selftest_flags(profile, topology):
    """The self-test trains at the ddp job's micro-batch of the same shape (what the course's jobs
    will hold), and flags an all-reduce slower than half the profile's bus bandwidth: inside a
    node on one, across nodes on several."""
    micro, _ = batch_split("ddp", profile, topology, topology.processes)
    flags = [f"--micro-batch {micro}"]
    busbw = profile["busbw_inter_node" if topology.nodes > 1 else "busbw_intra_node"]
    if busbw is not None:
        flags.append(f"--expected-busbw {busbw:g}")
    return " ".join(flags) + selftest_steps(profile)


def ray_job(profile, topology):
    """A Ray cluster on the allocation's nodes, behind a token only the job's owner can read, and
    a driver script on it: the arguments after the file name (sbatch FILE script.py ...)."""
    site = profile["name"]
    run_dir = f"runs/{site}-ray-{topology.name}"
    gpus = f" --gpus {topology.gpus}" if profile["gpu_vendor"] != "none" else ""
    node = f'python -m coursekit ray-node --cpus "$SLURM_CPUS_PER_TASK"{gpus}'
    lines = header(f"A Ray cluster on {topology.nodes} node(s) x {topology.gpus} "
                   f"{'GPU(s)' if profile['gpu_vendor'] != 'none' else 'process(es)'}, usable "
                   "by you alone, running a driver script: sbatch <this file> script.py [its "
                   "arguments]", profile, site)
    lines += ["# (with no script, the job starts the cluster, runs a task on every node, and ends)"]
    lines += sbatch_lines(profile, gpu_place(profile, topology), f"ray-{topology.name}",
                          topology.nodes, 1,
                          profile["cpus_per_gpu"] * topology.gpus, topology.gpus, requeue=False,
                          warned=True)
    lines += [*job_preamble(profile, "$SLURM_CPUS_PER_TASK"),
              f"mkdir -p {run_dir} && chmod 700 {run_dir}",
              "# Ray runs whatever code a client sends it: every Ray process of this job demands a",
              "# token, from a file only you can read, made anew for each job",
              f'export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$PWD/{run_dir}/ray-token"',
              """(umask 077 && python -c 'import secrets; print(secrets.token_hex(32))' """
              """> "$RAY_AUTH_TOKEN_PATH")""",
              "# the head on the allocation's first host (where this shell runs), on a port free",
              "# there now; the driver's ray.init() finds it in RAY_ADDRESS",
              'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
              'RAY_ADDRESS="$head:$(python -m coursekit free-port)"',
              "export RAY_ADDRESS",
              "# each node a step of the job, in the foreground until the job stops it",
              f'srun --nodes=1 --ntasks=1 -w "$head" {node} --head --port "${{RAY_ADDRESS##*:}}" &']
    if topology.nodes > 1:
        others = topology.nodes - 1
        lines.append(f'srun --nodes={others} --ntasks={others} --exclude="$head" {node} '
                     '--address "$RAY_ADDRESS" &')
    lines += ["# however the job ends, stop every node (SIGTERM to the steps) and wait for them",
              """trap 'scancel --signal=TERM "$SLURM_JOB_ID"; wait' EXIT""",
              f'python -m coursekit ray-nodes --address "$RAY_ADDRESS" --expect {topology.nodes}',
              'if [ "$#" = 0 ]; then exit 0; fi',
              "# Slurm sends SIGUSR1 to this shell before the time limit: pass it to the driver, which",
              "# checkpoints and stops; then the cluster stops",
              "signalled=0",
              """trap 'signalled=1; kill -USR1 "$driver"' USR1""",
              'python "$@" &',
              "driver=$!",
              "status=0",
              'wait "$driver" || status=$?',
              'if [ "$signalled" = 1 ]; then  # the signal ended the wait, not the driver',
              '  status=0',
              '  wait "$driver" || status=$?',
              "fi",
              'exit "$status"']
    return "\n".join(lines) + "\n"


def selftest_steps(profile):
    """A site whose training jobs run a few steps (--max-steps in train_args: the test cluster)
    self-tests with as few; others with the self-test's default."""
    steps = re.search(r"--max-steps[ =](\d+)", profile["train_args"])
    return f" --steps {steps[1]}" if steps else ""


def training_stages(root=KIT_ROOT):
    """The stages a training job can run: the GPT stages of solutions/, lesson 05's fine-tuning
    (lora) and lesson 08's image classifier (resnet)."""
    return [*stages.names(root), "lora", "resnet"]


def expected_files(site, root=KIT_ROOT):
    """{path relative to the kit's root: text} of every batch file of a site."""
    profile = load_site(site, root)
    files = {f"batchfiles/{site}/{file}": data_job(profile, file) for file in DATA_JOBS}
    files[f"batchfiles/{site}/batch-course-files.sh"] = course_files_job(profile)
    files[f"batchfiles/{site}/batch-autograde.sh"] = autograde_job(profile)
    files[f"batchfiles/{site}/batch-mlflow-ui.sh"] = mlflow_ui_job(profile)
    files[f"batchfiles/{site}/batch-lab.sh"] = lab_job(profile)
    for stage in training_stages(root):
        for topology in topologies_for(stage, profile):
            files[f"batchfiles/{site}/batch-{stage}-{topology.name}.sh"] = \
                training_job(stage, topology, profile)
    for topology in hpo_topologies(profile):
        files[f"batchfiles/{site}/batch-hpo-{topology.name}.sh"] = hpo_job(profile, topology)
    for topology in widest_topologies(profile):
        files[f"batchfiles/{site}/batch-selftest-{topology.name}.sh"] = \
            selftest_job(profile, topology)
        files[f"batchfiles/{site}/batch-ray-{topology.name}.sh"] = ray_job(profile, topology)
    return files


def widest_topologies(profile):
    """The self-test's and Ray's shapes: of the profile's topologies, the one with the most GPUs
    on one node, and the one with the most across nodes (the fewest nodes of equals), if any.
    Never a shape the profile does not list: a site may cap the GPUs of a job below two whole
    nodes' (CSC's Roihu: 4 GPUs a node, 4 a job in gpumedium)."""
    widest = []
    for across_nodes in (False, True):
        shapes = [t for t in profile["topologies"] if (t.nodes > 1) == across_nodes]
        if shapes:
            widest.append(max(shapes, key=lambda t: (t.processes, -t.nodes)))
    return widest


def write(site, root=KIT_ROOT):
    """Write a site's batch files (and remove stale ones); return their paths."""
    files = expected_files(site, root)
    folder = Path(root) / "batchfiles" / site
    folder.mkdir(parents=True, exist_ok=True)
    for stale in set(folder.glob("*.sh")) - {Path(root) / name for name in files}:
        stale.unlink()
    for name, text in files.items():
        path = Path(root) / name
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        tmp.replace(path)
    return sorted(files)


def check(root=KIT_ROOT):
    """One line per committed batch file that differs from, or is missing in, the generator's
    output, or that the generator would not write."""
    problems = []
    for site in site_names(root):
        files = expected_files(site, root)
        for name, text in files.items():
            path = Path(root) / name
            if not path.exists():
                problems.append(f"{name} is missing")
            elif path.read_text() != text:
                problems.append(f"{name} differs from the generator's output")
        extra = {str(p.relative_to(root)) for p in (Path(root) / "batchfiles" / site).glob("*.sh")}
        problems += [f"{name} is not generated from {site}.yml" for name in sorted(extra - set(files))]
    return problems
