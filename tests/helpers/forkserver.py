"""A fork server for the tests' single-node runs of the stage scripts (issue 50).

Every stage run used to be a new Python process: about 3 CPU-seconds to import torch and
torch._dynamo before its first step, 7 more for Lightning, and torchrun's own process on top, for
runs that train a few steps in a few seconds. This server imports all that once, then forks one
child per run, which becomes the process the run would have been: the run's argv, environment,
working folder, thread count, stdin, stdout and stderr, its own process group, its exit status
(a signal as -N, as subprocess reports it). The Slurm tests, the lessons and the tests of the
launch itself (restarts, forwarded signals, a failed rank) keep torchrun and srun, so the real
launch stays tested.

A run whose environment differs from the server's in a variable that a library may read when it
is imported (anything outside RUN_TIME_VARIABLES) is refused; the client then starts a process
of its own, as before. (Where the run's value is one the server's own imports exported, such as
the kit's MLflow defaults, a fresh process's imports would have kept it: that is no difference.)
A PYTHONPATH of the run's own is applied to the child's sys.path, as the interpreter would, unless
a folder on it holds another copy of a module the server imported: then the run is refused.
The server is reachable by its owner only: a Unix socket in a 0700 folder, each peer's user
checked (SO_PEERCRED), since whoever reaches it runs code as its owner.

    python forkserver.py SOCKET   # prints "ready" once it listens
"""
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

#: Variables that the stage scripts and the libraries under them read when a run starts or while
#: it runs, never at import: a run may set them differently from the server's environment.
RUN_TIME_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                      "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                      "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                      "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                      "PYTEST_CURRENT_TEST", "PYTHONUNBUFFERED", "MLFLOW_TRACKING_URI",
                      "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
#: Slurm's; and what `accelerate launch` tells its processes (ACCELERATE_*, FSDP_*), which
#: Accelerate reads when the script builds its Accelerator, never at import (accelerate 1.15:
#: utils/dataclasses.py, state.py; no module-level read of either).
RUN_TIME_PREFIXES = ("SLURM_", "ACCELERATE_", "FSDP_")

#: What every stage imports before its first step: imported here once, shared by every child.
PRELOADED = ("numpy", "torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp",
             "torch.distributed.tensor", "torch.distributed.pipelining", "lightning", "mlflow",
             "coursekit.distributed", "coursekit.faults", "coursekit.memory", "coursekit.perf",
             "coursekit.presets", "coursekit.runs", "coursekit.tracking", "coursekit.training",
             "coursekit.watchdog", "solutions.gpt", "solutions.train_gpt2_ddp")


def run_time_only(variable):
    return variable in RUN_TIME_VARIABLES or variable.startswith(RUN_TIME_PREFIXES)


def python_path(env):
    """The folders of an environment's PYTHONPATH, in order."""
    return [folder for folder in env.get("PYTHONPATH", "").split(os.pathsep) if folder]


def imported_under(env):
    """The part of an environment that imports may have read."""
    return {name: value for name, value in env.items() if not run_time_only(name)}


# --- the client's side --------------------------------------------------------------------------

