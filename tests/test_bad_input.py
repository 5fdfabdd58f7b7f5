"""Bad input to the kit's command lines gets one line that names the bad value and what is
allowed, no traceback, and changes nothing already written. The cases here are those the other
files do not hold already (the std, lit, lora and hpo stages', the data, diffs, batchfiles,
registry, scaling and memory commands' are beside their tests): the distributed stages' own
parsing, pointed at a finished run they must leave alone; the kit's other subcommands; and what
the kit reads from the environment. Each runs in this process, as the first thing the command
does."""
import hashlib

import pytest

from coursekit import KIT_ROOT, KitError, cli, course, distributed, faults, stages, watchdog

pytestmark = pytest.mark.unit

SHARED = [(["--micro-batch", "0"], "argument --micro-batch: expected a positive integer, got 0"),
          (["--device", "tpu"], "argument --device: invalid choice: 'tpu' (choose from 'auto', "
                                "'cuda', 'xpu', 'cpu')"),
          (["--lr", "fast"], "argument --lr: expected a positive number, got 'fast'"),
          (["--weight-decay", "-1"], "argument --weight-decay: expected a number >= 0, got -1"),
          (["--preset", "huge"], "argument --preset: invalid choice: 'huge' (choose from"),
          (["--track", "wandb"], "argument --track: invalid choice: 'wandb' (choose from "
                                 "'none', 'mlflow', 'tensorboard')")]
STAGE_CASES = [(stage, args, message) for stage in ("ddp", "fsdp", "tp", "pp")
               for args, message in SHARED] + [
    ("tp", ["--tp", "0"], "argument --tp: expected a positive integer, got 0"),
    ("pp", ["--schedule", "zigzag"], "argument --schedule: invalid choice: 'zigzag' (choose from"),
]
COMMAND_CASES = [
    (["nosuch"], "argument COMMAND: invalid choice: 'nosuch' (choose from 'envcheck'"),
    (["mlflow-server", "--port", "80"], "argument --port: expected a TCP port, 1024 to 65535, "
                                        "got 80"),
    (["mlflow-server", "--port", "70000"], "argument --port: expected a TCP port, 1024 to 65535, "
                                           "got 70000"),
    (["book", "--edition", "student"], "argument --edition: invalid choice: 'student' (choose "
                                       "from 'reader', 'instructor')"),
    (["tokenizer", "nosuch"], "argument action: invalid choice: 'nosuch' (choose from 'fetch')"),
    (["trainee-kit"], "the following arguments are required: --out"),
    (["verify-data", "/nonexistent/run"], "error: /nonexistent/run is not a run directory (no "
                                          "config.json)"),
    (["export-hf", "/nonexistent/run", "/nonexistent/out"],
     "error: run directory /nonexistent/run does not exist"),
    (["selftest", "--stages", "ddp,zero"], "argument --stages: 'ddp,zero': expected stages among "
                                           "ddp, fsdp, lit, pp, std, tp, comma-separated"),
    (["assignments", "--root", "/nonexistent/course"],
     "error: --root /nonexistent/course holds no notebooks/ folder"),
    (["grades", "99-nosuch", "--root", str(KIT_ROOT)],
     "error: '99-nosuch' is not a lesson of the course in "),
    (["autograde", "01-single-gpu-gpt", "--root", "/nonexistent/course"],
     "error: '01-single-gpu-gpt' is not a lesson of the course in /nonexistent/course: choose "
     "from (none: give the course root with --root)"),
    (["exchange", "create", "/nonexistent/exchange", "--group", "no-such-group"],
     "error: --group 'no-such-group' is not a Unix group here"),
    (["lab", "--state", "runs/mine"], "error: --state runs/mine: only a lab with --tunnel keeps "
                                      "a token"),
]


