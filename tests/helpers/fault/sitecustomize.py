"""Makes one process of a training run fail at a known step, for tests/test_faults.py.

The test puts this folder on PYTHONPATH and sets KIT_FAULT="ACTION RANK STEP", so every Python
process of the run loads this file at start-up. Right after the process of rank RANK prints the
line of step STEP ("step STEP/..."), it
    hangs  for good (a process stuck in a driver call or on a dead file system), or
    dies   at once by SIGKILL (what the out-of-memory killer or a segfault does).
KIT_FAULT_LAUNCHES=N (default 1) limits it to torchrun's first N launches of the group (its
restart count), so a restarted group runs through.
"""
import builtins
import os
import signal
import time

FAULT = os.environ.get("KIT_FAULT", "").split()


def print_then_fail(*args, print_=builtins.print, **kwargs):
    print_(*args, **kwargs)
    action, rank, step = FAULT
    if args and str(args[0]).startswith(f"step {step}/") and os.environ.get("RANK") == rank:
        if action == "dies":
            os.kill(os.getpid(), signal.SIGKILL)
        while action == "hangs":
            time.sleep(60)


launch = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
if FAULT and launch < int(os.environ.get("KIT_FAULT_LAUNCHES", 1)):
    builtins.print = print_then_fail
