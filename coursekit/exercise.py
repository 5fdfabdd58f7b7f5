"""What a lesson's tests use to check an answer: that it is the trainee's own work, and, for an
answer that must run on several processes, the kit's checker of it.

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


def run_checker(checker, function, processes=2, folder="runs", timeout=300):
    """What the kit's ``checker`` module (coursekit.ddp_step_check, coursekit.fsdp_shard_check)
    prints as its last line, a JSON object, when torchrun runs it on ``processes`` processes with
    the source of the trainee's ``function``, written to ``folder``; {"error": its stderr's end}
    if it printed nothing."""
    import inspect
    import json
    import subprocess
    from pathlib import Path

    from coursekit.launch import torchrun

    answer = Path(folder) / f"{function.__name__}.py"
    answer.parent.mkdir(exist_ok=True)
    answer.write_text(inspect.getsource(function))
    done = subprocess.run([*torchrun(processes), "-m", checker, str(answer)],
                          capture_output=True, text=True, timeout=timeout)
    if not done.stdout.strip():
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.splitlines()[-1])
