"""``python -m coursekit ...``: the kit's command line.

    envcheck                                   what this machine and kernel offer
    tokenizer fetch                            put the GPT-2 tokenizer files in the offline cache
    data prepare --source builtin --out DIR    build the offline corpus
    data prepare --source fineweb-edu --out DIR --shards N [--sample-file F]
    images prepare --out DIR [--source FOLDER --size S --files]   lesson 08's images, as shards
    presets                                    the model and batch sizes of each preset
    assignments [--root DIR]                   nbgrader student versions of every lesson
    exchange create PATH --group G             nbgrader's exchange for a class, on project space
    autograde LESSON [--root DIR]              grade the submissions; a line for each that fails
    grades LESSON [--root DIR --plot PNG]      who handed in, scores per exercise, class means
                  [--items]                    each graded cell: mean, zeros, discrimination
    book [--edition reader|instructor]         execute the lessons and build an edition of the book
    diffs build | check                        write / verify diffs/*.patch from solutions/
    diffs start | status --lesson L [--stage S --file F]   a lesson's working copy, hunk by hunk
    diffs apply --lesson L --hunk N [--stage S]            apply one hunk to the working copy
    batchfiles --site S | --all | --check      Slurm batch files from batchfiles/sites/S.yml
    export-hf RUN_DIR OUT_DIR [--force --untie] a std/ddp/fsdp run as a Hugging Face GPT-2 model
    instruct prepare --out DIR                 the offline instruction-tuning tasks (lesson 05)
    verify-data RUN_DIR [--data DIR]           is the data still what the run trained on?
    registry register RUN_DIR --name N --alias A [--model-dir D]   a run's model into MLflow
    registry load NAME@ALIAS [--prompt P]      load a registered model back and complete P
    free-port                                  a TCP port free on this host now (batch files)
    torchrun --nproc N SCRIPT [ARGS]           SCRIPT on N processes here (static rendezvous)
    compile-cache                              export lines: torch.compile's caches, private
    lab [--tunnel]                             JupyterLab as `make lab` starts it; --tunnel: in a
                                               batch job, behind a token, reached by SSH
    ray-node --head --port P | --address H:P   one node of a job's Ray cluster (batch files)
    ray-nodes --address H:P --expect N         wait for N Ray nodes, run a task on each
    mlflow-server [--store URI] [--port P]     MLflow's UI on 127.0.0.1 behind your own password
    trainee-kit --out DIR                      the kit as trainees get it: no solution, no hidden test
    selftest [--nodes N --steps S]             every stage on one device and all, bandwidth, offline files
    plan PLAN --site S --trainees N [--selftest F]   a course's GPU-hours, reservations, storage
"""
import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from coursekit import KIT_ROOT, KitError, course


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (what is wrong, what is allowed), no usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def tcp_port(text):
    """A port a user's server may listen on: 1024 to 65535 (lower ones are the system's)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port, 1024 to 65535, got {text!r}") from None
    if not 1024 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port, 1024 to 65535, got {value}")
    return value


def stage_list(text):
    """Comma-separated names of stage scripts in solutions/ (train_gpt2_<stage>.py)."""
    from coursekit import stages
    known = stages.names()
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if not chosen or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: expected stages among {', '.join(known)}, "
                                         "comma-separated")
    return tuple(chosen)


def build_parser():
    parser = ArgumentParser(prog="python -m coursekit", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    envcheck = commands.add_parser("envcheck", help="report devices, versions, Slurm, data, tokenizer")
    envcheck.add_argument("--json", action="store_true", help="print JSON instead of a report")

    commands.add_parser("site-torch", help="check that this environment's torch is the site's, "
                                          "not one pip installed (make setup-site)")

    torchrun = commands.add_parser(
        "torchrun", help="run a script on N processes of this machine: torchrun with its static "
                         "rendezvous at a free port (the command is printed first)")
    torchrun.add_argument("--nproc", type=positive_int, required=True, help="processes to start")
    torchrun.add_argument("script", help="the script, then its own arguments")
    torchrun.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    lab = commands.add_parser("lab", help="JupyterLab on 127.0.0.1, kernels over private Unix "
                                          "sockets, torch.compile's caches private (make lab)")
    lab.add_argument("--tunnel", action="store_true",
                     help="for a batch job (batch-lab.sh): a token of its own, kept in --state, "
                          "and the SSH tunnel to reach it printed")
    lab.add_argument("--state", help="with --tunnel: where the token is kept, private (default "
                                     "runs/lab)")
    commands.add_parser("compile-cache", help="export lines for private Inductor and Triton caches "
                                              "(checked: yours, mode 0700)")

    tokenizer = commands.add_parser("tokenizer", help="the GPT-2 tokenizer files")
    tokenizer.add_argument("action", choices=["fetch"])

    data_cmd = commands.add_parser("data", help="prepare token shards")
    data_cmd.add_argument("action", choices=["prepare"])
    data_cmd.add_argument("--source", choices=["builtin", "fineweb-edu"], required=True)
    data_cmd.add_argument("--out", required=True, help="directory for the shards and meta.json")
    data_cmd.add_argument("--shards", type=positive_int, default=10,
                          help="fineweb-edu: number of shards to write, the first is validation")
    data_cmd.add_argument("--shard-tokens", type=positive_int, default=None,
                          help="tokens per shard (default 100,000,000)")
    data_cmd.add_argument("--sample-file", default=None,
                          help="fineweb-edu: a local JSONL/Parquet file in FineWeb's schema "
                               "instead of the hub")
    data_cmd.add_argument("--workers", type=positive_int, default=None,
                          help="processes for reading and tokenising (default: all cores)")

    images = commands.add_parser("images", help="image data for lesson 08, as shards (and files)")
    images.add_argument("action", choices=["prepare"])
    images.add_argument("--out", required=True, help="a new folder for shards/, meta.json (files/)")
    images.add_argument("--source", help="an ImageNet-style folder (a folder of images per class) "
                                         "instead of the kit's own shapes")
    images.add_argument("--size", type=positive_int,
                        help="pixels a side (default 32 for the shapes; a folder's images keep "
                             "theirs unless given)")
    images.add_argument("--count", type=positive_int, default=6000,
                        help="shapes: training images (a sixth as many for validation)")
    images.add_argument("--format", choices=["jpeg", "png"], default="jpeg", dest="image_format")
    images.add_argument("--shard-size", type=positive_int, default=1000, help="images per tar shard")
    images.add_argument("--workers", type=positive_int, default=None,
                        help="processes drawing and encoding (default: all cores)")
    images.add_argument("--files", action="store_true",
                        help="also one file per image, with an index (lesson 08 compares the two "
                             "layouts): a file each against the quota; shards only without it")

    commands.add_parser("presets", help="list the presets")

    assignments = commands.add_parser(
        "assignments", help="nbgrader student versions of the lessons",
        description="Generate every lesson's student version with nbgrader into release/<lesson>/ "
                    "and record its graded cells (ids, points) in the course's gradebook "
                    "(gradebook.db), which autograde grades against. Run it before the class "
                    "fetches: generating a lesson again after that replaces those records, so "
                    "change a released lesson only to fix a mistake, and tell the class.")
    assignments.add_argument("--root", default=None, help="course root (default: the kit's checkout)")

    exchange = commands.add_parser("exchange", help="nbgrader's exchange for a class, made once "
                                   "on shared project space")
    exchange_actions = exchange.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = exchange_actions.add_parser(
        "create", help="make the exchange folder",
        description="Make nbgrader's exchange folder PATH for a class: it belongs to the course's "
                    f"group, mode {course.EXCHANGE_MODE:o} (every member may drop files in, and "
                    "nobody may rename or delete another's). Its parent is the gate: of the "
                    f"group, mode {course.GATE_MODE:o}, closed to other users, made if missing; "
                    "an existing one the group could write in is refused. Then set exchange = "
                    "\"PATH\" and the course's id in course.toml.")
    create.add_argument("path", help="the exchange folder to make (course.toml's exchange)")
    create.add_argument("--group", required=True,
                        help="the course's Unix group: you and every trainee")

    for name, purpose in (("autograde", "nbgrader autograde of a lesson's submissions, a line "
                                        "for each it could not grade, then the class summary"),
                          ("grades", "a lesson's class summary: who handed in, the scores of "
                                     "each exercise, the class's mean")):
        grading_cmd = commands.add_parser(name, help=purpose)
        grading_cmd.add_argument("lesson", help="the assignment, e.g. 01-single-gpu-gpt")
        grading_cmd.add_argument("--root", default=".",
                                 help="course root (default: this folder, as for nbgrader)")
        grading_cmd.add_argument("--plot", help="also draw the class's mean per exercise, as a "
                                                "PNG, into this file")
        grading_cmd.add_argument("--items", action="store_true",
                                 help="also each graded cell, hardest first: its mean, the share "
                                      "of trainees at zero, its discrimination and the commonest "
                                      "error of the failing submissions")

    book_cmd = commands.add_parser("book", help="execute the lessons and build the book")
    book_cmd.add_argument("--edition", choices=["reader", "instructor"], default="reader",
                          help="reader: exercises as students get them (published); instructor: "
                               "with solutions and hidden tests")

    diffs_cmd = commands.add_parser("diffs", help="the diffs between stages; a lesson's working copy")
    diffs_cmd.add_argument("action", choices=["build", "check", "start", "status", "apply"])
    diffs_cmd.add_argument("--lesson", help="start/status/apply: the lesson, e.g. 02-ddp")
    diffs_cmd.add_argument("--file", help="start/status/apply: the working copy (default: "
                                          "notebooks/<lesson>/train_gpt2.py)")
    diffs_cmd.add_argument("--hunk", type=positive_int, help="apply: the hunk's number")
    diffs_cmd.add_argument("--stage", help="start/status/apply: the stage the diff leads to, in a "
                                           "lesson with several (04: fsdp, tp or pp)")

    batch = commands.add_parser("batchfiles", help="Slurm batch files from a site profile")
    which = batch.add_mutually_exclusive_group(required=True)
    which.add_argument("--site", help="the profile batchfiles/sites/SITE.yml")
    which.add_argument("--all", action="store_true", help="every site profile")
    which.add_argument("--check", action="store_true",
                       help="fail if a committed batch file differs from the generator's output")

    export_hf = commands.add_parser("export-hf", help="a run's newest checkpoint as a Hugging Face "
                                                      "GPT-2 model directory")
    export_hf.add_argument("run_dir", metavar="RUN_DIR", help="run directory of a std, ddp or "
                                                              "fsdp run")
    export_hf.add_argument("out_dir", metavar="OUT_DIR", help="where the model and tokenizer go")
    export_hf.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    export_hf.add_argument("--untie", action="store_true",
                           help="give the output head its own copy of the embedding matrix")

    instruct = commands.add_parser("instruct", help="instruction-tuning data for fine-tuning")
    instruct.add_argument("action", choices=["prepare"])
    instruct.add_argument("--out", required=True, help="directory for train.jsonl and val.jsonl")

    rag = commands.add_parser("rag", help="lesson 09's retrieval: the kit's own embedder")
    rag.add_argument("action", choices=["embedder"])
    rag.add_argument("--base", default="models/kit-tiny",
                     help="the exported GPT whose token embeddings it starts from")
    rag.add_argument("--out", required=True, help="directory for the sentence-transformers model")
    rag.add_argument("--epochs", type=positive_int, default=10, help="passes over the pairs")

    verify = commands.add_parser("verify-data", help="check data against a run's manifest")
    verify.add_argument("run_dir", metavar="RUN_DIR")
    verify.add_argument("--data", help="the data directory (default: the one the run used)")

    trainee_kit = commands.add_parser("trainee-kit", help="the kit as trainees get it: student "
                                      "versions of the lessons, no solution or hidden test")
    trainee_kit.add_argument("--out", required=True, help="a new folder for it")

    commands.add_parser("free-port", help="print a TCP port free on this host now (the batch "
                        "files' rendezvous port)")

    ray_node = commands.add_parser("ray-node", help="one node of a Ray cluster inside a Slurm "
                                   "job, behind the job's token (batch-ray-*.sh)")
    role = ray_node.add_mutually_exclusive_group(required=True)
    role.add_argument("--head", action="store_true", help="the head node")
    role.add_argument("--address", help="HOST:PORT of the head, for any other node")
    ray_node.add_argument("--port", type=tcp_port, help="--head: the head's port")
    ray_node.add_argument("--cpus", type=positive_int, help="CPUs Ray may use on this node")
    ray_node.add_argument("--gpus", type=int, help="GPUs Ray may use on this node")
    ray_nodes = commands.add_parser("ray-nodes", help="wait until a Ray cluster has its nodes, "
                                    "then run a task on each")
    ray_nodes.add_argument("--address", required=True, help="HOST:PORT of the head")
    ray_nodes.add_argument("--expect", type=positive_int, required=True, help="nodes to wait for")
    ray_nodes.add_argument("--timeout", type=positive_int, default=300, help="seconds")

    registry = commands.add_parser("registry", help="the MLflow model registry")
    registry.add_argument("action", choices=["register", "load"])
    registry.add_argument("target", metavar="RUN_DIR|NAME@ALIAS",
                          help="register: a run directory; load: a registered NAME@ALIAS")
    registry.add_argument("--name", help="register: the registered model's name")
    registry.add_argument("--alias", default="champion", help="register: alias of the new version")
    registry.add_argument("--model-dir", help="register: Hugging Face model directory "
                                              "(default RUN_DIR/model)")
    registry.add_argument("--store", help="load: tracking URI (default MLFLOW_TRACKING_URI or "
                                          "runs/mlflow.db)")
    registry.add_argument("--prompt", default="The", help="load: text to complete")

    server = commands.add_parser("mlflow-server", help="MLflow's UI and API on 127.0.0.1, "
                                 "behind a password only you can read")
    server.add_argument("--store", help="tracking URI (default MLFLOW_TRACKING_URI or "
                                        "runs/mlflow.db)")
    server.add_argument("--artifacts", help="where it stores uploaded artifacts (default "
                                            "runs/mlartifacts)")
    server.add_argument("--port", type=tcp_port, help="TCP port (default: one free now)")
    server.add_argument("--state", default="runs/mlflow-server",
                        help="the password and user database, kept private (default %(default)s)")
    selftest = commands.add_parser(
        "selftest", help="every stage on one device and on all, bandwidth, offline files: a "
                         "report for a new cluster",
        description="Prove a node (or, under Slurm, --nodes nodes) ready for the course: train "
                    "every GPT stage for --steps steps on one device and on all of them at the "
                    "same global batch, check their losses against the single-device stage, "
                    "report tokens/s, MFU and memory against the prediction, measure the "
                    "all-reduce bus bandwidth, and check offline the lessons' imports, data, "
                    "tokenizer and Hugging Face cache. Writes selftest.json and selftest.md into "
                    "--out and ends with one line naming the first failure, if any.")
    selftest.add_argument("--out", default="runs/selftest", help="where selftest.json and "
                                                                 "selftest.md go (default %(default)s)")
    selftest.add_argument("--steps", type=positive_int, default=20,
                          help="steps of each run (default %(default)s)")
    selftest.add_argument("--preset", choices=["tiny", "small", "gpt2-124m"],
                          help="the model (default: gpt2-124m on a GPU, tiny on a CPU)")
    selftest.add_argument("--micro-batch", type=positive_int,
                          help="samples per forward pass (default: the preset's, or on a GPU the "
                               "largest its memory holds)")
    selftest.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                          help="what the runs train on (default: the GPUs if torch sees any)")
    selftest.add_argument("--nodes", type=positive_int, default=1,
                          help="nodes of the Slurm job to run on (default 1: this one)")
    selftest.add_argument("--per-node", type=positive_int,
                          help="processes per node (default: every GPU, or 2 on a CPU)")
    selftest.add_argument("--data", default=str(KIT_ROOT / "data" / "builtin"),
                          help="prepared data to train on (default: the builtin corpus)")
    selftest.add_argument("--stages", type=stage_list,
                          help="comma-separated stages to run, to check one again after a fix "
                               "(default: all; std, the reference, always runs)")
    selftest.add_argument("--expected-busbw", type=positive_float, metavar="GBPS",
                          help="the all-reduce bus bandwidth the site's interconnect should give, "
                               "GB/s (its profile's): below half of it fails, with the likely "
                               "cause (default: none, reported only)")
    selftest.add_argument("--timeout", type=positive_int, default=1800,
                          help="seconds each run may take (default %(default)s)")
    add_plan_parser(commands)
    return parser


def add_plan_parser(commands):
    # Nothing imported here: `coursekit tokenizer fetch` runs this parser in the set-up's first
    # environment, before PyYAML (which coursekit.plan needs, through coursekit.slurm) is there.
    planner = commands.add_parser(
        "plan", help="the GPU-hours, reservations and storage a course plan needs on a site",
        description="From a course plan of the instructor guide and a class size: the batch jobs "
                    "each trainee submits on each day at the site's shapes, their hours (from a "
                    "self-test's measured tokens/s, or their time limits), GPU-hours and "
                    "node-hours with a margin, the nodes a day's reservation needs, and the "
                    "storage of the trainees' run directories.")
    planner.add_argument("plan", metavar="PLAN", help="1-hour, 1-day, 3-days or 5-days")
    planner.add_argument("--site", required=True,
                         help="the site's profile, batchfiles/sites/SITE.yml")
    planner.add_argument("--trainees", type=positive_int, required=True, help="the class size")
    planner.add_argument("--selftest", metavar="SELFTEST_JSON",
                         help="the site's self-test report, for measured run times (default: "
                              "every job its time limit)")
    planner.add_argument("--margin", type=non_negative_float,
                         help="extra share of GPU-hours to ask for (default 0.25)")
    planner.add_argument("--json", action="store_true", help="the plan as JSON")


def run_selftest(args):
    from coursekit import selftest
    selftest.run_all(args)


def run_plan(args):
    from coursekit import plan, slurm
    plan.check_plan(args.plan)
    profile = slurm.load_site(args.site)
    report = plan.read_report(args.selftest) if args.selftest else None
    margin = plan.DEFAULT_MARGIN if args.margin is None else args.margin
    made = plan.make_plan(args.plan, profile, args.trainees, report, margin, KIT_ROOT)
    print(json.dumps(made, indent=1) if args.json else plan.as_text(made))


def run_trainee_kit(args):
    from coursekit import KIT_ROOT, trainee
    out, answers = trainee.build(args.out, KIT_ROOT)
    print(f"the trainee kit is in {out}: student versions of every lesson; none of the "
          f"{answers} answer lines of the solutions and hidden tests")


def run_free_port(args):
    from coursekit import launch
    print(launch.free_port())


def run_torchrun(args):
    """Replace this process with torchrun, after showing the command: the one to type where the
    kit is not installed (see coursekit.launch for why not torchrun's standalone mode)."""
    from coursekit import launch
    command = [*launch.torchrun(args.nproc), args.script, *args.script_args]
    print("$", shlex.join(command), flush=True)
    os.execv(command[0], command)


def run_lab(args):
    if args.tunnel:
        from coursekit import lab_job
        return lab_job.serve(args.state or lab_job.DEFAULT_STATE)
    if args.state:
        raise KitError(f"--state {args.state}: only a lab with --tunnel keeps a token")
    from coursekit import caches, launch
    caches.use_private_compile_cache()  # for a notebook's own torch.compile
    os.environ["JUPYTER_RUNTIME_DIR"] = launch.lab_runtime_dir()
    command = launch.lab_command()
    os.execv(command[0], command)


def run_compile_cache(args):
    from coursekit import caches
    print(caches.export_lines())


def run_ray_node(args):
    from coursekit import raycluster
    if args.head and args.port is None:
        raise KitError("ray-node --head needs --port: the port the other nodes join at")
    return raycluster.run_node(args.head, args.port, args.address, args.cpus, args.gpus)


def run_ray_nodes(args):
    from coursekit import raycluster
    hosts = raycluster.wait_for_nodes(args.address, args.expect, args.timeout)
    print(f"ray cluster at {args.address}: {len(hosts)} nodes, a task ran on each: "
          + ", ".join(sorted(hosts.values())), flush=True)


def run_mlflow_server(args):
    from coursekit import mlflow_server
    return mlflow_server.serve(args.store, args.artifacts, args.port, args.state)


def run_envcheck(args):
    from coursekit import envcheck
    info = envcheck.collect()
    print(json.dumps(info, indent=2) if args.json else envcheck.report(info))
    if info["gpu_problem"]:
        raise KitError(info["gpu_problem"])


def run_site_torch(args):
    from coursekit import envcheck
    print(envcheck.site_torch())


def run_tokenizer(args):
    from coursekit import data
    print(f"GPT-2 tokenizer files ready in {data.fetch_tokenizer()}")


def run_data(args):
    from coursekit import data
    shard_tokens = args.shard_tokens or data.DEFAULT_SHARD_TOKENS
    start = time.perf_counter()
    if args.source == "builtin":
        meta = data.prepare_builtin(args.out, shard_tokens, args.workers)
    else:
        meta = data.prepare_fineweb(args.out, args.shards, shard_tokens, args.sample_file,
                                    args.workers)
    counts = ", ".join(f"{split} {s['tokens']:,} tokens in {len(s['shards'])} shard(s)"
                       for split, s in meta["splits"].items())
    print(f"prepared {args.source} in {args.out}: {counts} ({time.perf_counter() - start:.1f} s)")


def run_images(args):
    from coursekit import images
    start = time.perf_counter()
    meta = images.prepare(args.out, args.source, args.size, args.count, args.image_format,
                          args.shard_size, args.workers, files=args.files)
    counts = ", ".join(f"{split} {s['images']:,} images in {len(s['shards'])} shard(s)"
                       for split, s in meta["splits"].items())
    print(f"prepared {meta['source']} in {args.out}: {len(meta['classes'])} classes, {counts}"
          f"{', and a file per image' if args.files else ''} ({time.perf_counter() - start:.1f} s)")


def run_presets(args):
    from coursekit.presets import PRESETS
    for preset in PRESETS.values():
        print(f"{preset.name:10s} {preset.n_layer} layers x {preset.n_embd} wide, "
              f"{preset.n_head} heads, T={preset.seq_len}, microbatch {preset.micro_batch}, "
              f"{preset.batch_tokens:,} tokens/step, {preset.max_steps:,} steps, data {preset.data}")


def run_assignments(args):
    from coursekit import KIT_ROOT, grading
    root = args.root or KIT_ROOT
    if not (Path(root) / "notebooks").is_dir():
        raise KitError(f"--root {root} holds no notebooks/ folder: give a course's root, such as "
                       "the kit's checkout")
    names = grading.lessons(root)
    release = grading.generate(root)
    print(f"student versions of {len(names)} lessons in {release}: {', '.join(names)}")


def run_exchange(args):
    path, gate_mode = course.create_exchange(args.path, args.group)
    print(f"exchange {path}, behind {path.parent} (group {args.group}, mode {gate_mode:o}): "
          f"set exchange = \"{path}\" and the course's id in course.toml")


def graded_lesson(args):
    """(course root, lesson) of a grading command; a lesson the course lacks is a KitError."""
    from coursekit import grading
    root = Path(args.root).absolute()
    lessons = grading.lessons(root) if (root / "notebooks").is_dir() else []
    if args.lesson not in lessons:
        raise KitError(f"{args.lesson!r} is not a lesson of the course in {root}: choose from "
                       f"{', '.join(lessons) or '(none: give the course root with --root)'}")
    if not (root / "release" / args.lesson).is_dir():
        raise KitError(f"{root / 'release' / args.lesson} does not exist: generate the student "
                       "versions first (make assignments)")
    return root, args.lesson


def run_autograde(args):
    from coursekit import grading
    root, lesson = graded_lesson(args)
    for trainee, cells in sorted(grading.restore_deleted_tests(root, lesson).items()):
        print(f"{trainee}'s {lesson} lacked test cells, put back from the release before "
              f"grading: {', '.join(cells)}")
    failed = grading.autograde_class(root, lesson)
    for trainee, error in sorted(failed.items()):
        print(f"error: {trainee}'s {lesson} was not graded: {error}", file=sys.stderr)
    run_grades(args)
    return 1 if failed else 0


def run_grades(args):
    from coursekit import grading
    root, lesson = graded_lesson(args)
    exercises, rows = grading.class_summary(root, lesson)
    print(grading.summary_table(lesson, exercises, rows))
    if args.plot:
        grading.plot_means(lesson, exercises, rows, args.plot)
        print(f"the class's mean per exercise: {args.plot}")
    if args.items:
        graded = sum(bool(scores) for _, _, scores in rows)
        if not graded:
            raise KitError(f"{lesson} has no graded submission in {root}: run `python -m "
                           f"coursekit autograde {lesson}` once trainees have handed it in")
        errors = grading.failing_errors(root, lesson, exercises, rows)
        print(grading.items_table(lesson, grading.item_statistics(exercises, rows, errors),
                                  graded))


def run_book(args):
    from coursekit import book
    html = book.build(args.edition)
    print(f"The {args.edition}'s edition of the book is in {html}/index.html")


def run_diffs(args):
    """build/check/start print and return 0 or 1; status returns 1 until every hunk is applied."""
    from coursekit import diffs
    if args.action == "build":
        for name, (added, removed) in diffs.build().items():
            print(f"diffs/{name}.patch: +{added} -{removed} lines")
        return 0
    if args.action == "check":
        problems = diffs.check()
        print("\n".join(problems) or f"{len(diffs.LADDER)} diffs match their stage scripts")
        return 1 if problems else 0
    if not args.lesson:
        raise KitError(f"diffs {args.action} needs --lesson (one of "
                       f"{', '.join(dict.fromkeys(s.lesson for s in diffs.LADDER))})")
    if args.action == "start":
        print(f"working copy: {diffs.start_working_copy(args.lesson, args.file, stage=args.stage)}")
        return 0
    if args.action == "apply":
        if args.hunk is None:
            raise KitError("diffs apply needs --hunk N (the numbers are in `diffs status`)")
        diffs.apply_hunk(args.lesson, args.hunk, args.file, stage=args.stage)
    statuses = diffs.status(args.lesson, args.file, stage=args.stage)
    print(diffs.report(args.lesson, statuses))
    return 0 if all(s.state == "applied" for s in statuses) else 1


def run_batchfiles(args):
    from coursekit import slurm
    if args.check:
        problems = slurm.check()
        print("\n".join(problems) or f"batch files of {len(slurm.site_names())} sites match "
                                     "their profiles")
        return 1 if problems else 0
    for site in slurm.site_names() if args.all else [args.site]:
        for warning in slurm.profile_warnings(slurm.load_site(site)):
            print(f"warning: {warning}", file=sys.stderr)
        written = slurm.write(site)
        print(f"{site}: {len(written)} batch files in {KIT_ROOT / 'batchfiles' / site}/")
    return 0


def run_export_hf(args):
    from coursekit import hfexport
    record = hfexport.export(args.run_dir, args.out_dir, args.force, args.untie)
    print(f"exported the {record['stage']} run {args.run_dir} at step {record['step']} to "
          f"{args.out_dir}: load it with GPT2LMHeadModel.from_pretrained({args.out_dir!r})")


def run_instruct(args):
    from coursekit import instruct
    meta = instruct.prepare(args.out)
    counts = ", ".join(f"{split} {info['examples']:,} examples"
                       for split, info in meta["splits"].items())
    print(f"prepared the kit's instruction tasks ({', '.join(meta['tasks'])}) in {args.out}: "
          f"{counts}")


def run_rag(args):
    from coursekit import rag
    corpus = rag.documents()
    held_out = {q.document for q in rag.questions(corpus)}
    if not (Path(args.base) / "model.safetensors").is_file():
        raise KitError(f"--base {args.base}: no model.safetensors there; make it with "
                       "`python -m coursekit export-hf runs/base-tiny models/kit-tiny --untie`")
    rag.train_embedder(args.base, args.out, corpus, held_out, epochs=args.epochs)
    print(f"trained the kit's embedder on {len(corpus) - len(held_out)} documents (the question "
          f"set's {len(held_out)} held out): {args.out}")


def run_verify_data(args):
    from coursekit import runs
    manifest, problems = runs.verify_data(args.run_dir, args.data)
    where = args.data or manifest["dir"]
    if problems:
        print(f"{where} differs from what {args.run_dir} trained on: {'; '.join(problems)}",
              file=sys.stderr)
        return 1
    print(f"{where} matches the manifest of {args.run_dir}: {len(manifest['files'])} files, "
          f"sha256 {manifest['sha256'][:16]}")
    return 0


def run_registry(args):
    from coursekit import registry
    if args.action == "register":
        if not args.name:
            raise KitError("registry register needs --name (the registered model's name)")
        uri, version = registry.register(args.target, args.name, args.alias, args.model_dir)
        print(f"registered {args.target} as {args.name} version {version}, alias "
              f"{args.alias!r}, in {uri}: load it with models:/{args.name}@{args.alias}")
        return 0
    model = registry.load(args.target, args.store)
    print(f"{args.prompt}{model.predict([args.prompt])[0]}")
    return 0


COMMANDS = {"envcheck": run_envcheck, "site-torch": run_site_torch, "tokenizer": run_tokenizer, "data": run_data,
            "presets": run_presets, "assignments": run_assignments, "book": run_book, "diffs": run_diffs,
            "batchfiles": run_batchfiles, "export-hf": run_export_hf, "instruct": run_instruct,
            "verify-data": run_verify_data, "registry": run_registry, "free-port": run_free_port,
            "mlflow-server": run_mlflow_server, "trainee-kit": run_trainee_kit,
            "selftest": run_selftest, "images": run_images, "ray-node": run_ray_node,
            "ray-nodes": run_ray_nodes, "rag": run_rag, "exchange": run_exchange,
            "autograde": run_autograde, "grades": run_grades, "torchrun": run_torchrun,
            "compile-cache": run_compile_cache, "lab": run_lab, "plan": run_plan}


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args) or 0
    except KitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
