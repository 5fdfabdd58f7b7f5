"""What a fresh `.ci/run` costs, process by process: every process the run starts, with its CPU,
whoever started it. `time .ci/run` counts only the processes its own tree waits for, and misses
what runs under slurmd (the Slurm tests' jobs), in the grading sandbox and in daemons (Ray's);
the per-test CPU a pytest hook can read misses the same. The kernel's process accounting (BSD
acct, `acct(2)`) records every process as it exits: its pid, its parent's, its start, its run
time and its CPU. A fresh clone of the kit runs `.ci/run` with accounting on and with a hook in its
tests/conftest.py that writes each test's worker, start and end; each process is then charged to
the test its worker was running when it ended, the Slurm jobs' to the Slurm worker's, the rest
to the set-up (before the first test) or to "other" (daemons and processes whose parent had gone).

Needs root (acct is a privileged call) and the 30 minutes of a fresh run; run nothing else
meanwhile. Writes benchmarks/results/suite_cost.json and prints the largest items.

    sudo .venv/bin/python benchmarks/suite_cost.py [--clone /tmp/suite-cost] [--top 40]
    .venv/bin/python benchmarks/suite_cost.py --records /tmp/suite-cost-records  # charge again
"""
import argparse
import collections
import ctypes
import json
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

from throughput import children_cpu

RESULTS = Path(__file__).resolve().parent / "results" / "suite_cost.json"
KIT_ROOT = Path(__file__).resolve().parents[1]

#: struct acct_v3 (linux/acct.h): flag, version, tty, exit code, uid, gid, pid, ppid, start (s),
#: elapsed (float, in ticks), then eight comp_t counters (user, system, ...) and the command name
ACCT_V3 = struct.Struct("<ccHIIIIIIf8H16s")
TICKS = 100  # AHZ: the unit of acct's times

#: appended to the clone's tests/conftest.py: each test's worker (pid), start and end
TIMELINE_HOOK = '''

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # added by benchmarks/suite_cost.py
    import json, os, time
    start = time.time()
    yield
    with open(os.path.join(os.environ["SUITE_COST_DIR"], f"tests-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"id": item.nodeid, "pid": os.getpid(), "start": start,
                            "end": time.time()}) + "\\n")
'''


def comp_t(value):
    """acct's 16-bit float: a 13-bit mantissa and a base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


def processes(path):
    """Every process that exited while accounting was on."""
    data = path.read_bytes()
    found = []
    for offset in range(0, len(data) - ACCT_V3.size + 1, ACCT_V3.size):
        (_, _, _, _, _, _, pid, ppid, start, elapsed, user, system, *_,
         name) = ACCT_V3.unpack_from(data, offset)
        found.append({"pid": pid, "ppid": ppid, "start": start, "end": start + elapsed / TICKS,
                      "cpu": (comp_t(user) + comp_t(system)) / TICKS,
                      "name": name.rstrip(b"\0").decode(errors="replace")})
    return found


def set_accounting(path):
    """Turn the kernel's process accounting on into ``path`` (None: off)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(None if path is None else str(path).encode()) != 0:
        raise SystemExit(f"error: acct({path}) failed: {os.strerror(ctypes.get_errno())} "
                         "(process accounting needs root)")


def busy_cpu_seconds():
    """The machine's CPU-seconds not idle since boot (/proc/stat), whoever used them."""
    user, nice, system, idle, iowait, *rest = map(int, Path("/proc/stat").read_text()
                                                  .splitlines()[0].split()[1:])
    return (user + nice + system + sum(rest)) / os.sysconf("SC_CLK_TCK")


def run_fresh_clone(clone, folder):
    """`.ci/run` in a fresh clone of the kit, with the timeline hook: its exit status, wall
    seconds, the CPU-seconds `time .ci/run` would print and the machine's busy CPU-seconds."""
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "--quiet", str(KIT_ROOT), str(clone)], check=True)
    with open(clone / "tests" / "conftest.py", "a") as conftest:
        conftest.write(TIMELINE_HOOK)
    start, waited, busy = time.monotonic(), children_cpu(), busy_cpu_seconds()
    with open(folder / "ci.log", "w") as log:
        status = subprocess.run([str(clone / ".ci" / "run")], cwd=clone, stdout=log,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "SUITE_COST_DIR": str(folder)}).returncode
    return {"exit_status": status, "wall_s": round(time.monotonic() - start),
            "time_cpu_s": round(children_cpu() - waited),
            "busy_cpu_s": round(busy_cpu_seconds() - busy)}


