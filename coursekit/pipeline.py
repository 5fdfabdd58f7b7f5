"""Measuring an input pipeline: how many samples a second come out of a loader, alone or with
the work a training step does on each batch, and how many files the loading opens.

    rate = pipeline.samples_per_second(loader, batches=20)             # the loader alone
    rate = pipeline.samples_per_second(loader, batches=20, work=step)   # and the step on each
    with pipeline.files_opened() as opened:
        next(iter(loader))
    len(opened)
"""
import contextlib
import sys
import time

import torch

_counters = []  # the lists files_opened() is filling now, innermost last


def _note_open(event, args):
    if event == "open" and _counters:
        _counters[-1].append(args[0])


_hook_installed = False


@contextlib.contextmanager
def files_opened():
    """The paths this process opens inside the block, in order, as Python's audit event "open"
    reports them (open(), io.open, os.open: what Pillow and tarfile use). Loader worker processes
    are not counted: measure with 0 workers."""
    global _hook_installed
    if not _hook_installed:  # an audit hook cannot be removed: one for the process, idle outside
        sys.addaudithook(_note_open)
        _hook_installed = True
    opened = []
    _counters.append(opened)
    try:
        yield opened
    finally:
        _counters.remove(opened)


def samples_per_second(loader, batches, work=None, warmup=2):
    """Samples a second that ``loader`` (an iterable of (inputs, labels)) delivers over
    ``batches`` batches, after ``warmup`` that start its workers and fill their queues; with
    ``work(inputs, labels)`` done on each batch in this process, as a training loop would."""
    stream = iter(loader)
    for _ in range(warmup):
        inputs, labels = next(stream)
        if work:
            work(inputs, labels)
    synchronize()
    start, samples = time.perf_counter(), 0
    for _ in range(batches):
        inputs, labels = next(stream)
        if work:
            work(inputs, labels)
        samples += len(labels)
    synchronize()  # a GPU's queued work is part of the time
    return samples / (time.perf_counter() - start)


def milliseconds(work, repeat=5):
    """The fastest of ``repeat`` runs of ``work()``, in ms: the time it takes when nothing else
    gets in its way."""
    times = []
    for _ in range(repeat):
        synchronize()
        start = time.perf_counter()
        work()
        synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return min(times)


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
