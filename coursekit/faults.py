"""What the kit does so that a fault ends a run cleanly, and what its scripts say then: one
line that names the cause and what to do next, never a traceback, for what a user or a cluster
can cause.

    if __name__ == "__main__":
        sys.exit(faults.run(main))

- a KitError (a bad value, a broken run directory): its message;
- a collective that failed because another process hung or died: which collective, where in the
  script, and the timeout it waited. gloo says only "Timed out waiting 600000ms for recv" or
  "Connection closed by peer", which names neither; NCCL's watchdog names the collective itself
  and ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING), so on GPUs its own line says it;
- a full disk or quota: the path that could not be written;
- memory that ran out (a GPU's, or a CPU process's limit): how much was asked for, where, and the
  fixes that keep the training the same.
Anything else is a bug, and keeps its traceback. Under torchrun --max-restarts, only a killed
process or a lost peer is started again: a failure that would only repeat stops the launch.

The stages start their process group with coursekit.distributed.setup: collectives that time
out (KIT_DIST_TIMEOUT seconds) rather than wait for ever.
"""
import errno
import os
import re
import sys
import traceback
from pathlib import Path

from coursekit import KitError

#: What a write that found no room fails with: a full disk, a full quota (what clusters' home and
#: project directories have), a file over the size limit (ulimit -f)
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
RESUME = "the last checkpoint is intact: run the same command again with --resume"
TIMEOUT_VARIABLE = "KIT_DIST_TIMEOUT"  # coursekit.distributed reads it


def run(main):
    """main()'s exit status, or the one line (an exit status of 1 for sys.exit) that says why
    it could not finish; see the module's docstring. A failure that a restart cannot mend is
    not tried again (see "restarts" below)."""
    earlier = failure_of_the_first_attempt()
    if earlier:
        return f"error: not restarted, as a restart cannot mend it: {earlier}"
    try:
        return main()
    except SystemExit as exit_:  # argparse's refusal of a bad argument (exit 2)
        if exit_.code not in (0, None):
            remember_failure(f"exit {exit_.code}: the command line was refused (its error above)")
        raise
    except Exception as err:
        line = one_line(err)
        if not is_collective_failure(err):  # a lost peer is what a restart is for
            remember_failure(line or f"{type(err).__name__}: {err}")
        if line is None:  # a bug: its traceback says where
            raise
        return f"error: {line}"


def one_line(err):
    """The line that says why ``err`` ended the run, for what a user or a cluster can cause;
    None for anything else (a bug)."""
    if isinstance(err, KitError):  # problems the user can fix, found after start-up
        return str(err)
    if isinstance(err, OSError) and err.errno in NO_ROOM:
        return f"{no_room(err)}; {RESUME}"
    if isinstance(err, RuntimeError) and OUT_OF_MEMORY.search(str(err)):
        return out_of_memory(err)
    if isinstance(err, RuntimeError) and is_collective_failure(err):
        return f"{collective_failure(err)}; {RESUME}"
    return None


# --- restarts -------------------------------------------------------------------------------
# torchrun --max-restarts starts a failed group again, whatever failed. That mends a process
# that was killed (the node's out-of-memory killer, a lost node) or a peer that went with it,
# but a bad value, an out-of-memory error or a bug fails again, each time after a new start,
# compile and first steps. So a process that fails in such a way notes it where the restarted
# processes of the same launch look first: the folder torchrun keeps for this launch's attempts
# (its error files' TORCHELASTIC_ERROR_FILE=<launch>/attempt_N/<rank>/error.json), private to
# the user and gone with the launch. They stop at once with the same line; the job fails in
# seconds, where it took three full attempts.
FAILED_FIRST = "failed.txt"


