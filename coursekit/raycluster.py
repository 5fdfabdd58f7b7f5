"""A Ray cluster inside a Slurm job, that only the job's owner can use (lesson 09's batch files).

Ray runs whatever code a client sends it, and its authentication is off unless RAY_AUTH_MODE=token.
A job's batch file writes a token into a file only its owner can read (RAY_AUTH_TOKEN_PATH) and
exports both variables, so every Ray process of the job, on every node, demands the token, and
then starts one node per allocated host, each a step of the job:

    python -m coursekit ray-node --head --port P      # on the first host
    python -m coursekit ray-node --address HOST:P     # on each of the others
    python -m coursekit ray-nodes --address HOST:P --expect N   # wait for them; a task on each

Each node keeps its sockets, logs and spilled objects in a directory of its own that no other
user can enter (Ray's default, /tmp/ray, is shared by everyone on the host), removed when the node
stops. Ray opens that directory to everyone (0777, for other users' Ray on the same host), so it
lies inside a parent that only its owner can enter; a local Ray's goes when its driver exits.
The dashboard listens on the head's 127.0.0.1 only, behind the same token: reach it through an
SSH tunnel. A local Ray (no job, no RAY_ADDRESS) uses the token Ray keeps in ~/.ray, which the
kit makes its owner's alone first (private_default_token).
"""
import atexit
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from coursekit import KitError, launch


#: On a busy node (a shared login node, a test run's 2 cores) Ray's per-node agents start slowly:
#: give the runtime-env agent 5 minutes to register instead of 30 s.
PATIENT_START = {"RAY_agent_register_timeout_ms": "300000"}
#: How many times a node that fails to start is started again. Ray 2.60's raylet waits a fixed
#: 30 s for its dashboard agent to write its port file, whatever RAY_agent_register_timeout_ms
#: says, and aborts the node's start when it is late ("Timed out waiting for file
#: .../metrics_agent_port"): on a test run's 2 cores, with another Ray cluster starting trials
#: beside it, a worker node failed three starts in a row (ci37). Each try takes about 40 s.
START_ATTEMPTS = 5


def check_token():
    """The job's token settings, or a KitError saying what is missing or unsafe."""
    if os.environ.get("RAY_AUTH_MODE") != "token":
        raise KitError("RAY_AUTH_MODE is not 'token': a Ray cluster without it runs code from "
                       "anyone who reaches its ports; export RAY_AUTH_MODE=token")
    value = os.environ.get("RAY_AUTH_TOKEN_PATH", "")
    path = Path(value)
    if not value or not path.is_file():
        raise KitError(f"RAY_AUTH_TOKEN_PATH {value!r} is not a file: point it at the job's "
                       "token, written with umask 077")
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        raise KitError(f"{path} can be read by others (mode {stat.S_IMODE(path.stat().st_mode):o}):"
                       " chmod 600 it, or write it with umask 077")


def node_address():
    """This host's address as the other hosts reach it: what its name resolves to."""
    return socket.gethostbyname(socket.gethostname())


def start_command(temp_dir, head, port=None, address=None, cpus=None, gpus=None,
                  dashboard_port=None, client_port=None):
    """`ray start` for one node, in the foreground (--block) so that the job step lasts as long as
    the node does. A head's dashboard must start, or the head fails: by default Ray goes on
    without it when its port is taken, and the port the kit announced is then another's."""
    beside_python = Path(sys.executable).with_name("ray")  # the kit's, whether or not on PATH
    ray = str(beside_python) if beside_python.exists() else shutil.which("ray") or "ray"
    command = [ray, "start", "--block", "--temp-dir", str(temp_dir),
               "--node-ip-address", node_address(), "--disable-usage-stats"]
    if head:  # its other listening ports free now too: another user's head may share the host
        command += ["--head", "--port", str(port), "--include-dashboard", "true",
                    "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
                    "--ray-client-server-port", str(client_port)]
    else:
        command += ["--address", address]
    if cpus is not None:
        command += ["--num-cpus", str(cpus)]
    if gpus is not None:
        command += ["--num-gpus", str(gpus)]
    return command


def run_node(head, port=None, address=None, cpus=None, gpus=None):
    """Run one Ray node until it is told to stop (SIGTERM, as `scancel --signal=TERM` sends the
    job's steps); its private directory goes with it. Returns 0 once stopped, else ray start's
    exit status. A node that fails to start starts again, up to START_ATTEMPTS times in all: a
    head's dashboard and client ports are the kit's choice, and another user of the node may bind
    one of them first (the head then starts again on others); and on a busy node a raylet can
    take longer than the 30 s Ray gives it to register ("The current node timed out during
    startup")."""
    check_token()
    for attempt in range(1, START_ATTEMPTS + 1):
        chosen = [launch.free_port(), launch.free_port()] if head else []
        status, stopped = run_ray_start(head, port, address, cpus, gpus, *chosen)
        if stopped or status == 0 or attempt == START_ATTEMPTS:
            break
        taken = [chosen_port for chosen_port in chosen if launch.bind_error(chosen_port)]
        reason = (f"port {taken[0]} was taken before the head could bind it" if taken
                  else f"ray start failed (exit status {status})")
        print(f"{reason}: starting the node again", file=sys.stderr, flush=True)
    return 0 if stopped else status  # ray start exits 1 when it is stopped, as asked


