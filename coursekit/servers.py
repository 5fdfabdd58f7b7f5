"""What the kit's servers share (MLflow's, coursekit/mlflow_server.py; JupyterLab's in a batch
job, coursekit/lab_job.py): a state folder and secrets of their owner's alone, and the signals
that stop a job or a terminal session passed on to the server they started."""
import os
import secrets
import signal
import stat
import sys

from coursekit import KitError, launch, runs


def private_state(state):
    """STATE, made 0700 if new; refused in one line if it is someone else's or open to others:
    checked before make_run_dir, which would close an open one, as others may have read the
    secrets in it already."""
    if state.exists():
        info = state.stat()
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise KitError(f"{state} must be yours and closed to others (mode "
                           f"{stat.S_IMODE(info.st_mode):o}, owner id {info.st_uid}): "
                           f"`chmod 700 {state}`, or pass another --state")
    return runs.make_run_dir(state)


def secret(path):
    """The random secret kept in ``path``, made the first time (readable by its owner alone)."""
    if not path.exists():
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            out.write(secrets.token_urlsafe(24))
    return path.read_text().strip()


def serve_until_stopped(name, start, how_to_reach, port=None, advice="try again"):
    """Start server ``name`` with ``start(port)`` (a Popen) on ``port`` or, without one, on a port
    free when chosen, and on another should someone take it before the server binds it; print
    ``how_to_reach(port)`` once it listens. Returns the server's exit status, once it has
    stopped; ``advice`` ends the one line that says no port could be had."""
    for _ in range(1 if port else launch.PORT_ATTEMPTS):
        chosen = port or launch.free_port()
        server = start(chosen)
        forward_stop_signals(server)
        if launch.listens(server, chosen):
            print(how_to_reach(chosen), flush=True)
            return exit_status(server.wait())
        if port or not launch.bind_error(chosen):  # it failed for its own reason, as it said
            return exit_status(server.returncode)
        print(f"port {chosen} was taken before {name} could bind it", file=sys.stderr,
              flush=True)
    raise KitError(f"{launch.PORT_ATTEMPTS} free ports in a row were taken before {name} could "
                   f"bind them: {advice}")


def forward_stop_signals(server):
    """The signals that stop a job (its time limit, scancel) or a terminal session go on to
    ``server``, as if it had been started without the kit."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda received, frame: server.send_signal(received))


def exit_status(returncode):
    """A server's exit status as a shell reports it: 128 + N where signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode
