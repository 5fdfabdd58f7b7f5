"""The Open OnDemand app in ondemand/ works, without an OnDemand server.

OnDemand does three things with the app: it renders the ERB templates with the user's form values,
submits a Slurm job with the options from submit.yml, and in that job sources template/before.sh
and runs template/script.sh, then shows view.html.erb as the "Connect" button. These tests do the
same, one step at a time:

- every template renders with Ruby's ERB, the same engine and trim mode OnDemand uses, and from only
  the attributes the form declares;
- form.yml, submit.yml and manifest.yml are valid YAML with the fields OnDemand needs, and the
  Slurm options follow the form (account, partition, GPUs, CPUs);
- the rendered shell scripts pass shellcheck and `bash -n`, and script.sh refuses, in one line, to
  start without the kit's .venv;
- end to end: before.sh and script.sh, run by a small stand-in for OnDemand's job wrapper, start
  JupyterLab from the kit's venv, which answers under OnDemand's /node/<host>/<port>/ path with the
  session's password as its token, and the Connect button's login form logs a browser in.

Markers: the tests that render a template need Ruby (apt-get installs it on first use) and are
`ondemand`; the end-to-end session starts JupyterLab and MLflow and is `slow` too; only the two
that read the app's files and nothing else are `unit`.
"""
import html.parser
import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import (debian_tool, free_port, http_get, mlflow_reported_port,
                      mlflow_server_command, owner_login)
from coursekit import KIT_ROOT

APP = KIT_ROOT / "ondemand"
RENDER_RB = Path(__file__).parent / "ondemand" / "render.rb"
SHELLCHECK = Path(sys.executable).parent / "shellcheck"

# OnDemand's "smart" attributes: a form may list them without defining them.
ONDEMAND_ATTRIBUTES = {"bc_account", "bc_queue", "bc_num_hours", "bc_num_slots",
                       "bc_email_on_started", "bc_vnc_resolution"}

# What a user typed into the form, and the hidden portal origin a centre set in it. OnDemand hands
# every form value to the templates as a string.
PORTAL = "https://portal.test"
SAMPLE_FORM = {"account": "proj123", "partition": "gpu", "num_gpus": "2", "bc_num_hours": "3",
               "kit_dir": "$HOME/gpt-course-kit", "bc_email_on_started": "0",
               "portal_origin": PORTAL}


# --- Ruby, to render the templates as OnDemand does ----------------------------------------------

@pytest.fixture(scope="session")
def ruby():
    return debian_tool("ruby", "ruby")


