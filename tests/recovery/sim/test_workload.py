"""The simulator's requests: arrivals, lengths from published statistics, and trace replay (recovery.sim.workload)."""

import io
import random
import statistics

import pytest

from recovery.sim.distributions import LogNormal
from recovery.sim.errors import ScenarioError
from recovery.sim.workload import (
    LENGTHS,
    Arrivals,
    SyntheticWorkload,
    TraceWorkload,
    clip_to_context,
    parse_trace,
    read_trace,
)

# (prompt median, prompt p90, output median, output p90) as published; see the module's docstring for the sources.
PUBLISHED = {
    "splitwise-conversation": (1020, 2735, 129, 424),
    "splitwise-code": (1469, 5194, 13, 55),
    "sharegpt": (35, 507, 271, 754),
}
DRAWS = 20_000


def quantile(values: list[float], p: float) -> float:
    return sorted(values)[int(p * len(values))]


# --- lengths -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_lengths_have_the_published_medians_and_90th_percentiles(name):
    prompt_median, prompt_p90, output_median, output_p90 = PUBLISHED[name]
    rng = random.Random(7)
    draws = [LENGTHS[name].sample(rng) for _ in range(DRAWS)]
    prompts, outputs = [p for p, _ in draws], [o for _, o in draws]
    # Sampling error of a median of 20,000 log-normal draws is under 2 % for these sigmas, of a p90 under 3 %.
    assert quantile(prompts, 0.5) == pytest.approx(prompt_median, rel=0.06)
    assert quantile(prompts, 0.9) == pytest.approx(prompt_p90, rel=0.08)
    assert quantile(outputs, 0.5) == pytest.approx(output_median, rel=0.08)  # rounding weighs on 13 tokens
    assert quantile(outputs, 0.9) == pytest.approx(output_p90, rel=0.08)
    assert min(prompts) >= 1 and min(outputs) >= 1


def test_the_lognormal_fit_puts_the_median_and_p90_where_they_were_given():
    fit = LogNormal.from_median_p90(129, 424)
    assert fit.median == pytest.approx(129)
    assert fit.quantile(0.9) == pytest.approx(424)
    assert fit.mean > fit.median  # a log-normal's tail pulls its mean above its median


def test_lengths_are_clipped_to_the_models_context():
    rng = random.Random(3)
    for _ in range(5_000):
        prompt, output = LENGTHS["splitwise-code"].sample(rng, context_tokens=4096)
        assert prompt >= 1 and output >= 1 and prompt + output <= 4096
    assert clip_to_context(9000, 200, 8192) == (8191, 1)  # a token of room for the output
    assert clip_to_context(8000, 500, 8192) == (8000, 192)
    assert clip_to_context(100, 50, None) == (100, 50)


# --- arrivals ----------------------------------------------------------------------------------
def gaps(arrivals: Arrivals, duration_s: float, seed: int = 1) -> list[float]:
    times = arrivals.times(random.Random(seed), duration_s)
    return [b - a for a, b in zip(times, times[1:])]


def test_poisson_arrivals_come_at_the_rate_with_a_cv_of_one():
    g = gaps(Arrivals("poisson", 50.0), 400.0)  # about 20,000 arrivals
    assert len(g) == pytest.approx(20_000, rel=0.05)
    assert statistics.mean(g) == pytest.approx(1 / 50, rel=0.03)
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_arrivals_keep_the_rate_and_take_the_cv(cv):
    g = gaps(Arrivals("gamma", 50.0, cv), 1000.0)  # about 50,000 arrivals
    assert statistics.mean(g) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(cv, rel=0.08)


def test_arrivals_fall_within_the_run():
    times = Arrivals("gamma", 5.0, 3.0).times(random.Random(2), 60.0)
    assert times == sorted(times) and 0 < times[0] and times[-1] < 60.0


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"process": "uniform", "rate_rps": 1.0}, "arrival"),
        ({"process": "poisson", "rate_rps": 0}, "rate_rps"),
        ({"process": "poisson", "rate_rps": True}, "rate_rps"),
        ({"process": "gamma", "rate_rps": 1.0, "cv": 0}, "cv"),
        ({"process": "poisson", "rate_rps": 1.0, "cv": 2.0}, "cv"),
    ],
)
def test_impossible_arrivals_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ScenarioError) as refused:
        Arrivals(**kwargs)
    assert refused.value.field == field
    assert "allowed:" in str(refused.value)


# --- determinism -------------------------------------------------------------------------------
def test_a_seed_gives_the_same_requests_and_another_seed_others():
    workload = SyntheticWorkload("Llama-3-8B", Arrivals("gamma", 10.0, 2.0), "sharegpt")
    first = workload.requests(300.0, seed=11, context_tokens=8192)
    assert first == workload.requests(300.0, seed=11, context_tokens=8192)
    assert first != workload.requests(300.0, seed=12, context_tokens=8192)


def test_the_ith_requests_lengths_do_not_depend_on_the_arrival_process():
    poisson = SyntheticWorkload("Llama-3-8B", Arrivals("poisson", 10.0)).requests(100.0, seed=5)
    bursty = SyntheticWorkload("Llama-3-8B", Arrivals("gamma", 20.0, 3.0)).requests(100.0, seed=5)
    n = min(len(poisson), len(bursty))
    assert [(r.prompt_tokens, r.output_tokens) for r in poisson[:n]] == [
        (r.prompt_tokens, r.output_tokens) for r in bursty[:n]
    ]


