"""``python -m coursekit plan``: the compute and the storage a class needs, for a reservation or an
allocation request (book/instructor.md, "Before, during and after the course").

A course plan of the instructor guide (one hour, one day, three days, five days) says which batch
jobs each trainee submits on which day. This module turns it, for a site's profile and a class
size, into GPU-hours, node-hours, the nodes a day's reservation needs, and the storage of the run
directories each trainee fills.

How long a job runs:
- with a self-test's report (``selftest.json`` from the site's batch-selftest job), a GPT stage's
  job trains its steps at the tokens per second per GPU that the self-test measured for that
  stage on the most processes it ran (communication included), times the job's GPUs, and never
  longer than its time limit;
- otherwise, and for the jobs the self-test does not measure (LoRA, the ResNet, Ray), the job's
  time limit: what the scheduler books for it and the most it can be charged.
"""
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from coursekit import KitError, data, memory, presets, runs, slurm

BYTES_PER_CHECKPOINTED_PARAMETER = 4 * (1 + memory.ADAM_STATES)  # fp32 weights, AdamW's m and v
BYTES_PER_MODEL_PARAMETER = 4  # a fine-tuned model saved in fp32 (the lora stage's model/)
BYTES_PER_RESNET_PARAMETER = 4 * 2  # fp32 weights, SGD's momentum (solutions/train_resnet_ddp.py)
RESNET_CLASSES = 1000  # the most a site's images are likely to have (ImageNet's; the kit's 10)
BYTES_PER_TOKEN = 2  # the prepared shards hold uint16 token ids
DEFAULT_MARGIN = 0.25  # jobs submitted again after a mistake, a second try at a lab


@dataclass(frozen=True)
class LabJob:
    """A batch job each trainee submits: its stage, its shape ("1n1g"; "1nG" a full node; "2nG"
    two), how many times (one per Accelerate config, say), for a job array the tasks that run at
    once, and for a Ray job its driver (a script of solutions/ and its arguments)."""
    stage: str
    shape: str
    count: int = 1
    at_once: int = None
    script: str = None


#: The labs of the instructor guide's course plans (book/instructor.md, "Course plans"): for each
#: day, the batch jobs each trainee submits. The five and three days' lora lab runs one job per
#: multi-process Accelerate config (ddp, fsdp, zero2, zero3); the HPO lab is an array of 8 tasks,
#: 4 at a time (`sbatch --array=0-7%4`); "a profile of one GPU job" is one more ddp job. The five
#: days' Ray lab embeds the documents, then runs a Ray Tune study with ASHA and one with PBT, each
#: on two nodes as lesson 09 shows. Lesson 10's Slurm mistakes are refused or fail at once: no
#: GPU-hours.
PLANS = {
    "1-hour": [[LabJob("ddp", "2nG")]],
    "1-day": [[LabJob("std", "1n1g"), LabJob("ddp", "1n1g"), LabJob("ddp", "1nG"),
               LabJob("ddp", "2nG"), LabJob("fsdp", "2nG")]],
    "3-days": [[LabJob("ddp", "1n1g"), LabJob("ddp", "1nG"), LabJob("ddp", "2nG"),
                LabJob("lit", "2nG")],
               [LabJob("fsdp", "1nG"), LabJob("tp", "1nG"), LabJob("pp", "1nG"),
                LabJob("lora", "1nG", count=4)],
               [LabJob("ddp", "1nG"), LabJob("hpo", "1n1g", count=8, at_once=4)]],
    "5-days": [[LabJob("std", "1n1g")],
               [LabJob("ddp", "1n1g"), LabJob("ddp", "1nG"), LabJob("ddp", "2nG"),
                LabJob("lit", "2nG"), LabJob("fsdp", "1nG"), LabJob("fsdp", "2nG")],
               [LabJob(stage, shape) for stage in ("tp", "pp") for shape in ("1nG", "2nG")]
               + [LabJob("lora", "1nG", count=4)],
               [LabJob("resnet", "1n1g"), LabJob("resnet", "1nG"), LabJob("resnet", "2nG"),
                LabJob("ddp", "1nG")],
               [LabJob("hpo", "1n1g", count=8, at_once=4),
                LabJob("ray", "2nG", script="ray_embed.py"),
                LabJob("ray", "2nG", script="ray_tune_gpt2.py --scheduler asha"),
                LabJob("ray", "2nG", script="ray_tune_gpt2.py --scheduler pbt")]],
}