def render(ruby, template, values, tmp_path):
    """The text OnDemand would make from `template` (relative to ondemand/) with these values."""
    values_file = tmp_path / f"values-{Path(template).name}.json"
    values_file.write_text(json.dumps(values))
    done = subprocess.run([ruby, str(RENDER_RB), str(APP / template), str(values_file)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"rendering {template} failed:\n{done.stderr}"
    return done.stdout


def form_values(ruby, tmp_path, **typed):
    """SAMPLE_FORM with some fields retyped; fails unless the form has exactly these fields."""
    form = yaml.safe_load(render(ruby, "form.yml.erb", {}, tmp_path))
    assert sorted(form["form"]) == sorted(SAMPLE_FORM)
    return {**SAMPLE_FORM, **typed}


# --- manifest.yml and form.yml.erb ----------------------------------------------------------------

@pytest.mark.unit
def test_manifest_declares_a_batch_connect_app():
    manifest = yaml.safe_load((APP / "manifest.yml").read_text())
    assert manifest["role"] == "batch_connect"
    assert manifest["name"] == "GPT training course kit (JupyterLab)"
    assert manifest["category"] == "Interactive Apps"
    assert manifest["subcategory"] and manifest["description"]


@pytest.mark.ondemand
def test_form_defines_every_field_it_shows(ruby, tmp_path):
    form = yaml.safe_load(render(ruby, "form.yml.erb", {}, tmp_path))
    attributes = form["attributes"]
    undefined = [name for name in form["form"]
                 if name not in attributes and name not in ONDEMAND_ATTRIBUTES]
    assert not undefined, f"form fields with no definition: {undefined}"
    # The placeholders the centre replaces, and no real account shipped as a default.
    assert form["cluster"] == "my_cluster"
    assert attributes["portal_origin"] == {"widget": "hidden_field",
                                           "value": "https://ondemand.example.org"}
    assert attributes["account"]["required"] is True and not attributes["account"]["value"]


@pytest.mark.ondemand
@pytest.mark.parametrize("name, value, low, high", [("bc_num_hours", 2, 1, 12),
                                                    ("num_gpus", 1, 0, 4)])
def test_form_numbers_have_their_default_and_bounds(ruby, tmp_path, name, value, low, high):
    field = yaml.safe_load(render(ruby, "form.yml.erb", {}, tmp_path))["attributes"][name]
    assert (field["value"], field["min"], field["max"]) == (value, low, high)


@pytest.mark.ondemand
def test_form_defaults_for_partition_and_kit(ruby, tmp_path):
    attributes = yaml.safe_load(render(ruby, "form.yml.erb", {}, tmp_path))["attributes"]
    assert attributes["partition"]["value"] == "gpu"
    assert attributes["kit_dir"]["value"] == "$HOME/gpt-course-kit"


# --- submit.yml.erb: the Slurm job ---------------------------------------------------------------

def native_options(ruby, tmp_path, **typed):
    submit = yaml.safe_load(render(ruby, "submit.yml.erb", form_values(ruby, tmp_path, **typed),
                                   tmp_path))
    assert submit["batch_connect"]["template"] == "basic"
    return submit["script"]["native"]


@pytest.mark.ondemand
def test_submit_asks_for_the_account_partition_and_gpus(ruby, tmp_path):
    native = native_options(ruby, tmp_path, bc_num_hours="3", num_gpus="2", account="proj123",
                            partition="gpu")
    for option in ("--account=proj123", "--partition=gpu", "--gpus-per-node=2", "--nodes=1",
                   "--ntasks-per-node=1", "--cpus-per-task=16"):
        assert option in native
    # The wall time has one owner: OnDemand sets it from bc_num_hours, so native must not.
    assert not [option for option in native if option.startswith(("--time", "-t"))]


@pytest.mark.ondemand
@pytest.mark.parametrize("gpus, cpus", [("0", 2), ("1", 8), ("4", 32), ("9", 32)])
def test_cpus_follow_the_gpus_and_cpu_only_asks_for_no_gpu(ruby, tmp_path, gpus, cpus):
    native = native_options(ruby, tmp_path, num_gpus=gpus)
    assert f"--cpus-per-task={cpus}" in native
    gpu_options = [option for option in native if "gpu" in option.split("=")[0]]
    expected = [] if gpus == "0" else [f"--gpus-per-node={min(int(gpus), 4)}"]
    assert gpu_options == expected


@pytest.mark.ondemand
def test_typed_text_cannot_break_the_yaml(ruby, tmp_path):
    native = native_options(ruby, tmp_path, account='a"b: c', partition=" gpu ")
    assert 'a"b: c' in native[0] and "--partition=gpu" in native
    assert not [option for option in native_options(ruby, tmp_path, account=" ")
                if option.startswith("--account")]


# --- template/: the job's shell scripts ----------------------------------------------------------

TEMPLATES = ["template/before.sh.erb", "template/script.sh.erb"]


def render_template(ruby, template, tmp_path, **typed):
    """A job's script as OnDemand renders it: form values reach template/ through `context`."""
    return render(ruby, template, {"context": form_values(ruby, tmp_path, **typed)}, tmp_path)


@pytest.mark.ondemand
@pytest.mark.parametrize("template", TEMPLATES)
def test_rendered_scripts_pass_shellcheck_and_bash_n(ruby, tmp_path, template):
    script = tmp_path / Path(template).stem
    script.write_text(render_template(ruby, template, tmp_path))
    # -s bash: before.sh is sourced by OnDemand's bash wrapper, so it has no shebang to tell.
    lint = subprocess.run([str(SHELLCHECK), "-s", "bash", str(script)], capture_output=True,
                          text=True)
    assert lint.returncode == 0, lint.stdout
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


@pytest.mark.ondemand
@pytest.mark.parametrize("template, values", [
    ("form.yml.erb", {}),
    ("submit.yml.erb", SAMPLE_FORM),
    ("template/before.sh.erb", {"context": SAMPLE_FORM}),
    ("template/script.sh.erb", {"context": SAMPLE_FORM}),
    ("view.html.erb", {"host": "gpu042", "port": "41234", "password": "s3cret"}),
])
def test_no_erb_tags_are_left(ruby, tmp_path, template, values):
    text = render(ruby, template, values, tmp_path)
    assert "<%" not in text and "%>" not in text


@pytest.mark.unit
def test_script_is_executable_and_before_is_not_a_program():
    # OnDemand runs template/script.sh as a program and sources before.sh.
    assert (APP / "template/script.sh.erb").stat().st_mode & stat.S_IXUSR
    assert (APP / "template/script.sh.erb").read_text().startswith("#!/usr/bin/env bash\n")
    assert not (APP / "template/before.sh.erb").read_text().startswith("#!")


# A stand-in for what OnDemand's batch script does around the app's two files: set $host, define
# find_port and create_passwd, source before.sh, write the connection file, run script.sh.
ONDEMAND_WRAPPER = r"""
host=127.0.0.1
find_port() { echo "${TEST_PORT}"; }
create_passwd() { head -c 512 /dev/urandom | tr -dc 'A-Za-z0-9' | head -c "${1:-32}"; }
options_before="$-"
source ./before.sh
[[ "$-" == "${options_before}" ]] || { echo "before.sh changed the shell options" >&2; exit 3; }
# Jupyter refuses to run as root unless told; only a test container runs sessions as root.
if [[ ${EUID} -eq 0 ]]; then echo 'c.ServerApp.allow_root = True' >> "${CONFIG_FILE}"; fi
printf 'host: "%s"\nport: %s\npassword: "%s"\n' "${host}" "${port}" "${password}" > connection.yml
exec ./script.sh
"""


def stage_session(ruby, tmp_path, **typed):
    """A session's working directory as OnDemand prepares it: the rendered template/ plus the
    wrapper. Returns the directory."""
    job = tmp_path / "job"
    job.mkdir()
    for template in TEMPLATES:
        script = job / Path(template).stem
        script.write_text(render_template(ruby, template, tmp_path, **typed))
        script.chmod((APP / template).stat().st_mode & 0o777)
    (job / "wrapper.sh").write_text(ONDEMAND_WRAPPER)
    return job


def job_env(home, port, fake_bin=None):
    """A compute node's bare environment: a home, the system PATH, what Slurm sets."""
    path = ":".join(filter(None, [str(fake_bin or ""), "/usr/local/bin:/usr/bin:/bin"]))
    return {"HOME": str(home), "PATH": path, "LANG": "C.UTF-8", "TEST_PORT": str(port),
            "SLURM_CPUS_PER_TASK": "2"}


@pytest.mark.ondemand
def test_before_writes_a_private_config_with_the_session_port(ruby, tmp_path):
    job = stage_session(ruby, tmp_path, kit_dir="~/kit")
    (job / "wrapper.sh").write_text(ONDEMAND_WRAPPER.replace("exec ./script.sh", "env"))
    done = subprocess.run(["bash", "wrapper.sh"], cwd=job, env=job_env(tmp_path, 43210),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    config = job / "jupyter_server_config.py"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert "c.ServerApp.port = 43210" in config.read_text()
    assert 'c.ServerApp.base_url = "/node/127.0.0.1/43210/"' in config.read_text()
    exported = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert exported["KIT_DIR"] == f"{tmp_path}/kit" and exported["CONFIG_FILE"] == str(config)
    assert exported["port"] == "43210" and len(exported["password"]) == 16


@pytest.mark.ondemand
@pytest.mark.parametrize("make_kit, message", [(True, "run `make setup`"),
                                               (False, "no course kit at")])
def test_script_stops_in_one_line_without_the_kit_or_its_venv(ruby, tmp_path, make_kit, message):
    kit = tmp_path / "kit"
    if make_kit:
        kit.mkdir()  # a checkout on which `make setup` was never run: no .venv
    job = stage_session(ruby, tmp_path, kit_dir=str(kit))
    done = subprocess.run(["bash", "wrapper.sh"], cwd=job, env=job_env(tmp_path, 43210),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr


# --- end to end: the session starts JupyterLab and the Connect button logs in --------------------

class _Form(html.parser.HTMLParser):
    """The action and the named inputs of the first form in an HTML page."""

    def __init__(self):
        super().__init__()
        self.action, self.fields = None, {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "form" and self.action is None:
            self.action = attrs["action"]
        elif tag == "input" and "name" in attrs:
            self.fields[attrs["name"]] = attrs.get("value", "")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # we look at the redirect itself


def wait_for_jupyter(url, token, process, log, timeout=90):
    """Poll a URL of the session with its token until it answers, and return the answer's body;
    fail early if ``process`` (the session, or a server started in it) exits."""
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the session ended with {process.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                return answer.read()
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.5)  # the interval between two requests: the loop waits for an answer
    pytest.fail(f"JupyterLab did not answer within {timeout} s:\n{log.read_text()}")


def connection_file(job, process, log, timeout=30):
    """The host, port and password the wrapper saved, as OnDemand's connection.yml."""
    deadline = time.monotonic() + timeout
    while (connection := saved_connection(job)) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"before.sh did not finish:\n{log.read_text()}")
        time.sleep(0.2)  # the interval between two looks, not a wait for the file
    return connection


def saved_connection(job):
    """connection.yml once it holds all three fields: the file exists from the moment printf's
    redirection creates it, before anything is written to it."""
    try:
        saved = yaml.safe_load((job / "connection.yml").read_text())
    except FileNotFoundError:
        return None
    complete = isinstance(saved, dict) and {"host", "port", "password"} <= saved.keys()
    return saved if complete else None


def stop(process):
    """End the session's whole process group: JupyterLab and any kernel it started."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


#: A page of another origin that the browser sends the session's cookie with: a sibling
#: subdomain of the portal, which SameSite=Strict counts as the same site.
EVIL = "https://evil.portal.test"


def assert_other_origins_change_nothing(base, session_cookie, browser):
    """Issue 47, item 5: with the session's cookie, a POST from another origin to nbgrader's
    handlers, the formgrader's autograde and jupyter-server-proxy is refused (403) before any
    of them runs; from the portal's own page without the XSRF token too, as Jupyter's API is."""
    def post(path, origin):
        request = urllib.request.Request(f"{base}/{path}", data=b"", method="POST", headers={
            "Cookie": session_cookie, "Origin": origin})
        try:
            return browser.open(request, timeout=30).status
        except urllib.error.HTTPError as refused:
            return refused.code
    for path in ("assignments/fetch?course_id=c&assignment_id=a", "assignments/submit",
                 "assignments/validate", "formgrader/api/submission/lesson/trainee/autograde"):
        assert post(path, EVIL) == 403, path
        assert post(path, PORTAL) == 403, path  # no XSRF token
    # the proxied app (MLflow's UI) checks its own requests: the portal's pages reach it
    assert post(f"proxy/{free_port()}/anything", EVIL) == 403


def command_line(process):
    """The process's command line, or none once it has ended (a child of the session that
    exits while the test lists them, a zombie until it is reaped)."""
    try:
        return process.cmdline()
    except psutil.NoSuchProcess:  # ZombieProcess too
        return []


def assert_kernels_listen_on_no_port(base, token, session):
    """Issue 47, item 10: a kernel started in the session takes its connections over Unix
    sockets beside its connection file, in a folder only its user can enter, and listens on no
    TCP port (where any user of the node could send it code, or read what it prints)."""
    start = urllib.request.Request(f"{base}/api/kernels", data=b"{}", headers=token,
                                   method="POST")
    with urllib.request.urlopen(start) as answer:
        kernel_id = json.load(answer)["id"]
    try:
        deadline = time.monotonic() + 60
        while not (kernels := [child for child in psutil.Process(session.pid).children(True)
                               if kernel_id in " ".join(command_line(child))]):
            assert time.monotonic() < deadline, "the kernel never started"
            time.sleep(0.5)
        kernel = kernels[0]
        connection_file = Path(kernel.cmdline()[kernel.cmdline().index("-f") + 1])
        assert json.loads(connection_file.read_text())["transport"] == "ipc"
        assert connection_file.parent.stat().st_mode & 0o777 == 0o700
        time.sleep(2)  # its sockets are bound once it has started
        # Over TCP a kernel listens on 6 ports: its 5 channels and ipykernel's pipe for the output
        # of forked processes, which drops every message without the kernel's random key. Over
        # IPC only that pipe is left.
        listening = [c for c in kernel.net_connections("tcp") if c.status == "LISTEN"]
        assert len(listening) <= 1, listening
    finally:
        urllib.request.urlopen(urllib.request.Request(f"{base}/api/kernels/{kernel_id}",
                                                      headers=token, method="DELETE"))


@pytest.mark.ondemand
@pytest.mark.slow
def test_session_starts_jupyterlab_behind_the_node_proxy(ruby, tmp_path):
    # The user's home holds the kit at the form's default place, $HOME/gpt-course-kit.
    home = tmp_path / "home"
    home.mkdir()
    (home / "gpt-course-kit").symlink_to(KIT_ROOT)
    # A node with one GPU, as far as script.sh can tell.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: Test GPU (UUID: GPU-0)'\n")
    (fake_bin / "nvidia-smi").chmod(0o755)

    job = stage_session(ruby, tmp_path)
    log = job / "output.log"
    with log.open("w") as out:
        # No jupyter on this PATH: script.sh must find it by activating the kit's venv.
        session = subprocess.Popen(["bash", "wrapper.sh"], cwd=job, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   env=job_env(home, free_port(), fake_bin))
    try:
        conn = connection_file(job, session, log)
        base = f"http://127.0.0.1:{conn['port']}/node/{conn['host']}/{conn['port']}"
        status = json.loads(wait_for_jupyter(f"{base}/api/status", conn["password"], session, log))
        assert "started" in status

        # The job's output says what it found; the server process has the course environment.
        text = log.read_text()
        assert f"python: {KIT_ROOT}/.venv/bin/python" in text
        assert "GPU 0: Test GPU" in text and "OpenMP threads: 2" in text
        environ = dict(entry.split("=", 1) for entry in
                       Path(f"/proc/{session.pid}/environ").read_text().split("\0") if "=" in entry)
        assert Path(environ["VIRTUAL_ENV"]).resolve() == (KIT_ROOT / ".venv").resolve()
        assert environ["TIKTOKEN_CACHE_DIR"] == f"{home}/gpt-course-kit/.cache/tiktoken"
        assert environ["HF_HUB_OFFLINE"] == environ["HF_DATASETS_OFFLINE"] == "1"
        assert environ["OMP_NUM_THREADS"] == "2"

        # JupyterLab opens in the kit, and its kernel is the venv's "python3".
        token = {"Authorization": f"token {conn['password']}"}
        with urllib.request.urlopen(urllib.request.Request(f"{base}/api/contents",
                                                           headers=token)) as answer:
            names = {item["name"] for item in json.load(answer)["content"]}
        assert {"notebooks", "solutions", "coursekit"} <= names
        with urllib.request.urlopen(urllib.request.Request(f"{base}/api/kernelspecs",
                                                           headers=token)) as answer:
            assert "python3" in json.load(answer)["kernelspecs"]
        assert_kernels_listen_on_no_port(base, token, session)

        # The Connect button: post view.html.erb's form as a browser would, without a token.
        view = _Form()
        view.feed(render(ruby, "view.html.erb", conn, tmp_path))
        assert view.action == f"/node/{conn['host']}/{conn['port']}/login"
        browser = urllib.request.build_opener(_NoRedirect)
        login = urllib.request.Request(f"http://127.0.0.1:{conn['port']}{view.action}",
                                       data=urllib.parse.urlencode(view.fields).encode(),
                                       headers={"Origin": PORTAL})  # the dashboard's page
        with pytest.raises(urllib.error.HTTPError) as forged:  # the same form, posted elsewhere
            browser.open(urllib.request.Request(login.full_url, data=login.data,
                                                headers={"Origin": EVIL}), timeout=10)
        assert forged.value.code == 403
        with pytest.raises(urllib.error.HTTPError) as redirect:
            browser.open(login, timeout=10)
        assert redirect.value.code == 302, redirect.value.read()
        lab = f"/node/{conn['host']}/{conn['port']}/lab"
        assert redirect.value.headers["Location"].endswith(lab)
        cookie = redirect.value.headers["Set-Cookie"]
        assert "SameSite=Strict" in cookie  # browsers keep it to requests from the portal's site
        # With that cookie, as a browser sends it: the portal's pages may call the API, a page
        # of any other origin (another app behind the portal, a sibling subdomain) may not.
        contents = f"{base}/api/contents"
        for origin, allowed in ((PORTAL, True), (EVIL, False), ("null", False)):
            request = urllib.request.Request(contents, headers={
                "Cookie": cookie.split(";", 1)[0], "Origin": origin})
            try:
                answered = browser.open(request, timeout=10).status
            except urllib.error.HTTPError as refused:
                answered = refused.code
            assert (answered == 200) == allowed, (origin, answered)
        assert_other_origins_change_nothing(base, cookie.split(";", 1)[0], browser)
        # ...and a wrong password does not log in.
        wrong = urllib.request.Request(login.full_url, data=b"password=wrong",
                                       headers={"Origin": PORTAL})
        with pytest.raises(urllib.error.HTTPError) as refused:
            browser.open(wrong, timeout=10)
        assert refused.value.code == 401

        # The MLflow UI of lesson 06, started in the session on 127.0.0.1 by the kit, through
        # the portal: jupyter-server-proxy serves it behind the session's own login, and MLflow
        # asks for its owner's password as well (other users of the node reach 127.0.0.1 too).
        state, ui_log = tmp_path / "mlflow-server", tmp_path / "mlflow-ui.log"
        with open(ui_log, "w") as output:
            ui = subprocess.Popen(mlflow_server_command(
                state, "--store", f"sqlite:///{tmp_path / 'mlflow.db'}", "--artifacts",
                tmp_path / "mlartifacts"), stdout=output, stderr=subprocess.STDOUT,
                start_new_session=True)
        try:
            ui_port = mlflow_reported_port(ui_log, 0, ui, timeout=180)  # the kit chose it
            proxied = f"{base}/proxy/{ui_port}"
            wait_for_jupyter(f"{proxied}/health", conn["password"], ui, log, timeout=180)
            search = f"{proxied}/ajax-api/2.0/mlflow/experiments/search?max_results=5"
            session_cookie = {"Cookie": cookie.split(";", 1)[0]}
            assert http_get(search, headers=session_cookie)[0] == 401  # the session's alone
            status, body = http_get(search, owner_login(state), headers=session_cookie)
            assert status == 200 and "experiments" in json.loads(body)
            with pytest.raises(urllib.error.HTTPError) as anonymous:  # no login, no MLflow
                urllib.request.build_opener(_NoRedirect).open(search, timeout=10)
            assert anonymous.value.code in (302, 403)
        finally:
            stop(ui)
    finally:
        stop(session)