class Ancestry:
    """Who started each process: its parent among the processes alive when it started."""

    def __init__(self, found):
        self.by_pid = collections.defaultdict(list)
        for process in found:
            self.by_pid[process["pid"]].append(process)

    def parent(self, process):
        return next((p for p in self.by_pid.get(process["ppid"], [])
                     if p["start"] <= process["start"] + 1 and p["end"] >= process["end"] - 1),
                    None)

    def worker_and_names(self, process, workers):
        """The pytest worker above ``process`` (or None), and the names on the way up."""
        names = [process["name"]]
        while process is not None and len(names) < 64:
            if process["ppid"] in workers or process["pid"] in workers:
                return process["ppid"] if process["ppid"] in workers else process["pid"], names
            process = self.parent(process)
            names.append(process["name"] if process else "?")
        return None, names


def running_at(tests, when):
    """The test of ``tests`` (one worker's, in order) running at ``when``, or None."""
    running = [test for test in tests if test["start"] - 1 <= when <= test["end"] + 1]
    return running[-1]["id"] if running else None


def unowned_kind(process, names, first_test):
    """What a process that no worker or Slurm job started is: part of the set-up, a grading
    sandbox's, or another (by the name of the topmost process found above it)."""
    if process["end"] < first_test:
        return "set-up"
    return "sandbox" if "bwrap" in names else f"other: {(names[:-1] or names)[-1]}"


def charge(found, tests):
    """CPU-seconds per test (what its worker started), per Slurm test (its jobs), and per kind of
    process that no worker started. A worker's own CPU (the tests that run in it, not in a
    process of their own) is known only when the worker ends: it is charged as one item."""
    by_worker = collections.defaultdict(list)
    for test in sorted(tests, key=lambda test: test["start"]):
        by_worker[test["pid"]].append(test)
    slurm_worker = max(by_worker, key=lambda pid: sum("test_slurm" in t["id"]
                                                      for t in by_worker[pid]))
    first_test = min(test["start"] for test in tests)
    ancestry = Ancestry(found)
    per_test, per_slurm_test, unowned = (collections.Counter() for _ in range(3))
    for process in found:
        worker, names = ancestry.worker_and_names(process, by_worker)
        if process["pid"] in by_worker:  # its CPU is that of the tests run in the worker itself
            owner, test = per_test, "pytest workers (tests run in-process)"
        elif worker is not None:
            owner, test = per_test, running_at(by_worker[worker], process["end"])
        elif "slurmstepd" in names:
            owner, test = per_slurm_test, running_at(by_worker[slurm_worker], process["end"])
        else:
            owner, test = unowned, unowned_kind(process, names, first_test)
        owner[test or "between tests"] += process["cpu"]
    return per_test, per_slurm_test, unowned


def record_a_fresh_run(clone):
    """Run `.ci/run` in a fresh clone with accounting on: the folder of the records."""
    folder = clone.with_name(clone.name + "-records")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(mode=0o700)
    (folder / "acct").touch(mode=0o600)  # what every process ran is no one else's business
    set_accounting(folder / "acct")
    try:
        run = run_fresh_clone(clone, folder)
    finally:
        set_accounting(None)
    head = subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    (folder / "run.json").write_text(json.dumps({"head": head, **run}))
    return folder


def rounded(counter, top):
    return [[name, round(cpu, 1)] for name, cpu in counter.most_common(top)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clone", type=Path, default=Path("/tmp/suite-cost"))
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--records", type=Path,
                        help="charge the records of an earlier run again instead of running")
    args = parser.parse_args()
    folder = args.records or record_a_fresh_run(args.clone)
    run = json.loads((folder / "run.json").read_text())
    tests = [json.loads(line) for path in folder.glob("tests-*.jsonl")
             for line in path.read_text().splitlines()]
    found = processes(folder / "acct")
    per_test, per_slurm_test, unowned = charge(found, tests)
    result = {
        **run, "processes": len(found),
        "cpu_s": {"all": round(sum(p["cpu"] for p in found)),
                  "tests": round(sum(per_test.values())),
                  "slurm jobs": round(sum(per_slurm_test.values())),
                  **{name: round(cpu) for name, cpu in unowned.most_common(8)}},
        "tests": rounded(per_test, args.top), "slurm_tests": rounded(per_slurm_test, args.top)}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({key: value for key, value in result.items()
                      if key not in ("tests", "slurm_tests")}, indent=1))
    for title, rows in (("tests", result["tests"]), ("slurm jobs, by test", result["slurm_tests"])):
        print(f"--- {title}")
        for name, cpu in rows:
            print(f"{cpu:8.1f}  {name}")


if __name__ == "__main__":
    main()
