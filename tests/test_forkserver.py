"""The tests' fork server (tests/helpers/forkserver.py): a forked run is the run a process of its
own would have been, and nobody but its owner gets one."""
import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from conftest import (FORK_SERVER, KIT_ROOT, ONE_THREAD, TEN_STEPS, free_port, kit_env,
                      stage_command, torchrun_worker_env)
from coursekit import runs
from helpers import forkserver

pytestmark = pytest.mark.stages


def script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_a_forked_run_trains_bit_for_bit_as_a_process_of_its_own(builtin_data, tmp_path):
    """The same std run, forked and started: the same metrics (timings aside) and the same
    checkpointed weights, byte for byte."""
    args = [*TEN_STEPS, "--max-steps", 3, "--ckpt-interval", 3, "--eval-interval", 3,
            "--data", builtin_data]
    forked = FORK_SERVER.run(stage_command("train_gpt2_std.py", *args, "--out", tmp_path / "f"),
                             kit_env(ONE_THREAD), KIT_ROOT, 600)
    started = subprocess.run(stage_command("train_gpt2_std.py", *args, "--out", tmp_path / "s"),
                             capture_output=True, text=True, env=kit_env(ONE_THREAD), cwd=KIT_ROOT,
                             timeout=600)
    assert forked is not None and forked.returncode == started.returncode == 0, forked.stderr
    timings = ("ms", "tok_per_s", "mfu")
    metrics = [[{k: v for k, v in record.items() if k not in timings}
                for record in runs.read_metrics(tmp_path / name)] for name in "fs"]
    assert metrics[0] == metrics[1] and len(metrics[0]) == 3
    weights = [tmp_path / name / "ckpt" / "step_00000003" / "tensors.safetensors" for name in "fs"]
    assert weights[0].read_bytes() == weights[1].read_bytes()


def test_a_forked_run_exits_as_its_interpreter_would(tmp_path):
    """Its exit status (sys.exit's, an exception's, a signal's as -N), what it printed without a
    flush, its atexit functions and its threads' last words, its own folder, thread count and
    process group."""
    command = script(tmp_path, "exits.py", """
        import atexit, os, signal, sys, threading, time, torch
        atexit.register(print, "atexit ran")
        threading.Thread(target=lambda: (time.sleep(0.2), print("thread done"))).start()
        print(os.getcwd(), torch.get_num_threads(), os.getpgid(0) == os.getpid(), sys.argv[1:])
        if sys.argv[1] == "exit":
            sys.exit(3)
        if sys.argv[1] == "raise":
            raise ValueError("bad value")
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        """)
    env = kit_env({"OMP_NUM_THREADS": "1"})
    for how, code in (("exit", 3), ("raise", 1), ("kill", -9), ("end", 0)):
        result = FORK_SERVER.run([*command, how], env, tmp_path, 60)
        assert result.returncode == code, (how, result.stderr)
        assert result.stdout.startswith(f"{tmp_path} 1 True ['{how}']\n"), result.stdout
        if how != "kill":
            assert result.stdout.endswith("thread done\natexit ran\n"), result.stdout
    assert "ValueError: bad value" in FORK_SERVER.run([*command, "raise"], env, tmp_path,
                                                      60).stderr


def test_a_failed_rank_gets_the_group_killed_instead_of_a_hang(tmp_path):
    """Rank 1 fails while rank 0 waits in a collective: rank 0 is killed, as torchrun kills a
    failed rank's group, and the group's status is torchrun's 1."""
    command = script(tmp_path, "rank.py", """
        import os, sys, torch.distributed as dist
        if os.environ["RANK"] == "1":
            sys.exit(5)
        dist.init_process_group("gloo")
        dist.barrier()
        """)
    env, port = kit_env(), free_port()
    result = FORK_SERVER.group([command] * 2, [torchrun_worker_env(env, rank, 2, port)
                                              for rank in range(2)], tmp_path, 120)
    assert result.returncode == 1


def test_a_group_past_its_deadline_is_killed_saying_where_each_run_was(tmp_path):
    """A hung group (here, one rank waits in a barrier for a rank that sleeps) is killed at its
    deadline, and the error says what the runs wrote and where each one was stuck: a hang that
    a loaded machine turns up once in many runs can then be read from the log."""
    command = script(tmp_path, "hangs.py", """
        import os, time, torch.distributed as dist
        def waits_for_the_other():
            dist.barrier()
        def sleeps_instead():
            time.sleep(600)
        dist.init_process_group("gloo")
        print(f"rank {os.environ['RANK']} started", flush=True)
        (sleeps_instead if os.environ["RANK"] == "1" else waits_for_the_other)()
        """)
    env, port = kit_env(), free_port()
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        FORK_SERVER.group([command] * 2, [torchrun_worker_env(env, rank, 2, port)
                                          for rank in range(2)], tmp_path, 10)
    said = "\n".join(expired.value.__notes__)
    assert "rank 0 started" in said and "rank 1 started" in said, said
    assert "waits_for_the_other" in said and "sleeps_instead" in said, said