def run_ray_start(head, port, address, cpus, gpus, dashboard_port=None, client_port=None):
    """`ray start` in a directory of this user's alone, until it ends: (its exit status, whether
    a stop signal ended it). A head's dashboard is announced once it listens."""
    with tempfile.TemporaryDirectory(prefix="kit-ray-") as parent:  # mode 0700
        # no draining on SIGTERM: it readies Ray Serve's replicas to move, and waits for the head,
        # which is stopping too
        node = subprocess.Popen(start_command(ray_folder(parent), head, port, address, cpus, gpus,
                                              dashboard_port, client_port),
                                env={**os.environ, **PATIENT_START,
                                     "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})
        stopped = []

        def stop(signum, frame):  # the whole step gets it, as a rule: make sure ray start does
            stopped.append(signum)
            node.send_signal(signal.SIGTERM)

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, stop)
        if head and launch.listens(node, dashboard_port):
            print(f"dashboard: 127.0.0.1:{dashboard_port} on {socket.gethostname()}, behind the "
                  f"job's token (in $RAY_AUTH_TOKEN_PATH). From your laptop: "
                  f"{launch.ssh_tunnel(dashboard_port)}, then open "
                  f"http://127.0.0.1:{dashboard_port}", flush=True)
        return node.wait(), bool(stopped)


def ray_folder(parent):
    """Ray's temp folder inside ``parent``, a folder of this user's alone: Ray makes its own 0777,
    and a co-tenant who could enter it could rename the raylet's socket or read the logs."""
    return Path(parent) / "ray"


def private_default_token():
    """Ray 2.60 turns tokens on for a local Ray by itself, and keeps the token in
    ~/.ray/auth_token, written with the umask's mode: most often 0644 in a folder of mode 0755,
    which anyone who can enter the home folder reads, and then runs code in the trainee's Ray. So
    the folder and the file are made (or closed) their owner's alone before Ray looks."""
    folder = Path.home() / ".ray"
    folder.mkdir(mode=0o700, exist_ok=True)
    folder.chmod(0o700)
    token = folder / "auth_token"
    if not token.exists():  # a token as Ray makes one: 256 random bits, in hex
        with os.fdopen(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            out.write(secrets.token_hex(32))
    token.chmod(0o600)


def stop_local_ray(parent):
    """At the driver's exit: Ray's processes, then their folder (Ray leaves it behind)."""
    import ray
    ray.shutdown()
    shutil.rmtree(parent, ignore_errors=True)


def connect(address=None):
    """ray.init() for a driver: the job's cluster (RAY_ADDRESS, or ``address``), reached from this
    host's address (the one the head node was started with), or a local Ray where there is none."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if address is None:  # its sockets and logs in a folder of this user's own, not /tmp/ray,
        # which the first user of a shared node to start Ray owns
        parent = tempfile.mkdtemp(prefix="kit-ray-")  # mode 0700
        atexit.register(stop_local_ray, parent)
        for name, value in PATIENT_START.items():  # for the processes ray.init starts
            os.environ.setdefault(name, value)
        private_default_token()
        return ray.init(logging_level="warning", _temp_dir=str(ray_folder(parent)))
    check_token()
    return ray.init(address=address, _node_ip_address=node_address(), logging_level="warning")


#: One try of wait_for_nodes, in a process of its own: its last line of output is JSON, the hosts
#: of the cluster's nodes ({"hosts": ...}) or why not ({"error": ...})
ONE_TRY = """
import json, sys
from coursekit import KitError, raycluster
try:
    answer = {"hosts": raycluster.nodes_with_a_task_each(sys.argv[1], int(sys.argv[2]),
                                                         float(sys.argv[3]))}
except KitError as err:
    answer = {"error": str(err)}
print(json.dumps(answer), flush=True)
"""


def wait_for_nodes(address, expected, timeout=300):
    """Wait until ``expected`` nodes of the cluster at ``address`` are alive, then run one task on
    each: {node id: the host name its task reported}. Ray aborts a driver whose head started
    again (WrongClusterID), as the kit's head does when another process took one of its ports
    first, and a driver can start before the head has: so each try runs in a process of its own,
    and one that ends without an answer is made again until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        one_try = subprocess.run([sys.executable, "-c", ONE_TRY, address, str(expected),
                                  str(max(deadline - time.monotonic(), 1))],
                                 stdout=subprocess.PIPE, text=True)
        answer = last_json_line(one_try.stdout)
        if "error" in answer:
            raise KitError(answer["error"])
        if "hosts" in answer:
            return answer["hosts"]
        if time.monotonic() >= deadline:
            raise KitError(f"no Ray cluster answered at {address} within {timeout} s: see the "
                           "job's log for the head's errors")
        print(f"the Ray cluster at {address} did not answer, or its head started again "
              f"(exit status {one_try.returncode}): connecting again", file=sys.stderr, flush=True)
        time.sleep(1)


def last_json_line(output):
    """The JSON object on the last line of ``output``, or {} where there is none."""
    try:
        return json.loads(output.splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {}


def nodes_with_a_task_each(address, expected, timeout):
    """wait_for_nodes in this process: connect, wait for the nodes, run one task on each."""
    import ray

    connect(address)
    deadline = time.monotonic() + timeout
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) < expected:
        print(f"ray cluster at {address}: {len(alive)} of {expected} nodes up, waiting for the "
              "others", file=sys.stderr, flush=True)
    while len(alive) < expected:
        if time.monotonic() > deadline:
            raise KitError(f"only {len(alive)} of {expected} Ray nodes joined within {timeout:.0f}"
                           " s: see the job's log for the others' errors")
        time.sleep(1)
        alive = [n for n in ray.nodes() if n["Alive"]]
    on_node = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def host():
        return socket.gethostname()

    tasks = {n["NodeID"]:  # not its address: two nodes may share a host
             host.options(scheduling_strategy=on_node(n["NodeID"], soft=False)).remote()
             for n in alive}
    hosts = dict(zip(tasks, ray.get(list(tasks.values()))))
    ray.shutdown()
    return hosts
