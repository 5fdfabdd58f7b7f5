"""The stage scripts of solutions/ (train_gpt2_<stage>.py), found by name and imported as modules,
so that lessons and tests use their model, data loader and schedule instead of copies of them."""
import importlib.util
from pathlib import Path

from coursekit import KIT_ROOT, KitError


def script_path(stage, root=KIT_ROOT):
    return Path(root) / "solutions" / f"train_gpt2_{stage}.py"


def names(root=KIT_ROOT):
    """The stages whose scripts are in solutions/, sorted."""
    return sorted(p.stem.removeprefix("train_gpt2_")
                  for p in (Path(root) / "solutions").glob("train_gpt2_*.py"))


def load(stage, root=KIT_ROOT):
    """Import solutions/train_gpt2_<stage>.py as the module ``train_gpt2_<stage>``."""
    path = script_path(stage, root)
    if not path.exists():
        raise KitError(f"no stage {stage!r}: stages in solutions/ are {', '.join(names(root))}")
    return load_script(path)


def load_script(path, name=None):
    """Import any training script, a trainee's working copy for one, as a module (``name``, by
    default the file's stem)."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