def test_the_global_random_is_left_alone():
    random.seed(99)
    expected = random.random()
    random.seed(99)
    SyntheticWorkload("Llama-3-8B", Arrivals("poisson", 10.0)).requests(60.0, seed=1)
    assert random.random() == expected


# --- trace replay ------------------------------------------------------------------------------
GOOD = """request_id,request_type,application_id,arrival_timestamp,batch_size,prompt_size,token_size
0,2,0,0.25,1,374,44
1,2,0,0.25,1,396,109

2,2,0,1.5,1,879,55
"""


def trace(text: str):
    return parse_trace(io.StringIO(text), "trace")


def test_a_splitwise_sim_trace_is_read_row_by_row():
    rows = trace(GOOD)
    assert [(r.row, r.arrival_s, r.prompt_tokens, r.output_tokens) for r in rows] == [
        (2, 0.25, 374, 44),
        (3, 0.25, 396, 109),
        (5, 1.5, 879, 55),  # row 4 is blank
    ]


def test_the_three_columns_suffice_and_spaces_around_values_are_ignored():
    rows = trace("arrival_timestamp, prompt_size, token_size\n0, 10, 2\n3.5e1, 20 ,1\n")
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in rows] == [(0.0, 10, 2), (35.0, 20, 1)]


def test_a_trace_file_is_read_from_disk(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("\ufeff" + GOOD, encoding="utf-8")  # a spreadsheet's byte-order mark
    assert len(read_trace(path)) == 3


HEADER = "arrival_timestamp,prompt_size,token_size\n"


@pytest.mark.parametrize(
    "text,row,column,says",
    [
        ("", 1, None, "has no header"),
        ("arrival_timestamp,prompt_size\n0,1\n", 1, "token_size", "missing from the header"),
        ("arrival_timestamp,prompt_size,token_size,prompt_size\n", 1, "prompt_size", "appears twice"),
        (HEADER, 2, None, "has no requests"),
        (HEADER + "0,10,5\n1,10\n", 3, None, "has 2 values where the header has 3 columns"),
        (HEADER + "0,10,5\nsoon,10,5\n", 3, "arrival_timestamp", "'soon' is not a number"),
        (HEADER + "2023-11-16 18:15:46,10,5\n", 2, "arrival_timestamp", "is not a number"),
        (HEADER + "-1,10,5\n", 2, "arrival_timestamp", "is not a time"),
        (HEADER + "inf,10,5\n", 2, "arrival_timestamp", "is not a time"),
        (HEADER + "nan,10,5\n", 2, "arrival_timestamp", "is not a time"),
        (HEADER + "5,10,5\n4.5,10,5\n", 3, "arrival_timestamp", "before the previous row's 5 s"),
        (HEADER + "0,-3,5\n", 2, "prompt_size", "'-3' is not a whole number"),
        (HEADER + "0,12.5,5\n", 2, "prompt_size", "'12.5' is not a whole number"),
        (HEADER + "0,1_000,5\n", 2, "prompt_size", "is not a whole number"),
        (HEADER + "0,0,5\n", 2, "prompt_size", "0 tokens"),
        (HEADER + "0,10,\n", 2, "token_size", "'' is not a whole number"),
        (HEADER + "0,10,0\n", 2, "token_size", "0 tokens"),
        (HEADER + '0,10,"5\n', 2, None, "is not CSV"),
    ],
)
def test_a_bad_row_is_refused_naming_its_row_and_column(text, row, column, says):
    with pytest.raises(ScenarioError) as refused:
        trace(text)
    error = refused.value
    assert (error.row, error.column) == (row, column)
    assert says in error.problem
    assert error.allowed
    assert str(error).startswith(f"trace row {row}" + (f", column {column}" if column else ""))


def test_a_missing_trace_file_is_refused(tmp_path):
    with pytest.raises(ScenarioError, match="cannot be read"):
        read_trace(tmp_path / "nowhere.csv", "workload[0].trace")


def test_a_replay_gives_the_rows_within_the_run_as_they_are():
    replay = TraceWorkload("Llama-3-8B", "trace.csv", trace(GOOD))
    assert [(r.arrival_s, r.prompt_tokens) for r in replay.requests(1.0)] == [(0.25, 374), (0.25, 396)]
    assert len(replay.requests(10.0)) == 3


def test_a_row_longer_than_the_context_is_refused_unless_clipping_is_asked_for():
    rows = trace(HEADER + "0,100,10\n1,9000,200\n")
    with pytest.raises(ScenarioError) as refused:
        TraceWorkload("Llama-3-8B", "t.csv", rows).check(10.0, 8192, "workload[0].trace")
    assert (refused.value.row, refused.value.column) == (3, "prompt_size")
    assert "too_long" in refused.value.allowed
    clipped = TraceWorkload("Llama-3-8B", "t.csv", rows, too_long="clip")
    clipped.check(10.0, 8192)
    assert [(r.prompt_tokens, r.output_tokens) for r in clipped.requests(10.0, context_tokens=8192)] == [
        (100, 10),
        (8191, 1),
    ]


def test_a_trace_that_starts_after_the_run_ends_is_refused():
    rows = trace(HEADER + "1700000000,10,5\n")  # epoch seconds, not seconds from the trace's start
    with pytest.raises(ScenarioError, match="after the run's 3600 s"):
        TraceWorkload("Llama-3-8B", "t.csv", rows).check(3600.0, 8192)