def launch_folder():
    """torchrun's folder for this launch's attempts, or None outside torchrun or without
    restarts to save."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) == 0:
        return None
    return Path(error_file).parents[2]


def remember_failure(line):
    folder = launch_folder()
    if folder is not None and folder.is_dir():
        partial = folder / f".{FAILED_FIRST}.{os.getpid()}"
        partial.write_text(line)
        os.replace(partial, folder / FAILED_FIRST)  # whole, whichever rank writes last


def failure_of_the_first_attempt():
    """The line an earlier attempt of this launch failed with, where a restart cannot mend it."""
    folder = launch_folder()
    if folder is None or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0:
        return None
    marker = folder / FAILED_FIRST
    return marker.read_text() if marker.exists() else None


def no_room(err):
    """No room on the disk: what could not be written, and why."""
    return f"could not write {err.filename or 'a file'}: {err.strerror}"


# How libraries that write files in their own code report it: safetensors' Rust ("os error 28")
OS_ERROR = re.compile(r"os error (\d+)")


def out_of_room(err):
    """Why ``err`` means the disk or the quota ran out ("No space left on device"), or None. It
    may be an OSError, safetensors' own error, or a distributed checkpoint's error that carries
    each failed rank's."""
    if isinstance(err, OSError) and err.errno in NO_ROOM:
        return err.strerror
    found = OS_ERROR.search(str(err))
    if found and int(found.group(1)) in NO_ROOM:
        return os.strerror(int(found.group(1)))
    for failure, _stack in getattr(err, "failures", {}).values():  # DCP's CheckpointException
        if reason := out_of_room(failure):
            return reason
    cause = err.__cause__ or err.__context__
    return out_of_room(cause) if cause is not None else None


# --- collectives -----------------------------------------------------------------------------

# How gloo and NCCL report a peer that hung (a timeout) or died (a closed connection)
PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe")
TIMED_OUT = re.compile(r"[Tt]imed? ?out[^0-9]*?(\d+)\s*(ms|milliseconds)")


def is_collective_failure(err):
    import torch.distributed as dist
    return (dist.is_available() and dist.is_initialized()
            and bool(PEER_LOST.search(str(err)) or TIMED_OUT.search(str(err))))


# How PyTorch reports an allocation that did not fit: the GPU's (torch.OutOfMemoryError) and the
# CPU's allocator (its RuntimeError, when the process's memory limit or the node's is reached)
OUT_OF_MEMORY = re.compile(r"CUDA out of memory|HIP out of memory|XPU out of memory|"
                           r"DefaultCPUAllocator: can't allocate memory")
TRIED = re.compile(r"(?:Tried to allocate|you tried to allocate) ([\d.]+ ?[KMGT]?i?B|\d+ bytes)")


def out_of_memory(err):
    """One line on an allocation that did not fit: this rank, how much, where, and the fixes that
    keep the training the same."""
    tried = TRIED.search(str(err))
    amount = f" allocating {tried.group(1)}" if tried else ""
    return (f"{this_rank()}out of memory{amount}{where(err)}: lower --micro-batch (the same "
            "--batch-tokens trains the same, in more accumulation steps), add "
            "--activation-checkpointing (fsdp, tp, pp) or shard the model (fsdp); coursekit.memory "
            "predicts what fits")


def this_rank():
    import torch.distributed as dist
    initialized = dist.is_available() and dist.is_initialized()
    return f"rank {dist.get_rank()} of {dist.get_world_size()}: " if initialized else ""


def where(err):
    """ at script.py:LINE (the line's code): the innermost frame of the training script itself,
    not of the kit or a library; "" if there is none."""
    kit = Path(__file__).parent
    ours = [f for f in traceback.extract_tb(err.__traceback__) if "site-packages" not in f.filename
            and not f.filename.startswith(sys.prefix) and Path(f.filename).parent != kit]
    if not ours:
        return ""
    code = ours[-1].line.split("  # ")[0]  # without the comment (PEP 8: two spaces before it)
    return f" at {Path(ours[-1].filename).name}:{ours[-1].lineno} ({code})"


def collective_failure(err):
    """One line on a failed collective: this rank, the collective, the script's line that called
    it, and what happened to the peer."""
    frames = traceback.extract_tb(err.__traceback__)
    called = [f.name for f in frames if f.filename.endswith("distributed_c10d.py")
              and not f.name.startswith("_") and f.name != "wrapper"]
    if called:
        collective = called[0]  # what the script (or a library it called) asked for
    elif any(f.name == "backward" for f in frames):
        collective = "the gradient all-reduce in backward (DDP)"
    else:
        collective = "a collective"
    timed_out = TIMED_OUT.search(str(err))
    if timed_out:
        seconds = int(timed_out.group(1)) / 1000
        what = (f"did not complete within {seconds:g} s ({TIMEOUT_VARIABLE}): another process "
                "hung or is far behind")
    else:
        what = "lost a peer: another process died (its own log says why)"
    return f"{this_rank()}{collective}{where(err)} {what}"
