"""JupyterLab in a batch job, reached through an SSH tunnel (batchfiles/<site>/batch-lab.sh), for
centres without a portal:

    python -m coursekit lab --tunnel [--state DIR]

A compute node is shared: every user of it reaches its 127.0.0.1. So the server asks for a token,
made new for each job and kept in STATE/token, which only you can read (STATE is made 0700;
runs/lab/ by default). The job's log, which others may be able to read, holds the port and the
tunnel, never the token: Jupyter prints "?token=..." for a token it was given. As with `make lab`,
kernels talk to the server over Unix sockets in a folder of your own, and no request from another
origin changes anything (launch.lab_command). The job ends JupyterLab at its time limit: Slurm's
SIGTERM reaches the server, which shuts its kernels down and stops.
"""
import getpass
import os
import shutil
import socket
import subprocess
from pathlib import Path

from coursekit import caches, launch
from coursekit.servers import private_state, secret, serve_until_stopped

DEFAULT_STATE = Path("runs") / "lab"


def new_token(state):
    """A token for this server alone: the last job's, which its log's readers may have seen
    next to a port, no longer opens anything."""
    (state / "token").unlink(missing_ok=True)
    return secret(state / "token")


def how_to_reach(port, state):
    """What the owner reads in the job's log: where the server is and how to log in."""
    user, host = getpass.getuser(), socket.gethostname()
    token = (state / "token").resolve()
    job = os.environ.get("SLURM_JOB_ID")
    return "\n".join([
        f"JupyterLab on {host}:{port} (127.0.0.1 only), for {user} alone, until the job ends"
        + (f" (scancel {job} ends it sooner)" if job else "") + ". From your laptop:",
        f"  {launch.ssh_tunnel(port)}",
        f"then open http://127.0.0.1:{port}/lab?token=TOKEN, where TOKEN is what {token} holds",
        "(readable by you alone: `cat` it on a login node)."])


def serve(state=DEFAULT_STATE):
    """Run JupyterLab until it is stopped, and print how to reach it once it listens (see
    servers.serve_until_stopped). Returns JupyterLab's exit status."""
    state = private_state(Path(state))
    caches.use_private_compile_cache()  # for a notebook's own torch.compile
    runtime = launch.lab_runtime_dir()
    environment = {**os.environ, "JUPYTER_TOKEN": new_token(state),
                   "JUPYTER_RUNTIME_DIR": runtime}
    try:
        return serve_until_stopped(
            "JupyterLab", lambda port: subprocess.Popen(
                launch.lab_command(f"--ServerApp.port={port}", "--ServerApp.port_retries=0"),
                env=environment),
            lambda port: how_to_reach(port, state))
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