def files_of(folder):
    """{path: SHA-256} of every file under folder."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line(stderr):
    return len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr


@pytest.fixture(scope="module")
def scripts():
    return {stage: stages.load(stage) for stage in ("ddp", "fsdp", "tp", "pp")}


@pytest.mark.stages  # each case reads a 20-step run of the std stage, which it must leave alone
@pytest.mark.slow
@pytest.mark.parametrize("stage, args, message", STAGE_CASES,
                         ids=[f"{s} {' '.join(a)}" for s, a, _ in STAGE_CASES])
def test_a_distributed_stage_refuses_a_bad_value_and_leaves_the_run_alone(
        scripts, stage, args, message, builtin_data, std_twenty_steps, capsys):
    before = files_of(std_twenty_steps)
    with pytest.raises(SystemExit) as stopped:
        scripts[stage].parse_args(["--preset", "tiny", "--data", str(builtin_data), "--out",
                                   str(std_twenty_steps), "--resume", *args])
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2 and message in stderr and one_line(stderr), stderr
    assert files_of(std_twenty_steps) == before


@pytest.mark.parametrize("args, message", COMMAND_CASES, ids=[" ".join(a) for a, _ in COMMAND_CASES])
def test_a_kit_command_refuses_a_bad_value_in_one_line(args, message, capsys):
    try:
        status = cli.main(args)
    except SystemExit as stopped:
        status = stopped.code
    stderr = capsys.readouterr().err
    assert status == 2 and message in stderr and one_line(stderr), stderr


def test_a_taken_port_is_one_line_before_mlflow_starts():
    from coursekit import mlflow_server
    with mlflow_server.socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(KitError, match=rf"^--port {port}: 127.0.0.1:{port} cannot be used "
                                           r"\(Address already in use\): choose another"):
            mlflow_server.refuse_taken(port)


@pytest.mark.parametrize("value", ["soon", "0", "-5"])
def test_a_bad_collective_timeout_is_one_line(value, monkeypatch):
    monkeypatch.setenv("KIT_DIST_TIMEOUT", value)
    assert faults.run(distributed.dist_timeout) == \
        f"error: KIT_DIST_TIMEOUT={value!r}: expected a number of seconds > 0"


@pytest.mark.parametrize("value", ["never", "-1", "nan"])
def test_a_bad_watchdog_time_is_one_line(value, monkeypatch):
    monkeypatch.setenv("KIT_WATCHDOG", value)
    assert faults.run(watchdog.watchdog_seconds) == \
        f"error: KIT_WATCHDOG={value!r}: expected a number of seconds >= 0 (0: no watchdog)"


@pytest.mark.parametrize("settings, message", [
    ('id = "gpt course"\nexchange = "/project/x"\n', "id 'gpt course' is not a course id"),
    ('id = "gpt-course"\n', "exchange '' is not an absolute path"),
    ('id = "gpt-course"\nexchange = "exchange"\n', "exchange 'exchange' is not an absolute path"),
    ('id = gpt-course\n', "course.toml: "),
], ids=["space in id", "no exchange", "relative exchange", "not toml"])
def test_a_bad_course_toml_stops_nbgrader_in_one_line(settings, message, tmp_path):
    """nbgrader_config.py reads course.toml: a bad one stops nbgrader's command with one line
    (its config loader would log the exception and go on without the exchange)."""
    (tmp_path / "course.toml").write_text(settings)
    with pytest.raises(SystemExit) as stopped:
        course.configure(object(), tmp_path)
    assert str(stopped.value).startswith(f"error: {tmp_path / 'course.toml'}: ") and \
        message in str(stopped.value) and "\n" not in str(stopped.value)


def group_of(folder):
    import grp
    return grp.getgrgid(folder.stat().st_gid).gr_name


def test_a_gate_its_group_can_write_in_is_refused_with_its_mode(tmp_path, capsys):
    """Issue 48, item 10: a project folder every trainee writes in (2770) would let any of them
    rename the exchange and put their own in its place."""
    gate = tmp_path / "project"
    gate.mkdir()
    gate.chmod(0o2770)
    group = group_of(gate)
    assert cli.main(["exchange", "create", str(gate / "exchange"), "--group", group]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith(f"error: {gate} (group {group}, mode 2770) must be of group {group}, "
                             "which must reach it but not write in it") and one_line(stderr)
    assert not (gate / "exchange").exists()


def test_an_exchange_that_exists_is_refused(tmp_path, capsys):
    (tmp_path / "exchange").mkdir()
    assert cli.main(["exchange", "create", str(tmp_path / "exchange"), "--group", "root"]) == 2
    stderr = capsys.readouterr().err
    assert stderr == (f"error: {tmp_path / 'exchange'} exists: the exchange is made once, in a new "
                      "folder\n")


def test_a_gate_everyone_can_write_in_is_refused_with_its_mode(tmp_path, capsys):
    """A gate such as /tmp (1777): anyone could rename the exchange and put one in its place."""
    gate = tmp_path / "open"
    gate.mkdir()
    gate.chmod(0o1777)
    assert cli.main(["exchange", "create", str(gate / "exchange"), "--group", "root"]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith(f"error: {gate} (group {group_of(gate)}, mode 1777) must be of group "
                             "root, which must reach it but not write in it, and closed to "
                             "others") and one_line(stderr)
    assert not (gate / "exchange").exists()


def test_the_exchange_line_gives_the_gates_real_mode(tmp_path, capsys):
    gate = tmp_path / "course"
    gate.mkdir()
    gate.chmod(0o2710)  # the group may pass through, not list: stricter than the kit's own
    group = group_of(gate)
    assert cli.main(["exchange", "create", str(gate / "exchange"), "--group", group]) == 0
    assert f"behind {gate} (group {group}, mode 2710)" in capsys.readouterr().out


@pytest.mark.parametrize("command, says", [
    (["selftest"], ["Prove a node", "selftest.json and selftest.md", "steps of each run (default "
                                                                      "20)"]),
    (["assignments"], ["release/<lesson>/", "gradebook.db", "generating a lesson again after "
                                                            "that replaces those records"]),
    (["exchange", "create"], ["usage: python -m coursekit exchange create", "course.toml",
                              "mode 1777", "mode 2750"]),
], ids=["selftest", "assignments", "exchange create"])
def test_help_says_what_a_command_writes_and_its_defaults(command, says, capsys):
    """Issue 48, item 11: an instructor learns a command from its --help."""
    with pytest.raises(SystemExit):
        cli.main([*command, "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert all(" ".join(text.split()) in shown for text in says), shown
