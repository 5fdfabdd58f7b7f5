"""The builtin corpus built a second time is byte for byte the first (DESIGN.md section 4:
deterministic for a given environment). A second build takes half a minute on two cores, so this
is a `slow` test, outside `make test-fast`."""
import pytest

from coursekit import data

pytestmark = pytest.mark.slow


def test_builtin_corpus_is_deterministic(builtin_data, tmp_path):
    data.prepare_builtin(tmp_path, progress=False)
    first, second = sorted(builtin_data.glob("*.npy")), sorted(tmp_path.glob("*.npy"))
    assert [p.name for p in first] == [p.name for p in second]
    for one, other in zip(first, second):
        assert one.read_bytes() == other.read_bytes(), one.name
