"""`coursekit plan` (issue 51, item 2): the GPU-hours, reservations and storage of a course plan
on a site, checked against the batch files the site gets and the instructor guide. The run times
measured by a real self-test: tests/test_selftest.py."""
import json
import math
import re

import pytest

from coursekit import KIT_ROOT, cli, plan, slurm

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
    """Day 5 of the five days: a ddp job on a node and the HPO array's 8 tasks, 4 at a time;
    the storage counts day 2's ddp run directory once though day 5 submits that file again."""
    made = planned(capsys, "5-days", "--site", "ci", "--trainees", 1, "--margin", 0)
    day5 = made["days"][4]
    assert [(job["file"], job["count"], job["at_once"]) for job in day5["jobs"]] == \
        [("batch-ddp-1n2g.sh", 1, 1), ("batch-hpo-1n1g.sh", 8, 4)]
    assert day5["reservation"]["nodes"] == math.ceil((2 + 4) / 2)
    again = [job for job in jobs_of(made) if job["file"] == "batch-ddp-1n2g.sh"]
    assert len(again) == 2 and len({job["run_dir"] for job in again}) == 1


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
