"""An MLflow server for its owner alone: the UI and API of a tracking store behind a password.

    python -m coursekit mlflow-server [--store URI] [--artifacts DIR] [--port P] [--state DIR]

A server on 127.0.0.1 is out of the network's reach, but not out of reach of the other users of
the same node: on a shared login or compute node any of them could read, change and delete your
runs, and move a model's `champion` alias. So the kit runs MLflow's basic-auth app. The only
account is yours (your user name); its password is made once, at random, and kept in
STATE/password, which only you can read (STATE is made 0700). Every request without it gets
401. Keep STATE (runs/mlflow-server/ by default) to keep the password across restarts.
"""
import getpass
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from coursekit import KitError, launch, registry, tracking
from coursekit.servers import private_state, secret, serve_until_stopped

DEFAULT_STATE = Path("runs") / "mlflow-server"
AUTH_CONFIG = """[mlflow]
default_permission = NO_PERMISSIONS
database_uri = sqlite:///{database}
admin_username = {user}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
"""


def server_command(store, artifacts, port):
    return [str(Path(sys.executable).parent / "mlflow"), "server", "--app-name", "basic-auth",
            "--host", "127.0.0.1", "--port", str(port), "--backend-store-uri", store,
            "--artifacts-destination", str(artifacts), "--workers", "1"]


def server_environment(state):
    """MLflow's auth settings: the account, its password and the session key, from STATE. And no
    job runner: by default the server also starts Huey consumers that run the jobs its API is
    sent (GenAI evaluations, prompt optimisation), which the course has none of: processes, CPU
    time and code run on request, for nothing."""
    user = getpass.getuser()
    config = state / "basic_auth.ini"
    config.write_text(AUTH_CONFIG.format(database=(state / "users.db").resolve(), user=user))
    return {**os.environ, "TMPDIR": tempfile.gettempdir(),  # tracking.make_store_private's
            "MLFLOW_AUTH_CONFIG_PATH": str(config),
            "MLFLOW_AUTH_ADMIN_PASSWORD": secret(state / "password"),
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secret(state / "session-key"),
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def how_to_reach(store, port, state):
    """What the owner reads in the log: where the server is and how to log in."""
    user, host = getpass.getuser(), socket.gethostname()
    return "\n".join([
        f"MLflow server of {store} on {host}:{port} (127.0.0.1 only), for {user} alone: log in as",
        f"{user} with the password in {state / 'password'} (readable by you alone). From your laptop:",
        f"  {launch.ssh_tunnel(port)}",
        f"then open http://127.0.0.1:{port}. Scripts on this node log to it with",
        f"  MLFLOW_TRACKING_URI=http://127.0.0.1:{port} MLFLOW_TRACKING_USERNAME={user} "
        f"MLFLOW_TRACKING_PASSWORD=$(cat {state / 'password'})"])


def refuse_taken(port):
    """One line, before MLflow starts, if 127.0.0.1:port is taken."""
    error = launch.bind_error(port)
    if error:
        raise KitError(f"--port {port}: 127.0.0.1:{port} cannot be used ({error}): "
                       "choose another, or leave --port out for a free one")


def serve(store=None, artifacts=None, port=None, state=DEFAULT_STATE):
    """Run the server until it is stopped, and print how to reach it once it listens. Without
    ``port`` the kit chooses a free one, and another should someone take it before MLflow binds
    it. Returns MLflow's exit status."""
    store = store or registry.default_store()
    state = private_state(Path(state))
    if port:
        refuse_taken(port)
    artifacts = artifacts or Path("runs") / "mlartifacts"
    tracking.make_store_private(store, Path(artifacts))
    environment = server_environment(state)
    return serve_until_stopped(
        "MLflow", lambda chosen: subprocess.Popen(server_command(store, artifacts, chosen),
                                                  env=environment),
        lambda chosen: how_to_reach(store, chosen, state), port, advice="give one with --port")
