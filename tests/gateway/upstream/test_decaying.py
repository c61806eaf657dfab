import math

import pytest

from kvgate.gateway.upstream.decaying import DecayingSum


def test_each_part_fades_with_its_own_age() -> None:
    total = DecayingSum(10.0)
    total.add(100, 0.0)
    total.add(50, 10.0)  # the first part is 1/e of itself by now
    assert total.value(10.0) == pytest.approx(100 / math.e + 50)
    assert total.value(20.0) == pytest.approx(100 / math.e**2 + 50 / math.e)


def test_a_half_life_halves_the_sum() -> None:
    total = DecayingSum.with_half_life(30.0)
    total.add(8, 0.0)
    assert total.value(60.0) == pytest.approx(2)


def test_time_does_not_run_back() -> None:
    total = DecayingSum(10.0)
    total.add(100, 10.0)
    total.add(1, 5.0)  # a late reading counts as of the last one
    assert total.value(0.0) == pytest.approx(101)
    total.clear()
    assert total.value(10.0) == 0.0