class Server:
    """The fork server, started on first use in the environment ``environment()`` returns (the
    tests' kit_env) and stopped with stop(). It counts the runs it served and those it refused,
    with the reason."""

    def __init__(self, environment, preloaded=PRELOADED):
        self.environment, self.preloaded = environment, preloaded
        self.process, self.served, self.refused = None, 0, {}

    def start(self):
        self.env = self.environment()
        # 0700: its owner's alone. In /tmp whatever TMPDIR says: a socket's path may not exceed
        # 107 bytes, which one in the kit's private temporary folder does.
        folder = tempfile.mkdtemp(prefix="kit-forkserver-", dir="/tmp")
        self.socket_path = os.path.join(folder, "socket")
        env = {name: value for name, value in self.env.items()
               if name not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        self.process = subprocess.Popen([sys.executable, __file__, self.socket_path,
                                         *self.preloaded], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.process.stdout.readline()
        assert ready == "ready\n", f"the fork server did not start: {ready!r}"

    def stop(self):
        if self.process is not None:
            self.process.stdin.close()  # the server waits for its runs, then exits
            self.process.wait()
            shutil.rmtree(os.path.dirname(self.socket_path), ignore_errors=True)
            self.process = None

    def drifted(self, env):
        """Whether ``env`` is the tests' own environment, but that has changed since the server
        started: an import in the tests' process (Ray's, say) set variables there. A server
        started anew has them too; a run in any other environment is the server's to refuse."""
        return (imported_under(env) == imported_under(self.environment()) !=
                imported_under(self.env))

    def counts(self):
        return {"forked": self.served, "refused": self.refused}

    def fork(self, command, env, cwd, stdout, stderr):
        """A forked run of ``command`` (a Run), or None if refused: then the caller starts a
        process of its own. stdout and stderr are file descriptors to write to."""
        if self.process is not None and self.drifted(env):
            self.stop()
        if self.process is None:
            self.start()
        with open(os.devnull) as stdin:
            connection, answer = request(self.socket_path, command, env, cwd,
                                         [stdin.fileno(), stdout, stderr])
        if connection is None:
            self.refused[answer] = self.refused.get(answer, 0) + 1
            return None
        self.served += 1
        return Run(command, connection, answer)

    def run(self, command, env, cwd, timeout):
        """subprocess.run(command, capture_output=True, text=True, ...) through the server;
        None if refused."""
        return self.group([command], [env], cwd, timeout)

    def group(self, commands, envs, cwd, timeout):
        """Several runs at once that share one stdout and one stderr, as torchrun's workers share
        its own; when one fails, the others are killed, as torchrun does. A CompletedProcess of
        the first command (return code 1 if any failed, as torchrun's), or None if refused."""
        (out_read, out_write), (err_read, err_write) = os.pipe(), os.pipe()
        started = []
        try:
            for command, env in zip(commands, envs):
                run = self.fork(command, env, cwd, out_write, err_write)
                if run is None:
                    return None
                started.append(run)
        finally:
            os.close(out_write)
            os.close(err_write)
            if len(started) < len(commands):
                kill_all(started)
                os.close(out_read)
                os.close(err_read)
        stdout, stderr = read_both(out_read, err_read, started, timeout)
        codes = [run.returncode for run in started]
        code = codes[0] if len(codes) == 1 else int(any(codes))
        return subprocess.CompletedProcess(commands[0], code, stdout, stderr)


def read_both(out_read, err_read, runs, timeout):
    """Everything the runs write to the two pipes, as text, read until every run has exited;
    a run that fails gets the others killed; past ``timeout`` seconds all are killed and
    subprocess.TimeoutExpired raised, with a note of what they wrote and where each was stuck.
    Closes both pipes."""
    chunks = {out_read: [], err_read: []}
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)
        for run in runs:
            selector.register(run.connection, selectors.EVENT_READ, run)
        try:
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    stacks = [stack_of(run) for run in runs if run.returncode is None]
                    kill_all(runs)
                    expired = subprocess.TimeoutExpired(runs[0].args, timeout)
                    written = [b"".join(chunks[fd]).decode(errors="replace")[-3000:]
                               for fd in (out_read, err_read)]
                    expired.add_note("\n".join(["--- stdout:", written[0], "--- stderr:",
                                                 written[1], *stacks]))
                    raise expired
                for key, _ in selector.select(left):
                    if key.data is None:
                        read_into(chunks[key.fd], key.fd, selector)
                        continue
                    key.data.read_status()  # a run's exit status
                    selector.unregister(key.fileobj)
                    if key.data.returncode != 0:
                        kill_all(runs)
        finally:
            os.close(out_read)
            os.close(err_read)
    return tuple(b"".join(chunks[fd]).decode(errors="replace") for fd in (out_read, err_read))


def stack_of(run):
    """Where a run that is still running is: the Python stack of each of its threads, as py-spy
    dumps it from outside."""
    py_spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    dump = subprocess.run([py_spy, "dump", "--pid", str(run.pid)], capture_output=True,
                          text=True, timeout=60)
    return f"--- the stacks of run {run.pid}:\n{dump.stdout or dump.stderr}"


def read_into(chunks, fd, selector):
    """What the pipe ``fd`` has, or, at its end, no more reading from it."""
    data = os.read(fd, 1 << 16)
    if data:
        chunks.append(data)
    else:
        selector.unregister(fd)


def kill_all(runs):
    for run in runs:
        if run.returncode is None:
            run.kill()


class Run:
    """A run the server forked: its pid, and its return code once its status has arrived on the
    connection."""

    def __init__(self, command, connection, pid):
        self.args, self.connection, self.pid, self.returncode = command, connection, pid, None

    def read_status(self):
        self.returncode = receive(self.connection)["returncode"]
        self.connection.close()

    def kill(self):
        """The run and whatever it started (its process group), at once."""
        if self.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def request(socket_path, command, env, cwd, stdio):
    """Ask the server at ``socket_path`` to run ``command`` (python, a script, its arguments)
    with ``stdio``'s three file descriptors. Returns the connection, on which the run's exit
    status arrives when it ends, and the run's pid; or None and why it was refused."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(socket_path)
    message = json.dumps({"argv": list(map(str, command[1:])), "env": env, "cwd": str(cwd)})
    socket.send_fds(connection, [message.encode()], stdio)
    connection.shutdown(socket.SHUT_WR)
    reply = receive(connection)
    if "pid" not in reply:
        connection.close()
        return None, reply["refused"]
    return connection, reply["pid"]


def receive(connection):
    """One JSON line from ``connection``."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(4096)
        if not chunk:
            raise ConnectionError(f"the fork server closed the connection after {data!r}")
        data += chunk
    return json.loads(data)


# --- the server's side --------------------------------------------------------------------------

def serve(socket_path, preloaded):
    started_under = dict(os.environ)
    for module in preloaded:
        __import__(module)
    import torch

    # What the imports exported (the kit's defaults for MLflow, torch's Inductor cache folder):
    # a fresh process's imports would export them too, unless its environment has them already.
    exported = {name: value for name, value in os.environ.items()
                if started_under.get(name) != value}

    # A child can use CUDA only if this process never did; and the thread count a fresh process
    # would have is the one this process has (it was started without OMP_NUM_THREADS).
    assert not torch.cuda.is_initialized()
    default_threads = torch.get_num_threads()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    server_env = imported_under(started_under)
    print("ready", flush=True)
    # Until the client closes this server's stdin (or dies): then wait for the runs under way,
    # so that their CPU time reaches the client's (`time make test` counts it).
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(sys.stdin, selectors.EVENT_READ)
        while not any(key.fileobj is sys.stdin for key, _ in selector.select()):
            connection, _ = listener.accept()
            if os.fork() == 0:
                selector.close()
                listener.close()
                os._exit(handle(connection, server_env, exported, default_threads))
            connection.close()
            reap(os.WNOHANG)
    reap(0)


def reap(options):
    """Collect the handlers that have exited (options=os.WNOHANG) or, with 0, all of them."""
    try:
        while os.waitpid(-1, options)[0]:
            pass
    except ChildProcessError:
        pass


def peer_uid(connection):
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
    return struct.unpack("3i", credentials)[1]


def handle(connection, server_env, exported, default_threads):
    """One run: refuse it, or fork its process, report its pid, wait, and report its status."""
    if peer_uid(connection) != os.getuid():
        return 1
    message, stdio, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    while chunk := connection.recv(1 << 20):  # the client shut its side after the message
        message += chunk
    run = json.loads(message)
    differing = sorted(name for name in set(imported_under(run["env"])) | set(server_env)
                       if run["env"].get(name) != server_env.get(name) and name != "PYTHONPATH"
                       and not (name in exported and run["env"].get(name) == exported[name]))
    refusal = (f"imports may read {', '.join(differing)}" if differing
               else pythonpath_refusal(run["env"], run["cwd"], server_env))
    if refusal:
        send(connection, {"refused": refusal})
        return 0
    run["env"] = {**exported, **run["env"]}
    server_folders = [os.path.abspath(folder) for folder in python_path(server_env)]
    pid = os.fork()
    if pid == 0:
        connection.close()
        become_the_run(run, stdio, default_threads, server_folders)
    for fd in stdio:
        os.close(fd)
    send(connection, {"pid": pid})
    _, status = os.waitpid(pid, 0)
    send(connection, {"returncode": os.waitstatus_to_exitcode(status)})
    return 0


def pythonpath_refusal(run_env, cwd, server_env):
    """Why the run's PYTHONPATH would have a fresh process import other files than this server
    did, or None: it leaves out a folder of the server's own, or a folder it adds holds another
    copy of a module the server imported (a package or module of that name, which a fresh
    process would find first)."""
    run_path, server_path = python_path(run_env), python_path(server_env)
    if not set(server_path) <= set(run_path):
        return "its PYTHONPATH leaves out the server's"
    added = [os.path.join(cwd, folder) for folder in run_path if folder not in server_path]
    copies = sorted({name for folder in added for name, module in list(sys.modules.items())
                     if "." not in name and another_copy(folder, name, module)})
    return f"its PYTHONPATH holds other copies of {', '.join(copies)}" if copies else None


def another_copy(folder, name, module):
    """Whether ``folder`` holds a module ``name`` other than the imported ``module``."""
    origin = getattr(module, "__file__", None)
    candidates = [os.path.join(folder, name, "__init__.py"), os.path.join(folder, f"{name}.py")]
    return any(os.path.exists(candidate) and not (origin and os.path.samefile(candidate, origin))
               for candidate in candidates)


def send(connection, reply):
    connection.sendall(json.dumps(reply).encode() + b"\n")


def become_the_run(run, stdio, default_threads, server_folders):
    """In the forked child: take the run's process group, files, folder, environment, threads and
    argv, run its script as __main__, and exit as its interpreter would. Never returns."""
    import atexit
    import runpy
    import threading
    import traceback

    import torch

    os.setpgid(0, 0)
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(run["cwd"])
    os.environ.clear()
    os.environ.update(run["env"])
    torch.set_num_threads(int(run["env"].get("OMP_NUM_THREADS", default_threads)))
    if run["env"].get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    sys.argv = run["argv"]
    # as `python script` has it: the script's folder, then PYTHONPATH's, then the rest
    sys.path[:] = [os.path.dirname(os.path.abspath(sys.argv[0])),
                   *map(os.path.abspath, python_path(run["env"])),
                   *(folder for folder in sys.path[1:] if folder not in server_folders)]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit_code(exit.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    # what the interpreter does on its way out: wait for threads, then the atexit functions
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_code(code):
    """sys.exit's argument as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
