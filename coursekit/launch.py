"""How the kit starts processes that work together: torchrun with its static rendezvous.

torchrun's c10d rendezvous (and its standalone mode, which is the same with a random id) keeps
its state in a TCP store that listens on every interface without a password, and unpickles that
state at every sync for the whole job: anyone who can reach the port and knows the rendezvous id
(batch files commonly use the job id, which every user sees; the store lists its keys, random
ids included, to anyone) can write a crafted pickle there and run code in the launcher, as the
job's owner. The static rendezvous keeps only plain bytes and JSON in the same store. It needs each node's rank (under Slurm, $SLURM_NODEID) and a port on the first node,
chosen free when the job starts rather than derived from something another user can predict.
"""
import getpass
import os
import shlex
import socket
import sys
import tempfile
import time
from pathlib import Path

import psutil

#: The signals torchrun passes on to its workers: Slurm's SIGUSR1 before the time limit among
#: them, so that the training processes checkpoint and exit.
FORWARDED_SIGNALS = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"

#: Put before a torchrun command that srun starts once per node: each node's own shell gives
#: torchrun that node's rank (torchrun reads --node-rank from PET_NODE_RANK).
PER_NODE = ["bash", "-c", 'PET_NODE_RANK="$SLURM_NODEID" exec "$@"', "per-node"]
PER_NODE_SHELL = shlex.join(PER_NODE)


def free_port():
    """A TCP port free on this host now, chosen by the operating system."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def ssh_tunnel(port):
    """The command, run on a trainee's laptop, that brings port ``port`` of this node's loopback
    (where the kit's servers listen, and nowhere else) to the same port there, through the login
    node."""
    user, host = getpass.getuser(), socket.gethostname()
    return f"ssh -N -J {user}@<login node> -L {port}:127.0.0.1:{port} {user}@{host}"


#: Ports of its own choosing a server the kit starts is given in turn: each was free when chosen,
#: but another user of the node may bind it before the server does (a race, not a mistake)
PORT_ATTEMPTS = 3


def bind_error(port, host="127.0.0.1"):
    """Why host:port cannot be bound now (another user's process has it, perhaps), or None."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do
        try:
            probe.bind((host, port))
        except OSError as err:
            return err.strerror
    return None


def listens(server, port):
    """Wait until ``server`` (a process, or one it started) listens on ``port``: True; or until
    it exits: False. The socket is looked for among its own processes, since another process may
    have taken the port."""
    while server.poll() is None:
        try:
            family = psutil.Process(server.pid)
            for process in [family, *family.children(recursive=True)]:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                       for c in process.net_connections(kind="tcp")):
                    return True
        except psutil.NoSuchProcess:  # a process that ended as we looked: look again
            pass
        time.sleep(0.2)
    return False


#: How often a batch job's torchrun starts its group again after a process crashed (a segfault,
#: the out-of-memory killer): the new processes resume from the last checkpoint (every stage is
#: started with --resume), in the same job, on the same nodes. A crash beyond that fails the job;
#: its checkpoint stays for the next submission.
BATCH_RESTARTS = 2


def torchrun_options(processes, nodes, master_addr, master_port, restarts=0):
    """torchrun's options for `processes` workers on each of `nodes` nodes, the static
    rendezvous at master_addr:master_port (values, or shell variables in a batch file), the group
    started again up to `restarts` times when a process fails."""
    return [f"--nnodes={nodes}", f"--nproc-per-node={processes}", f"--master-addr={master_addr}",
            f"--master-port={master_port}", f"--max-restarts={restarts}", FORWARDED_SIGNALS]


def torchrun(processes, nodes=1, master_addr="127.0.0.1", master_port=None, restarts=0):
    """torchrun starting `processes` workers (default: one node, this host, a free port). With
    several nodes, srun starts it once per node after PER_NODE."""
    return [sys.executable, "-m", "torch.distributed.run",
            *torchrun_options(processes, nodes, master_addr, master_port or free_port(), restarts)]


def lab_command(*options):
    """JupyterLab as `make lab` starts it, with ``options`` added: on 127.0.0.1, and its kernels
    over IPC, Unix sockets in the user's private runtime folder (lab_runtime_dir), not TCP ports
    on which any user of the node could send code to the kernel or read everything it prints;
    no request from another origin changes anything (jupyter_guard)."""
    as_root = ["--allow-root"] if os.geteuid() == 0 else []
    return [str(Path(sys.executable).parent / "jupyter"), "lab", "--no-browser",
            "--ip", "127.0.0.1", "--KernelManager.transport=ipc",
            "--ServerApp.jpserver_extensions", "coursekit.jupyter_guard=True", *as_root, *options]


def lab_runtime_dir():
    """A new folder of this user's own (0700) for JupyterLab's runtime files: its kernels'
    connection files and their Unix sockets. Under /tmp, not ~/.local/share/jupyter/runtime: a
    socket's path may not exceed 107 bytes, which a kernel's beside a deep home folder does.
    (The OnDemand session's script.sh makes the same folder with mktemp.)"""
    return tempfile.mkdtemp(prefix="kit-jupyter-", dir="/tmp")


def numbers_of_every_rank(numbers, device):
    """Each rank's list of integers, in rank order, gathered as one tensor per rank. Not
    all_gather_object: an object collective unpickles whatever the other end sent."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(numbers, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [rank_numbers.tolist() for rank_numbers in gathered]
