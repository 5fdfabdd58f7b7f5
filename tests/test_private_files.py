"""What a run writes is its user's alone (issue 47, items 7 and 8), tried by a second Unix user.

A batch file's `mkdir -p runs/<site>-...` made the run directory 0755 before the stage started,
and MLflow made the tracking store (runs/mlflow.db) 0644 and its artifacts (runs/mlartifacts,
logged checkpoints among them) 0755: another user of a shared project folder read them all,
past the MLflow server's password. Here the folder above the runs is open to everyone, as a
project space is; the co-tenant tries to read what one short tracked run wrote. They also left
a file where MLflow takes its lock on a new store, /tmp/db_init_lock-<hash of the store's URI>,
which MLflow opens for writing (item 12): a link there would be followed where the kernel lets
links be followed (fs.protected_symlinks=0)."""
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import run_stage

pytestmark = pytest.mark.stages


@pytest.fixture
def open_project(cotenant):
    """A folder under /tmp that every user may enter and list (mode 0755), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="kit-project-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_a_tracked_run_in_an_open_folder_is_closed_to_other_users(open_project, cotenant,
                                                                   builtin_data):
    run_dir = open_project / "runs" / "site-ddp-1n1g"
    subprocess.run(["mkdir", "-p", str(run_dir)], check=True)  # as batch files did: 0755
    store_url = f"sqlite:///{open_project / 'runs' / 'mlflow.db'}"
    lock = Path("/tmp") / f"db_init_lock-{hashlib.md5(store_url.encode()).hexdigest()}"
    cotenant.run("sh", "-c", f"echo planted > {lock} && chmod 666 {lock}")
    result = run_stage("train_gpt2_std.py", "--preset", "tiny", "--max-steps", "2",
                       "--eval-interval", "2", "--eval-steps", "1", "--ckpt-interval", "2",
                       "--sample-tokens", "0", "--device", "cpu", "--track", "mlflow",
                       "--data", builtin_data, "--out", run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = open_project / "runs"
    written = [run_dir / "config.json", runs / "mlflow.db", runs / "mlartifacts"]
    assert all(path.exists() for path in written)
    assert cotenant.run("ls", str(runs), check=False).returncode == 0  # the folder is open...
    for path in written:  # ...what the run wrote is not
        refused = cotenant.run("cat" if path.is_file() else "ls", str(path), check=False)
        assert refused.returncode != 0 and "Permission denied" in refused.stderr, path
    assert lock.read_text() == "planted\n"  # never opened: the run's temporary files are its own
    lock.unlink()
