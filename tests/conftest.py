"""Shared fixtures: the kit's root, a freshly built builtin corpus, and a runner for stage scripts."""
import os
import subprocess
import sys

import pytest

from coursekit import KIT_ROOT, data


@pytest.fixture(scope="session")
def kit_root():
    return KIT_ROOT


@pytest.fixture(scope="session")
def builtin_data(tmp_path_factory):
    """The offline corpus, built once per test session exactly as `make book` builds it."""
    out = tmp_path_factory.mktemp("builtin")
    data.prepare_builtin(out, progress=False)
    return out


def stage_command(script, *args):
    return [sys.executable, str(KIT_ROOT / "solutions" / script), *map(str, args)]


def run_stage(script, *args, timeout=600, env=None, **kwargs):
    """Run a stage script to completion; returns the CompletedProcess (text output)."""
    return subprocess.run(stage_command(script, *args), capture_output=True, text=True,
                          timeout=timeout, cwd=kwargs.pop("cwd", KIT_ROOT), env=env or kit_env(),
                          **kwargs)


def kit_env(extra=None):
    env = dict(os.environ)
    env.setdefault("TIKTOKEN_CACHE_DIR", str(data.tiktoken_cache_dir()))
    return {**env, **(extra or {})}
