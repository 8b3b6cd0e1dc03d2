from hypothesis import given
from hypothesis import strategies as st
from pagedkv.intmath import cdiv, next_power_of_2, prev_power_of_2


@given(st.integers(0, 1 << 40), st.integers(1, 1 << 20))
def test_cdiv_is_the_ceiling(a, b):
    q = cdiv(a, b)
    assert q * b >= a > (q - 1) * b or (a == 0 and q == 0)


@given(st.integers(1, 1 << 40))
def test_next_power_of_2_is_the_smallest_not_below(n):
    p = next_power_of_2(n)
    assert p & (p - 1) == 0 and p >= n and (p == 1 or p // 2 < n)


def test_next_power_of_2_of_small_values():
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 4, 5, 64, 65)] == [1, 1, 2, 4, 4, 8, 64, 128]


@given(st.integers(1, 1 << 40))
def test_prev_power_of_2_is_the_largest_not_above(n):
    p = prev_power_of_2(n)
    assert p & (p - 1) == 0 and p <= n < 2 * p


def test_prev_power_of_2_of_small_values():
    assert [prev_power_of_2(n) for n in (0, 1, 2, 3, 4, 5, 64, 65)] == [1, 1, 2, 2, 4, 4, 64, 64]
