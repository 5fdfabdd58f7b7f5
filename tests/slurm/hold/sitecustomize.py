"""Holds a job that tests/test_slurm.py stops mid-run at a known step, however fast it trains.

The test puts this folder on PYTHONPATH and sets KIT_HOLD_AT_STEP=K for that one job, so every
Python process of the job loads this file at start-up. A process that prints the line of step K
("step K/...") waits right after it until Slurm's stop signal (SIGTERM or SIGUSR1) has reached it,
then carries on as it would have: its own handler has recorded the signal, so it checkpoints at
step K and exits. The test waits for that line in the job's log before it stops the job: without
the hold, a fast run could reach its last step first, and the test would depend on the race.
"""
import builtins
import os
import signal
import time

# the job's first run only: a requeued run that trains that step again goes on
HELD_STEP = os.environ.get("KIT_HOLD_AT_STEP") if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" \
    else None
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
arrived = []  # the stop signals this process has received


def install_noting(signum, handler, install=signal.signal):
    """signal.signal, except that a Python handler of a stop signal also notes its arrival."""
    if signum in STOP_SIGNALS and callable(handler):
        def noting(number, frame):
            arrived.append(number)
            return handler(number, frame)
        return install(signum, noting)
    return install(signum, handler)


def print_then_hold(*args, print_=builtins.print, **kwargs):
    print_(*args, **kwargs)
    if args and str(args[0]).startswith(f"step {HELD_STEP}/"):
        while not arrived:  # the handler runs between two sleeps
            time.sleep(0.05)


if HELD_STEP:
    signal.signal = install_noting
    builtins.print = print_then_hold
