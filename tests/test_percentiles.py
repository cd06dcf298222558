"""The one percentile of raw values (kvscope/percentiles.py) against numpy's, its independent
oracle (linear interpolation between closest ranks, numpy.percentile's default)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.percentiles import value_percentiles


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False), min_size=1,
                max_size=300))
def test_value_percentiles_are_numpys(values):
    got = value_percentiles(values)
    want = np.percentile(values, [50, 95, 99])
    assert list(got) == ["p50", "p95", "p99"]
    assert np.allclose(list(got.values()), want, rtol=1e-12, atol=1e-12)


def test_nothing_measured_is_none_not_zero():
    assert value_percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert value_percentiles([0.25]) == {"p50": 0.25, "p95": 0.25, "p99": 0.25}
