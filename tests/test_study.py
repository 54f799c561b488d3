"""experiments/study.py's helpers that run no process: the direct search for the temperature matched in NLL."""

import math

import pytest

from experiments import study


def search(f, target, **kw):
    """study.match_temperature on f(T) with every call recorded: (probes, best, the Ts f was called at)."""
    calls = []

    def nll_at(t):
        calls.append(t)
        return f(t), f"run at {t}"
    probes, best = study.match_temperature(nll_at, target, **kw)
    return probes, best, calls


def test_each_probe_is_a_run_and_the_search_stops_within_tolerance_on_a_monotone_curve():
    f = lambda t: 1.0 + 2.0 * t ** 2  # T* = sqrt((target - 1) / 2)
    probes, best, calls = search(f, 3.2, slope=8.0, tolerance=0.02, max_probes=4)
    assert [p[0] for p in probes] == calls and calls[0] == 1.0 and len(calls) <= 4
    assert all(p[1] == f(p[0]) and p[2] == f"run at {p[0]}" for p in probes)  # no value interpolated
    assert abs(probes[best][1] - 3.2) < 0.02 and abs(probes[best][0] - math.sqrt(1.1)) < 0.01
    assert best == len(probes) - 1  # it stopped at the first probe within tolerance


def test_a_line_is_hit_exactly_by_the_first_step_then_the_secant():
    probes, best, calls = search(lambda t: 2.9 + 10.0 * (t - 1.0), 3.1, slope=8.0)
    # first step (3.1 - 2.9) / 8 = 0.025 lands at 3.15; the secant's slope is 10: T = 1.025 - 0.05 / 10 = 1.02
    assert calls == pytest.approx([1.0, 1.025, 1.02]) and best == 2 and probes[2][1] == pytest.approx(3.1)


def test_the_bracket_is_bisected_where_the_secant_leaves_it():
    f = lambda t: 3.0 if t < 1.01 else 4.0 if t < 1.03 else 5.0
    probes, best, calls = search(f, 3.5, slope=8.0, max_probes=4)
    # 1 -> 1 + 0.5/8 = 1.0625 (5); secant slope 32: 1.0625 - 1.5/32 = 1.015625 (4); the secant through the last two
    # (slope 21.3) points below 1, outside the bracket (1, 1.015625): bisected to 1.0078125 (3)
    assert calls == pytest.approx([1.0, 1.0625, 1.015625, 1.0078125])
    assert len(probes) == 4 and abs(probes[best][1] - 3.5) == 0.5 and best == 0


def test_a_flat_secant_falls_back_to_the_first_slope_and_the_closest_probe_is_returned():
    f = lambda t: 3.0 if t < 1.1 else 4.0
    probes, best, calls = search(f, 3.4, slope=8.0, max_probes=4)
    # 1 (3) -> 1.05 (3): flat, so again 0.4 / 8 -> 1.10 (4); then the secant in the bracket (1.05, 1.10): 1.07 (3)
    assert calls == pytest.approx([1.0, 1.05, 1.1, 1.07]) and best == 0 and probes[best][1] == 3.0
