"""Batch and scaling arithmetic: what one optimiser step holds, and what N processes buy.

Batch: tokens per step = micro-batch x gradient accumulation x processes x sequence length; an
epoch is the data set's tokens over that (whole steps only, as a data loader drops the rest).

Scaling: speedup S = T1 / Tp, efficiency E = S / p, Amdahl's law S = 1 / (s + (1 - s) / p) for a
serial fraction s, and the Karp-Flatt metric, the serial fraction a measured speedup implies.
"""
from coursekit import KitError


def _positive(**values):
    for name, value in values.items():
        if not value > 0:
            raise KitError(f"{name} must be positive, got {value!r}")


def tokens_per_step(micro_batch, grad_accum, seq_len, processes=1):
    """The global batch in tokens: every process runs grad_accum microbatches per step."""
    _positive(micro_batch=micro_batch, grad_accum=grad_accum, seq_len=seq_len, processes=processes)
    return micro_batch * grad_accum * processes * seq_len


def steps_per_epoch(dataset_tokens, micro_batch, grad_accum, seq_len, processes=1):
    """Whole optimiser steps in one pass over ``dataset_tokens``."""
    if dataset_tokens < 0:
        raise KitError(f"dataset tokens cannot be negative, got {dataset_tokens!r}")
    return dataset_tokens // tokens_per_step(micro_batch, grad_accum, seq_len, processes)


def speedup(t1, tp):
    """How many times faster p processes finish the job that takes t1 on one."""
    _positive(t1=t1, tp=tp)
    return t1 / tp


def efficiency(t1, tp, p):
    """The speedup per process: 1.0 means no process waits or repeats work."""
    return speedup(t1, tp) / p


def amdahl_speedup(serial_fraction, p):
    """The best speedup on p processes when ``serial_fraction`` of the work cannot be split."""
    if not 0 <= serial_fraction <= 1:
        raise KitError(f"serial fraction must be between 0 and 1, got {serial_fraction!r}")
    return 1 / (serial_fraction + (1 - serial_fraction) / p)


def karp_flatt(t1, tp, p):
    """The serial fraction that Amdahl's law needs to explain a measured speedup on p > 1."""
    if p <= 1:
        raise KitError(f"the Karp-Flatt metric needs 2 processes or more, got {p!r}")
    return (1 / speedup(t1, tp) - 1 / p) / (1 - 1 / p)


def measured_scaling(times):
    """Rows (p, seconds, speedup, efficiency, serial fraction or None) of ``times`` = {p: seconds
    for the same job}; the job must have been timed on one process."""
    if 1 not in times:
        raise KitError(f"measured times need the 1-process run, got processes {sorted(times)}")
    t1 = times[1]
    return [(p, t, speedup(t1, t), efficiency(t1, t, p), karp_flatt(t1, t, p) if p > 1 else None)
            for p, t in sorted(times.items())]