@dataclass
class PlannedJob:
    """A lab job on the site: its batch file, shape, hours and where the hours come from."""
    day: int
    stage: str
    file: str
    nodes: int
    gpus: int  # in all
    count: int
    at_once: int
    hours: float
    hours_from: str  # "self-test" or "time limit"
    run_dir: str
    script: str = None  # a Ray job's driver

    @property
    def gpu_hours(self):
        return self.gpus * self.hours * self.count


def check_plan(name):
    if name not in PLANS:
        raise KitError(f"unknown plan {name!r} (choose from {', '.join(PLANS)})")
    return PLANS[name]


def stage_topologies(stage, profile):
    """The shapes a site has batch files of the stage for: Ray's on the widest shapes, HPO's on
    one GPU and two nodes, a training stage's on the profile's topologies it can run on."""
    if stage == "ray":
        return slurm.widest_topologies(profile)
    if stage == "hpo":
        return slurm.hpo_topologies(profile)
    return slurm.topologies_for(stage, profile)


def site_topology(profile, stage, shape):
    """The site's shape for a lab's: 1n1g as it is; a full node ("1nG") or two ("2nG") as the
    stage's topology of that many nodes with the most GPUs per node; None where the site has no
    such topology for the stage (a pipeline of more stages than blocks, say)."""
    nodes = int(shape[0])
    candidates = [t for t in stage_topologies(stage, profile) if t.nodes == nodes
                  and (shape != "1n1g" or t.gpus == 1)]
    return max(candidates, key=lambda t: t.gpus, default=None)


def flag_value(args, flag, default):
    """The integer of ``flag N`` or ``flag=N`` in a profile's argument text (as
    slurm.selftest_steps reads --max-steps), or ``default``."""
    found = re.search(rf"{flag}[ =](\d+)", args)
    return int(found[1]) if found else default


def training_tokens(profile, stage):
    """Tokens a GPT stage's job trains: the preset's steps and batch, or train_args' own."""
    preset = presets.get_preset(profile["preset"])
    steps = flag_value(profile["train_args"], "--max-steps", preset.max_steps)
    return steps * flag_value(profile["train_args"], "--batch-tokens", preset.batch_tokens)


def hpo_tokens(profile):
    """Tokens an HPO study trains at most: every trial its full budget (none pruned)."""
    preset = presets.get_preset(profile["preset"])
    trials = flag_value(profile["hpo_args"], "--trials", 1)
    steps = flag_value(profile["hpo_args"], "--max-steps", preset.max_steps)
    return trials * steps * preset.batch_tokens


def per_gpu_throughput(report, profile):
    """{stage: tokens/s per GPU} of the GPT stages a self-test ran, each from its run on the most
    processes (the all-device run, communication included), from a report that measured the
    site's preset (another model's rate would not apply)."""
    measured = report["plan"]["preset"]
    if measured != profile["preset"]:
        raise KitError(f"the self-test measured the {measured} preset; site {profile['name']} "
                       f"trains {profile['preset']}: run batch-selftest on that site first")
    widest = {}
    for run in report["runs"]:
        if run.get("ok") and run.get("tok_per_s") and \
                run["processes"] >= widest.get(run["stage"], {}).get("processes", 0):
            widest[run["stage"]] = run
    return {stage: run["tok_per_s"] / run["processes"] for stage, run in widest.items()}


def job_hours(job, topology, profile, rates):
    """(hours, where they come from): the tokens at the measured rate, within the time limit."""
    limit = slurm.slurm_seconds(profile["time"]) / 3600
    stage = "std" if job.stage == "hpo" else job.stage  # an HPO trial is a std run
    if stage not in rates:  # not a GPT stage (lora, resnet, ray), or one the self-test did not run
        return limit, "time limit"
    if job.stage == "hpo":  # the array's tasks share the study's trials
        tokens, gpus = hpo_tokens(profile) / job.count, 1
    else:
        tokens, gpus = training_tokens(profile, stage), topology.processes
    return min(limit, tokens / (rates[stage] * gpus) / 3600), "self-test"


