"""A job's Ray node refuses to start without the job's private token, and starts with its
dashboard on 127.0.0.1 and its files in a directory of its own (the cluster itself, on the Slurm
test cluster: tests/test_slurm.py)."""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import one_ray_at_a_time
from coursekit import KIT_ROOT, raycluster

pytestmark = pytest.mark.unit


@pytest.fixture
def token(tmp_path, monkeypatch):
    path = tmp_path / "ray-token"
    path.write_text("0123abcd\n")
    path.chmod(0o600)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    return path


def test_a_private_token_file_is_accepted(token):
    raycluster.check_token()


@pytest.mark.parametrize("change, message", [
    (lambda token, env: env.delenv("RAY_AUTH_MODE"), "RAY_AUTH_MODE is not 'token'"),
    (lambda token, env: env.setenv("RAY_AUTH_MODE", "disabled"), "RAY_AUTH_MODE is not 'token'"),
    (lambda token, env: env.delenv("RAY_AUTH_TOKEN_PATH"), "RAY_AUTH_TOKEN_PATH '' is not a file"),
    (lambda token, env: token.unlink(), "is not a file"),
    (lambda token, env: token.chmod(0o644), "can be read by others (mode 644)"),
])
def test_a_node_without_a_private_token_is_refused_in_one_line(token, monkeypatch, change, message):
    change(token, monkeypatch)
    result = subprocess.run([sys.executable, "-m", "coursekit", "ray-node", "--head", "--port",
                             "6379"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_head_asks_for_its_dashboard_on_loopback_and_keeps_its_files_apart(tmp_path):
    """The command line; the socket a real head binds is checked in test_slurm.py
    (test_a_ray_cluster_spans_both_nodes_for_its_owner_alone_and_stops_on_sigusr1)."""
    command = raycluster.start_command(tmp_path / "own", head=True, port=6379, cpus=2,
                                       dashboard_port=8765, client_port=8766)
    options = dict(zip(command, command[1:]))
    assert options["--dashboard-host"] == "127.0.0.1" and options["--dashboard-port"] == "8765"
    assert options["--include-dashboard"] == "true"  # else a taken port leaves the head without
    assert options["--ray-client-server-port"] == "8766"
    assert options["--temp-dir"] == str(tmp_path / "own") and "--block" in command
    assert options["--node-ip-address"] == raycluster.node_address()
    worker = raycluster.start_command(tmp_path / "w", head=False, address="node1:6379", gpus=4)
    assert dict(zip(worker, worker[1:]))["--address"] == "node1:6379" and "--head" not in worker


#: A driver with a local Ray, as lesson 09's kernel starts one: it says where Ray keeps its
#: sockets, then holds Ray until its input closes.
LOCAL_RAY_DRIVER = """
import sys
from coursekit import raycluster
raycluster.connect()
import ray
print(ray._private.worker._global_node.get_session_dir_path(), flush=True)
sys.stdin.read()
"""


@pytest.mark.stages
@pytest.mark.slow  # starts Ray: not for make test-fast, whose selection takes the module's unit
def test_a_co_tenant_can_enter_no_folder_of_a_local_ray_which_goes_when_it_stops(
        cotenant, tmp_path_factory):
    """Issue 47, item 6: Ray makes its temp folder 0777; the co-tenant renamed the raylet's socket
    in it, and the driver died. Here they try to list it and to move the socket away. And to read
    the token of that Ray (on by default for a local Ray), in ~/.ray of a home folder that they
    can enter: Ray would leave it readable to all."""
    home = Path(tempfile.mkdtemp(prefix="kit-home-", dir="/tmp"))  # where they can enter
    home.chmod(0o755)
    with one_ray_at_a_time(tmp_path_factory):
        private = refused_a_co_tenant(cotenant, home)
    assert not private.exists()


def refused_a_co_tenant(cotenant, home):
    """The co-tenant's attempts on a local Ray's driver started with ``home``; the kit's private
    folder above Ray's own, once the driver has ended well."""
    driver = subprocess.Popen([sys.executable, "-c", LOCAL_RAY_DRIVER], cwd=KIT_ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "HOME": str(home)})
    try:
        session = Path(driver.stdout.readline().strip())
        assert session.is_dir(), "the driver's Ray did not start"
        private = session.parents[1]  # above Ray's own folder (0777): the kit's parent
        assert private.name.startswith("kit-ray-") and private.stat().st_mode & 0o777 == 0o700
        for attempt in (["ls", str(session.parent)],
                        ["mv", str(session / "sockets" / "raylet"), "/tmp/stolen-raylet"],
                        ["cat", str(home / ".ray" / "auth_token")]):
            refused = cotenant.run(*attempt, check=False)
            assert refused.returncode != 0 and "Permission denied" in refused.stderr, attempt
    finally:
        driver.communicate("", timeout=120)
        shutil.rmtree(home)
    assert driver.returncode == 0
    return private
