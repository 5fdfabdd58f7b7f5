"""`coursekit plan` (issue 51, item 2): the GPU-hours, reservations and storage of a course plan
on a site, checked against the batch files the site gets and the instructor guide. The run times
measured by a real self-test: tests/test_selftest.py."""
import json
import math
import re

import pytest

from coursekit import KIT_ROOT, cli, plan, runs, slurm

pytestmark = pytest.mark.unit
SITES = slurm.site_names()


def planned(capsys, *args):
    """`python -m coursekit plan ARGS --json`, in this process: the plan as a dict."""
    assert cli.main(["plan", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def refused(capsys, *args):
    """The exit status and stderr of a `plan` that must fail."""
    try:
        status = cli.main(["plan", *map(str, args)])
    except SystemExit as exit:  # argparse's own refusals
        status = exit.code
    return status, capsys.readouterr().err


def jobs_of(made):
    return [job for day in made["days"] for job in day["jobs"]]


def sbatch_option(path, name):
    return re.search(rf"^#SBATCH --{name}=(\S+)$", path.read_text(), re.MULTILINE).group(1)


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("plan_name", list(plan.PLANS))
def test_every_planned_job_is_a_batch_file_the_site_has(capsys, site, plan_name):
    """Each job of every plan is a committed batch file of the site, with the nodes that file
    asks Slurm for; a job the site has no file for is named, not counted."""
    made = planned(capsys, plan_name, "--site", site, "--trainees", 3)
    folder = KIT_ROOT / "batchfiles" / site
    for job in jobs_of(made):
        path = folder / job["file"]
        assert path.is_file(), path
        assert int(sbatch_option(path, "nodes")) == job["nodes"]
        per_node = re.search(r"^#SBATCH --(?:gpus-per-node=|gres=gpu:)(\d+)$", path.read_text(),
                             re.MULTILINE)
        if per_node:  # a GPU site's request; the test cluster's processes ask for cores
            assert job["gpus"] == job["nodes"] * int(per_node.group(1)), path
    for line in made["left_out"]:
        stage, nodes = re.search(r"the (\w+) stage has no (\d)-node shape", line).groups()
        assert not list(folder.glob(f"batch-{stage}-{nodes}n*g.sh")), line


def test_without_a_self_test_each_job_books_its_time_limit(capsys):
    """The one-day plan on the test cluster for 30: the guide's table (std, DDP at 1 GPU, a node
    and two, FSDP on two nodes), each job for the time its batch file asks for."""
    made = planned(capsys, "1-day", "--site", "ci", "--trainees", 30)
    folder = KIT_ROOT / "batchfiles" / "ci"
    files = ["batch-std-1n1g.sh", "batch-ddp-1n1g.sh", "batch-ddp-1n2g.sh", "batch-ddp-2n2g.sh",
             "batch-fsdp-2n2g.sh"]
    assert [job["file"] for job in jobs_of(made)] == files
    gpus = {name: math.prod(map(int, re.findall(r"(\d+)[ng]", name.split("-")[2])))
            for name in files}
    hours = {name: slurm.slurm_seconds(sbatch_option(folder / name, "time")) / 3600
             for name in files}
    per_trainee = sum(gpus[name] * hours[name] for name in files)  # 12 GPUs x 10 minutes
    assert per_trainee == pytest.approx(2.0)
    assert made["gpu_hours"] == pytest.approx({"per_trainee": per_trainee,
                                               "class": 30 * per_trainee,
                                               "with_margin": 30 * per_trainee * 1.25})
    assert all(job["hours_from"] == "time limit" for job in jobs_of(made))
    # all 30 trainees' 12 GPUs at once, 2 a node
    assert made["days"][0]["reservation"] == {"nodes": 180, "hours": pytest.approx(1 / 6)}


def test_an_array_reserves_the_tasks_that_run_at_once_and_a_file_again_shares_its_directory(
        capsys):
    """Day 5 of the five days: the HPO array's 8 tasks, 4 at a time, and three Ray jobs on two
    nodes (the embedding, a Ray Tune study with ASHA and one with PBT); the storage counts day
    2's ddp run directory once though day 4 submits that file again."""
    made = planned(capsys, "5-days", "--site", "ci", "--trainees", 1, "--margin", 0)
    day5 = made["days"][4]
    assert [(job["file"], job["count"], job["at_once"], job["script"])
            for job in day5["jobs"]] == \
        [("batch-hpo-1n1g.sh", 8, 4, None), ("batch-ray-2n2g.sh", 1, 1, "ray_embed.py"),
         ("batch-ray-2n2g.sh", 1, 1, "ray_tune_gpt2.py --scheduler asha"),
         ("batch-ray-2n2g.sh", 1, 1, "ray_tune_gpt2.py --scheduler pbt")]
    assert day5["reservation"]["nodes"] == math.ceil((4 + 3 * 4) / 2)
    again = [job for job in jobs_of(made) if job["file"] == "batch-ddp-1n2g.sh"]
    assert [job["day"] for job in again] == [2, 4] and len({job["run_dir"] for job in again}) == 1
    profile = slurm.load_site("ci")
    counted = {}
    for job in jobs_of(made):
        counted[job["run_dir"], job["script"]] = plan.run_dir_bytes(
            profile, plan.LabJob(job["stage"], "1n1g", job["count"], script=job["script"]))
    assert made["storage"]["run_dirs_per_trainee"] == sum(counted.values())


def test_the_storage_of_the_resnet_and_ray_jobs():
    """The ResNet's checkpoints (lesson 08's model at the profile's width: 8 on the test cluster)
    and a Ray job's driver: nothing for the embedding, an ASHA study's final checkpoint per trial,
    and a PBT study's kept by Ray and by the trainer (hpo_args: 2 trials)."""
    from solutions.resnet import ResNet

    profile = slurm.load_site("ci")
    for width in (8, 64):
        model = ResNet(plan.RESNET_CLASSES, width=width, small_images=False)
        assert plan.resnet_parameters(width) == sum(p.numel() for p in model.parameters())
    assert plan.resnet_parameters(64) == 11_689_512  # torchvision's resnet18
    assert plan.run_dir_bytes(profile, plan.LabJob("resnet", "1nG")) == \
        (runs.KEEP_CHECKPOINTS + 1) * 8 * plan.resnet_parameters(8)
    gpt = plan.run_dir_bytes(profile, plan.LabJob("std", "1n1g")) // (runs.KEEP_CHECKPOINTS + 1)
    ray = {script: plan.run_dir_bytes(profile, plan.LabJob("ray", "2nG", script=script))
           for script in ("ray_embed.py", "ray_tune_gpt2.py --scheduler asha",
                          "ray_tune_gpt2.py --scheduler pbt")}
    assert ray == {"ray_embed.py": 0, "ray_tune_gpt2.py --scheduler asha": 2 * gpt,
                   "ray_tune_gpt2.py --scheduler pbt": 2 * 2 * runs.KEEP_CHECKPOINTS * gpt}


# --- the guide's course plans against lesson_time.json and PLANS --------------------------------
#: The course's source curriculum, a five-day train-the-trainer course: the lessons of each day
#: (lesson 04 in its three parts; lesson 10 where the guide places it, at the end of day 2).
CURRICULUM = {1: ["00", "00b", "01"], 2: ["02", "03", "04 part 1", "10"],
              3: ["04 part 2", "04 part 3", "05"], 4: ["06", "08"], 5: ["07", "09"]}
#: Where a lesson's parts begin: the first section of each part after the first.
PART_STARTS = {"04": ("Tensor parallelism", "Lab:"), "06": ("Monitoring a job",),
               "07": ("Many workers",)}


def lesson_minutes():
    """{"02": 80, "04 part 1": 42, ...}: each lesson's minutes in lesson_time.json, and each
    part's, the sum of its sections' minutes, rounded."""
    measured = json.loads((KIT_ROOT / "benchmarks" / "results" / "lesson_time.json").read_text())
    minutes = {}
    for name, lesson in measured["lessons"].items():
        number = name.split("-")[0]
        minutes[number] = lesson["minutes"]
        part, sums = 1, {}
        for section in lesson["sections"]:
            if section["heading"].startswith(PART_STARTS.get(number, ())):
                part += 1
            sums[part] = sums.get(part, 0) + section["minutes"]
        if len(sums) > 1:
            minutes.update({f"{number} part {part}": round(total)
                            for part, total in sums.items()})
    return minutes


def plan_section(title):
    guide = (KIT_ROOT / "book" / "instructor.md").read_text()
    return re.search(rf"^### {re.escape(title)}\n(.*?)(?=^### )", guide, re.S | re.M).group(1)


def table_rows(section, header):
    """The rows of the section's table whose header line starts with ``header``, each a dict
    from the header's cells to the row's."""
    lines = section.splitlines()
    first = next(n for n, line in enumerate(lines) if line.startswith(header))
    table = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [dict(zip(table[0], row)) for row in table[2:]]


def days_of(title, header):
    """{day: ([(lesson, minutes), ...], in all, lab)} of a plan's table."""
    days = {}
    for cells in table_rows(plan_section(title), header):
        lessons = [(lesson, int(minutes)) for lesson, minutes in
                   re.findall(r"(\d\d[a-z]?(?: part \d)?) \((\d+)\)", cells["lessons (minutes)"])]
        days[int(cells["day"])] = (lessons, int(cells["in all"]),
                                   cells["afternoon lab (batch files)"])
    return days


FIVE_DAYS = ("Five days", "| day | topic | lessons (minutes) | in all |")
THREE_DAYS = ("Three days: an advanced track", "| day | lessons (minutes) | in all |")


def test_the_five_days_teach_the_source_curriculum():
    """Each day of the guide's five-day table names exactly the lessons of the source
    curriculum, and the week teaches every lesson of lesson_time.json once."""
    days = days_of(*FIVE_DAYS)
    assert {day: sorted(lesson for lesson, _ in lessons) for day, (lessons, _, _) in days.items()} \
        == CURRICULUM
    minutes = lesson_minutes()
    whole = {name for name in minutes if " part " not in name}
    taught = {lesson.split(" part ")[0] for lessons in CURRICULUM.values() for lesson in lessons}
    assert taught == whole
    assert sum(minutes for lessons, _, _ in days.values() for _, minutes in lessons) == \
        sum(minutes[name] for name in whole)


@pytest.mark.parametrize("title, header", [FIVE_DAYS, THREE_DAYS])
def test_each_days_lesson_minutes_are_lesson_time_json(title, header):
    """Every lesson (or part) in a plan's table has lesson_time.json's minutes, and "in all" is
    the day's sum; the parts of a lesson add up to it."""
    minutes = lesson_minutes()
    for number in PART_STARTS:
        parts = [value for name, value in minutes.items() if name.startswith(f"{number} part ")]
        assert sum(parts) == minutes[number], number
    for day, (lessons, in_all, _) in days_of(title, header).items():
        assert lessons, day
        for lesson, shown in lessons:
            assert shown == minutes[lesson], (day, lesson)
        assert in_all == sum(shown for _, shown in lessons), day


def test_the_one_days_lessons_are_lesson_time_json():
    """The one-day table's lesson minutes: 00, 01, 02 and part 1 of 04 whole, and 04's bubble
    section."""
    measured = json.loads((KIT_ROOT / "benchmarks" / "results" / "lesson_time.json").read_text())
    bubble = next(section["minutes"] for section in
                  measured["lessons"]["04-model-parallelism"]["sections"]
                  if section["heading"] == "Pipeline parallelism and its bubble")
    section = plan_section("One day")
    shown = dict(re.findall(r"lesson (\d\d(?:, part \d)?) \((\d+) min", section))
    minutes = lesson_minutes()
    assert {name: int(value) for name, value in shown.items()} == \
        {"00": minutes["00"], "01": minutes["01"], "02": minutes["02"],
         "04, part 1": minutes["04 part 1"]}
    assert f'"Pipeline parallelism and its bubble" ({round(bubble)} min)' in section


@pytest.mark.parametrize("plan_name, title, header", [
    ("5-days", *FIVE_DAYS), ("3-days", *THREE_DAYS)])
def test_each_days_lab_submits_the_stages_of_plans(plan_name, title, header):
    """The batch files a day's lab names in the guide are the stages PLANS counts for that day
    (the MLflow UI, which asks for no GPU, aside)."""
    for day, (_, _, lab) in days_of(title, header).items():
        named = set(re.findall(r"batch-([a-z]+)-", lab)) - {"mlflow"}
        assert named == {job.stage for job in plan.PLANS[plan_name][day - 1]}, day
    assert len(days_of(title, header)) == len(plan.PLANS[plan_name])


def test_the_one_days_lab_submits_the_stages_of_plans():
    named = set(re.findall(r"batch-([a-z]+)-", plan_section("One day")))
    assert named == {job.stage for job in plan.PLANS["1-day"][0]}


def test_the_guides_worked_example_is_what_the_command_prints(capsys):
    guide = (KIT_ROOT / "book" / "instructor.md").read_text()
    shown = re.search(r"\$ \.venv/bin/python -m coursekit plan ([^\n]+)\n(.*?)\n```", guide,
                      re.S)
    assert cli.main(["plan", *shown.group(1).split()]) == 0
    assert capsys.readouterr().out.rstrip("\n") == shown.group(2)


@pytest.mark.parametrize("args, message", [
    (["2-days", "--site", "ci", "--trainees", "3"],
     "error: unknown plan '2-days' (choose from 1-hour, 1-day, 3-days, 5-days)"),
    (["1-day", "--site", "nowhere", "--trainees", "3"], "error: no site profile "),
    (["1-day", "--site", "ci", "--trainees", "0"],
     "argument --trainees: expected a positive integer, got 0"),
    (["1-day", "--site", "ci", "--trainees", "3", "--selftest", "missing.json"],
     "error: no self-test report missing.json: give the selftest.json that batch-selftest wrote"),
    (["1-day", "--site", "ci", "--trainees", "3", "--selftest", "course.toml"],
     "error: course.toml is not a self-test's selftest.json (no plan and runs)"),
])
def test_bad_input_is_one_line(capsys, monkeypatch, args, message):
    monkeypatch.chdir(KIT_ROOT)
    status, stderr = refused(capsys, *args)
    assert status == 2 and stderr.count("\n") == 1 and message in stderr, stderr


def test_a_self_test_of_another_model_is_refused_in_one_line(capsys, tmp_path):
    """Tokens per second of GPT-2 124M would not time the test cluster's tiny jobs."""
    report = tmp_path / "selftest.json"
    report.write_text(json.dumps({"plan": {"preset": "gpt2-124m"}, "runs": []}))
    status, stderr = refused(capsys, "1-day", "--site", "ci", "--trainees", 3, "--selftest", report)
    assert status == 2 and stderr == ("error: the self-test measured the gpt2-124m preset; site ci "
                                      "trains tiny: run batch-selftest on that site first\n")
