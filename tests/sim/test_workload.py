"""Arrivals and lengths."""

from __future__ import annotations

import random
import statistics

from sim.workload import (LengthSampler, build_workload, gamma_arrivals, popularity,
                          trace_arrivals)


def test_popularity_is_heavy_tailed_and_sums_to_one():
    w = sorted(popularity(128, random.Random(0)), reverse=True)
    assert abs(sum(w) - 1) < 1e-9
    assert w[0] / w[-1] > 1000  # rates span more than three orders of magnitude
    assert sum(w[:13]) > 0.5  # the top 10% carry most of the traffic


def test_gamma_arrivals_have_the_requested_rate_and_cv():
    times = gamma_arrivals(rate=2.0, duration=200000.0, rng=random.Random(1), cv=8.0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = statistics.fmean(gaps)
    assert abs(mean - 0.5) / 0.5 < 0.25
    cv = statistics.pstdev(gaps) / mean
    assert 6.0 < cv < 10.0


def test_lengths_come_from_the_trace_and_fit_the_context():
    s = LengthSampler.from_csv()
    rng = random.Random(0)
    pairs = [s.sample(rng, 4096) for _ in range(3000)]
    assert all(i + o <= 4096 and i >= 1 and o >= 1 for i, o in pairs)
    assert 800 < statistics.median(i for i, _ in pairs) < 1300  # trace p50 input 1020
    assert 100 < statistics.median(o for _, o in pairs) < 160  # trace p50 output 129


def test_same_seed_same_workload_different_seed_different():
    s = LengthSampler.from_csv()
    args = (["a", "b", "c"], {"a": 4096, "b": 4096, "c": 4096}, 600.0, 1.0)
    w1 = build_workload(*args, seed=3, lengths=s)
    w2 = build_workload(*args, seed=3, lengths=s)
    w3 = build_workload(*args, seed=4, lengths=s)
    assert w1 == w2 and w1 != w3
    assert [a.time for a in w1] == sorted(a.time for a in w1)


def test_azure_functions_per_minute_file(tmp_path):
    path = tmp_path / "invocations.csv"
    header = "HashOwner,HashApp,HashFunction,Trigger," + ",".join(str(i) for i in range(1, 1441))
    rows = [header]
    for f, counts in enumerate([[5, 0, 3], [0, 0, 0], [1, 1, 1], [10, 0, 0]]):
        rows.append(f"o{f},a{f},f{f},http," + ",".join(str(c) for c in counts + [0] * 1437))
    path.write_text("\n".join(rows) + "\n")
    arr = trace_arrivals(path, ["m1", "m2", "m3"], duration=180.0, rps=None, seed=0)
    assert len(arr) == 8 + 3 + 10  # three of the three active functions, counts kept
    minute_counts = sorted(sum(1 for t, m in arr if m == x) for x in ("m1", "m2", "m3"))
    assert minute_counts == [3, 8, 10]
    scaled = trace_arrivals(path, ["m1", "m2", "m3"], duration=180.0, rps=0.5, seed=0)
    assert 80 <= len(scaled) <= 100  # 0.5 rps x 180 s


def test_the_functions_trace_is_the_papers_shape_and_covers_128_models():
    from sim.workload import DEFAULT_FUNCTIONS_CSV, read_function_trace

    rows = read_function_trace(DEFAULT_FUNCTIONS_CSV)
    assert len(rows) == 100 and sum(map(sum, rows)) == 9625
    active_per_minute = [sum(1 for r in rows if r[m]) for m in range(30)]
    assert min(active_per_minute) >= 28 and max(active_per_minute) <= 45
    models = [f"m{i:03d}" for i in range(128)]
    arr = trace_arrivals(DEFAULT_FUNCTIONS_CSV, models, 1800.0, None, seed=0)
    used = {m for _, m in arr}
    assert len(used) == 128  # 100 functions + 28 rotated replays, every model called
    assert len(arr) > 9625  # the replays add traffic; the 100 originals are all there
    # 32 models: a uniform subset of the functions, each minute's count kept.
    sub = trace_arrivals(DEFAULT_FUNCTIONS_CSV, models[:32], 1800.0, None, seed=0)
    assert len({m for _, m in sub}) == 32 and len(sub) < 9625


def test_arrivals_within_a_minute_are_poisson_not_bursts():
    import statistics

    from sim.workload import _spread

    rng = random.Random(1)
    gaps = []
    for minute in range(200):
        times = _spread(minute * 60.0, 60.0, 30, rng, cv=1.0)
        gaps += [b - a for a, b in zip(times, times[1:])]
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert 0.85 < cv < 1.15