def test_a_run_whose_imports_would_read_another_environment_is_refused():
    """A variable that a library may read when imported (here huggingface_hub's offline switch)
    differs from the server's: the server refuses, and the caller starts a process of its own."""
    assert FORK_SERVER.run([sys.executable, str(KIT_ROOT / "solutions" / "gpt.py")],
                           kit_env({"HF_HUB_OFFLINE": "1"}), KIT_ROOT, 60) is None
    assert any("HF_HUB_OFFLINE" in reason for reason in FORK_SERVER.refused)


def test_a_pythonpath_of_the_runs_own_comes_first_unless_it_holds_another_copy(tmp_path):
    """A folder on the run's PYTHONPATH (relative to its working folder, as DeepSpeed's launch
    puts one there) comes right after the script's own, as in a fresh process; one that holds
    another numpy than the one the server imported is refused, since a fresh process would
    import that one instead."""
    command = script(tmp_path, "path.py", "import sys, extra; print(sys.path[1], extra.NAME)\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "extra.py").write_text("NAME = 'extra'\n")
    env = kit_env({"PYTHONPATH": os.pathsep.join(filter(None, ["lib",
                                                               os.environ.get("PYTHONPATH")]))})
    served = FORK_SERVER.run(command, env, tmp_path, 60)
    assert served.stdout == f"{tmp_path / 'lib'} extra\n", served.stderr
    (tmp_path / "lib" / "numpy.py").write_text("")
    assert FORK_SERVER.run(command, env, tmp_path, 60) is None
    assert "its PYTHONPATH holds other copies of numpy" in FORK_SERVER.refused


def test_a_change_in_the_tests_own_environment_starts_the_server_anew(monkeypatch, tmp_path):
    """An import in the tests' process sets a variable there (Ray's import sets three): runs in
    that environment are forked from a new server started in it, not refused."""
    command = script(tmp_path, "env.py", "import os; print(os.environ.get('KIT_DRIFT'))\n")
    assert FORK_SERVER.run(command, kit_env(), tmp_path, 60).stdout == "None\n"
    before = FORK_SERVER.process.pid
    monkeypatch.setenv("KIT_DRIFT", "y")
    result = FORK_SERVER.run(command, kit_env(), tmp_path, 60)
    assert result is not None and result.stdout == "y\n" and FORK_SERVER.process.pid != before


def test_another_user_gets_no_run(cotenant, tmp_path):
    """Whoever reaches the socket runs code as its owner: its folder is the owner's alone, and a
    server whose folder another user can enter still refuses their request (SO_PEERCRED)."""
    FORK_SERVER.run(script(tmp_path, "nothing.py", "pass\n"), kit_env(), tmp_path, 60)
    folder = os.path.dirname(FORK_SERVER.socket_path)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    created = tmp_path / "created-by-the-cotenant"
    payload = script(tmp_path, "payload.py", f"open({str(created)!r}, 'w')\n")[1]
    attack = textwrap.dedent(f"""
        import json, socket, sys
        connection = socket.socket(socket.AF_UNIX)
        connection.connect(sys.argv[1])
        env = json.loads(sys.argv[2])  # the worst case: they know the owner's environment
        request = {{"argv": [{payload!r}], "env": env, "cwd": "/tmp"}}
        socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2])
        connection.shutdown(socket.SHUT_WR)
        try:
            print(repr(connection.recv(100)))
        except ConnectionResetError:
            print("reset")
        """)
    refused = cotenant.run("/usr/bin/python3", "-c", attack, FORK_SERVER.socket_path,
                           json.dumps(kit_env()), check=False)
    assert refused.returncode != 0 and "PermissionError" in refused.stderr, refused
    opened = forkserver.Server(kit_env)
    opened.start()
    try:
        os.chmod(os.path.dirname(opened.socket_path), 0o711)
        os.chmod(opened.socket_path, 0o777)
        answered = cotenant.run("/usr/bin/python3", "-c", attack, opened.socket_path,
                                json.dumps(kit_env()), check=False)
    finally:
        opened.stop()
    assert answered.stdout.strip() in ("b''", "reset"), answered  # closed without a word
    assert not created.exists()
