"""Interrupting a training run at a known step: start it, read what it prints line by line until
the line of that step appears, and only then signal it. The signal follows a state (that step is
done and logged), not a guess at how long steps take."""
import subprocess


def start(command, env, **popen):
    """Start ``command`` with stdout and stderr merged into one pipe read line by line."""
    return subprocess.Popen(list(map(str, command)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, **popen)


def read_until(process, prefix):
    """The lines ``process`` printed up to and including the first that starts with ``prefix``;
    fails, showing them, if it exits before printing one."""
    lines = []
    for line in process.stdout:  # blocks until the next line: no polling, no sleep
        lines.append(line)
        if line.startswith(prefix):
            return lines
    process.wait()
    raise AssertionError(f"exited with {process.returncode} before printing {prefix!r}:\n"
                         + "".join(lines[-40:]))


def finish(process, lines):
    """Wait for ``process`` to exit; (return code, all it printed). The rest is read through the
    same buffered pipe as ``lines`` were, so nothing read ahead is lost."""
    rest = process.stdout.read()
    process.wait()
    return process.returncode, "".join(lines) + rest
