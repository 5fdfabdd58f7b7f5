"""What a lesson's hidden tests use to check that an answer is the trainee's own work.

An exercise that asks for, say, the FLOPs per token would be passed by ``return
perf.flops_per_token(...)``: the kit already computes it. Hidden tests run their checks inside
``own_work(perf.flops_per_token)``, where calling the kit's function fails, so such an answer
scores nothing on that cell while an answer that does the work itself is unaffected.
"""
from contextlib import contextmanager


def _refuse(*args, **kwargs):
    # This code runs as the swapped function's, with that module's globals: only builtins here.
    raise AssertionError("this exercise asks for your own code, not a call to the kit's "
                         "function that computes the same thing")


@contextmanager
def own_work(*functions):
    """Within the block, calling any of ``functions`` raises AssertionError.

    The functions' code is swapped rather than the names that refer to them, so that an answer
    that imported the function under another name, or kept a reference to it, is caught too.
    Work out expected values with these functions before the block, not inside it.
    """
    saved = [function.__code__ for function in functions]
    try:
        for function in functions:
            function.__code__ = _refuse.__code__
        yield
    finally:
        for function, code in zip(functions, saved):
            function.__code__ = code


def conversion_losses(script, solution, data_dir, out_dir, steps=4):
    """The losses of a trainee's converted stage script and of the finished one, each trained
    for ``steps`` small steps in this process (one process: a group of one) on ``data_dir``:
    the hidden tests of a conversion compare them. ``script`` and ``solution`` are modules
    (coursekit.stages.load_script, stages.load)."""
    import contextlib
    import io
    import shutil
    from pathlib import Path

    from coursekit import runs

    losses = []
    for module, name in ((script, "yours"), (solution, "solution")):
        out = Path(out_dir) / name
        shutil.rmtree(out, ignore_errors=True)
        with contextlib.redirect_stdout(io.StringIO()):
            module.main(["--preset", "tiny", "--device", "cpu", "--data", str(data_dir),
                         "--out", str(out), "--max-steps", str(steps), "--micro-batch", "1",
                         "--batch-tokens", "256", "--eval-steps", "1", "--sample-tokens", "0"])
        losses.append([record["loss"] for record in runs.read_metrics(out)])
    return losses