def planned_jobs(plan_name, profile, rates):
    """The plan's jobs on the site, and a line for each it has no batch file for."""
    jobs, left_out = [], []
    for day, labs in enumerate(check_plan(plan_name), start=1):
        for job in labs:
            topology = site_topology(profile, job.stage, job.shape)
            if topology is None:
                left_out.append(f"day {day}: the {job.stage} stage has no {job.shape[0]}-node "
                                f"shape on {profile['name']}, so no {job.shape} job")
                continue
            hours, source = job_hours(job, topology, profile, rates)
            file = f"batch-{job.stage}-{topology.name}.sh"
            jobs.append(PlannedJob(day, job.stage, file, topology.nodes, topology.processes,
                                   job.count, job.at_once or job.count, hours, source,
                                   f"runs/{profile['name']}-{job.stage}-{topology.name}",
                                   job.script))
    return jobs, left_out


def resnet_parameters(width, classes=RESNET_CLASSES):
    """Parameters of lesson 08's ResNet (solutions/resnet.py: ResNet-18's layout, its channels
    scaled by ``width``) with the 7x7 stem of large images: 11,689,512 at width 64 and 1000
    classes, torchvision's resnet18."""
    total, channels = 3 * width * 7 * 7 + 2 * width, width  # the stem: convolution, batch norm
    for n in range(4):
        out = width * 2**n
        for block in range(2):
            block_in = channels if block == 0 else out
            total += block_in * out * 9 + out * out * 9 + 2 * (2 * out)
            if block_in != out:  # the shortcut's 1x1 convolution and batch norm
                total += block_in * out + 2 * out
        channels = out
    return total + channels * classes + classes


def ray_tune_checkpoints(profile, driver):
    """Checkpoints a Ray job's driver leaves: none for ray_embed.py (its vectors of the course's
    documents are a few MB); for a Ray Tune study on the HPO study's budget (hpo_args' trials:
    lesson 09 compares the two), each ASHA trial's final one (the trainer saves at its last
    step), and with PBT, for each trial, the ones Ray keeps of those it reported for the others
    to copy (solutions/ray_tune_gpt2.py: as many as the trainer keeps) and the trainer's own."""
    if not driver.startswith("ray_tune_gpt2.py"):
        return 0
    trials = flag_value(profile["hpo_args"], "--trials", 1)
    if "pbt" not in driver.split():
        return trials
    return trials * 2 * runs.KEEP_CHECKPOINTS


def run_dir_bytes(profile, job):
    """What a job's run directory holds at most, by the preset's parameters: the kept
    checkpoints and the one being written; for lora the fine-tuned model, once per submission
    (each config's run is moved aside before the next: book/instructor.md, day 3); for resnet
    the ResNet's checkpoints; for a Ray job what its driver keeps."""
    stage = job.stage
    parameters = memory.Model.from_preset(presets.get_preset(profile["preset"])).parameters
    if stage == "lora":
        return job.count * BYTES_PER_MODEL_PARAMETER * parameters
    if stage == "hpo":  # every completed trial keeps its final checkpoint
        return flag_value(profile["hpo_args"], "--trials", 1) * \
            BYTES_PER_CHECKPOINTED_PARAMETER * parameters
    if stage == "resnet":
        width = flag_value(profile["resnet_args"], "--width", 64)
        return (runs.KEEP_CHECKPOINTS + 1) * BYTES_PER_RESNET_PARAMETER * resnet_parameters(width)
    if stage == "ray":
        return job.count * ray_tune_checkpoints(profile, job.script) * \
            BYTES_PER_CHECKPOINTED_PARAMETER * parameters
    return (runs.KEEP_CHECKPOINTS + 1) * BYTES_PER_CHECKPOINTED_PARAMETER * parameters


def shared_data_bytes(profile, root):
    """The prepared corpus the class shares: the shards data_command asks for, or the folder
    as prepared here."""
    shards = flag_value(profile["data_command"], "--shards", None)
    if shards:
        return shards * data.DEFAULT_SHARD_TOKENS * BYTES_PER_TOKEN
    folder = Path(root) / profile["data"]
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def day_reservation(jobs, trainees, gpus_per_node):
    """(nodes, hours) that let every trainee's jobs of the day run at once, for their longest."""
    gpus_at_once = sum(job.gpus * job.at_once for job in jobs)
    return math.ceil(trainees * gpus_at_once / gpus_per_node), max(job.hours for job in jobs)


