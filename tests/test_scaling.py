"""Batch and scaling arithmetic (coursekit.scaling), checked against worked examples."""
import math

import pytest

from coursekit import KitError, scaling

pytestmark = pytest.mark.unit


def test_gpt2_124m_takes_half_a_million_tokens_per_step():
    assert scaling.tokens_per_step(64, 8, 1024) == 524_288
    assert scaling.tokens_per_step(16, 4, 1024, processes=8) == 524_288
    assert scaling.steps_per_epoch(10_000_000_000, 64, 8, 1024) == 19_073


def test_an_epoch_counts_whole_steps_only():
    assert scaling.steps_per_epoch(1023, 4, 2, 128) == 0
    assert scaling.steps_per_epoch(2048, 4, 1, 128, processes=2) == 2


def test_speedup_and_efficiency_of_80_hours_on_1_and_22_on_4():
    assert scaling.speedup(80, 22) == pytest.approx(3.636, abs=1e-3)
    assert scaling.efficiency(80, 22, 4) == pytest.approx(0.909, abs=1e-3)


def test_amdahl_caps_the_speedup_at_one_over_the_serial_fraction():
    assert scaling.amdahl_speedup(0.05, 10**9) == pytest.approx(20)
    assert scaling.amdahl_speedup(0.0, 8) == 8
    assert scaling.amdahl_speedup(1.0, 64) == 1
    assert scaling.amdahl_speedup(0.1, 4) == pytest.approx(1 / 0.325)


def test_karp_flatt_recovers_the_serial_fraction_of_an_amdahl_run():
    for fraction in (0.0, 0.03, 0.2):
        for p in (2, 16, 1000):
            tp = 100 * (fraction + (1 - fraction) / p)  # the serial part, then the split part
            assert scaling.karp_flatt(100, tp, p) == pytest.approx(fraction, abs=1e-12)


def test_measured_rows_are_sorted_and_start_at_one_process():
    rows = scaling.measured_scaling({4: 4.0, 1: 10.0, 2: 6.0})
    assert [r[0] for r in rows] == [1, 2, 4]
    assert rows[0][2:] == (1.0, 1.0, None)
    assert rows[2][2] == 2.5 and rows[2][3] == 0.625 and math.isclose(rows[2][4], 0.2)


@pytest.mark.parametrize("call, message", [
    (lambda: scaling.tokens_per_step(0, 1, 128), "micro_batch must be positive, got 0"),
    (lambda: scaling.steps_per_epoch(-1, 4, 1, 128), "dataset tokens cannot be negative, got -1"),
    (lambda: scaling.speedup(10, -1), "tp must be positive, got -1"),
    (lambda: scaling.amdahl_speedup(1.5, 4), "serial fraction must be between 0 and 1, got 1.5"),
    (lambda: scaling.karp_flatt(10, 5, 1), "needs 2 processes or more, got 1"),
    (lambda: scaling.measured_scaling({2: 5.0, 4: 3.0}), "need the 1-process run, got processes [2, 4]"),
])
def test_bad_input_names_the_value(call, message):
    with pytest.raises(KitError) as err:
        call()
    assert message in str(err.value)