def make_plan(plan_name, profile, trainees, report=None, margin=DEFAULT_MARGIN, root="."):
    """The plan as a dict (what --json prints)."""
    rates = per_gpu_throughput(report, profile) if report else {}
    jobs, left_out = planned_jobs(plan_name, profile, rates)
    gpus_per_node = profile["gpus_per_node"]
    days = []
    for day in sorted({job.day for job in jobs}):
        todays = [job for job in jobs if job.day == day]
        nodes, hours = day_reservation(todays, trainees, gpus_per_node)
        days.append({"day": day, "jobs": [asdict(job) for job in todays],
                     "gpu_hours_per_trainee": sum(job.gpu_hours for job in todays),
                     "reservation": {"nodes": nodes, "hours": hours}})
    per_trainee = sum(job.gpu_hours for job in jobs)
    # a file submitted again writes the same run directory; a Ray driver, its own folder
    run_dirs = {(job.run_dir, job.script): run_dir_bytes(profile, job) for job in jobs}
    return {"plan": plan_name, "site": profile["name"], "trainees": trainees,
            "gpus_per_node": gpus_per_node, "margin": margin,
            "hours_from": "self-test" if report else "time limits", "days": days,
            "left_out": left_out,
            "gpu_hours": {"per_trainee": per_trainee, "class": per_trainee * trainees,
                          "with_margin": per_trainee * trainees * (1 + margin)},
            "node_hours_with_margin": per_trainee * trainees * (1 + margin) / gpus_per_node,
            "storage": {"run_dirs_per_trainee": sum(run_dirs.values()),
                        "shared_data": shared_data_bytes(profile, root)}}


def size(n):
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.0f} MB"


def as_text(plan):
    """The plan as an instructor reads it: a table per day, then the totals."""
    lines = [f"{plan['plan']} plan on {plan['site']} for {plan['trainees']} trainees "
             f"(hours from the {plan['hours_from']})"]
    for day in plan["days"]:
        lines += ["", f"day {day['day']}:",
                  "  batch file              nodes  GPUs  count  hours  GPU-hours per trainee"]
        for job in day["jobs"]:
            gpu_hours = job["gpus"] * job["hours"] * job["count"]
            lines.append(f"  {job['file']:<22} {job['nodes']:>5} {job['gpus']:>5} "
                         f"{job['count']:>6} {job['hours']:>6.2f}  {gpu_hours:,.1f}"
                         f"{'' if job['hours_from'] == 'self-test' else '  (time limit)'}"
                         f"{'  ' + job['script'] if job['script'] else ''}")
        reservation = day["reservation"]
        lines.append(f"  reservation for everyone's jobs at once: {reservation['nodes']} nodes "
                     f"for {reservation['hours']:.2f} h")
    hours, storage = plan["gpu_hours"], plan["storage"]
    lines += ["", *plan["left_out"]] if plan["left_out"] else []
    lines += ["", f"GPU-hours: {hours['per_trainee']:,.1f} per trainee, {hours['class']:,.1f} "
              f"for the class, {hours['with_margin']:,.0f} with a {plan['margin']:.0%} margin "
              f"({plan['node_hours_with_margin']:,.0f} node-hours of {plan['gpus_per_node']} "
              "GPUs)",
              f"storage: {size(storage['run_dirs_per_trainee'])} of run directories per "
              f"trainee; {size(storage['shared_data'])} of data, shared by the class"]
    return "\n".join(lines)


def read_report(path):
    """A self-test's selftest.json, or a one-line KitError."""
    path = Path(path)
    try:
        report = runs.read_json(path)
    except FileNotFoundError:
        raise KitError(f"no self-test report {path}: give the selftest.json that "
                       "batch-selftest wrote") from None
    except ValueError:
        report = None
    if not (isinstance(report, dict) and isinstance(report.get("plan"), dict)
            and "preset" in report["plan"] and isinstance(report.get("runs"), list)):
        raise KitError(f"{path} is not a self-test's selftest.json (no plan and runs)")
    return report
