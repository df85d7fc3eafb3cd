"""Requests for the simulator: when each arrives, for which model, and how long its prompt and output are.

Arrivals
--------
- ``poisson`` at ``rate_rps``: exponential gaps of mean 1/rate (coefficient of variation 1).
- ``gamma`` at ``rate_rps`` with coefficient of variation ``cv``: gaps ~ Gamma(shape k = 1/cv², scale
  1/(rate·k)), so the mean gap is still 1/rate and its standard deviation cv/rate. cv > 1 is burstier than
  Poisson (clumps of requests, then lulls), cv < 1 more regular, cv = 1 is Poisson again. For scale: over the
  hour of the Azure 2023 sample below, gaps between conversation requests have a CV of about 1.1, between code
  requests about 13.

Lengths
-------
Generated, never downloaded: each named distribution is a pair of log-normals (prompt, output) fitted to a
published median and 90th percentile (recovery.sim.distributions shows the fit), drawn independently of each
other, rounded to whole tokens of at least one, and clipped to the serving model's context.

======================== ======================== ====================== ==================================
name                     prompt median / p90      output median / p90    source
======================== ======================== ====================== ==================================
splitwise-conversation   1020 / 2735 tokens       129 / 424 tokens       Azure LLM inference trace 2023 [1]
splitwise-code           1469 / 5194 tokens       13 / 55 tokens         Azure LLM inference trace 2023 [1]
sharegpt                 35 / 507 tokens          271 / 754 tokens       vLLM paper's ShareGPT set [2]
======================== ======================== ====================== ==================================

[1] The sample of Azure's production LLM traffic (one hour of November 2023; 19,366 conversation and 8,819 code
    requests) that the Splitwise paper characterises: Patel et al., "Splitwise: Efficient generative LLM
    inference using phase splitting", ISCA 2024; published as AzurePublicDataset
    ``data/AzureLLMInferenceTrace_{conv,code}.csv`` (CC-BY). The paper gives the medians as 1020 and 129
    tokens (conversation) and about 1500 and 13 (code); the 90th percentiles are read from the same published
    sample. The log-normal means come out at 1372 / 199 (conversation) and 2387 / 25 (code) against the
    sample's 1155 / 211 and 2048 / 28: the sample's code prompts stop at 7,437 tokens, where the log-normal's
    tail goes on, and its conversation outputs cluster near 400, which no log-normal reproduces exactly.
[2] ShareGPT as the vLLM paper used it (Kwon et al., "Efficient Memory Management for Large Language Model
    Serving with PagedAttention", SOSP 2023): the first turn of each conversation, OPT tokenizer, pairs whose
    prompt and output fit OPT's 2,048 tokens. Its artifact publishes the length pairs
    (sosp-ae-astra ``datasets/sharegpt_opt_text_completion_length.pkl``); those 79,731 pairs reproduce the
    paper's published means of 161.31 input and 337.99 output tokens, and their medians and 90th percentiles
    are the figures above. The fit's means: 308 / 373 tokens, 190 / 368 once clipped to 2,048 as the paper's
    were. (vLLM's benchmark script samples another ShareGPT dump, ShareGPT_V3_unfiltered_cleaned_split.json,
    with the served model's tokenizer and like filters: its lengths differ somewhat.)

Replay
------
A CSV trace in splitwise-sim's format (its ``generate_trace.py`` writes ``request_id, request_type,
application_id, arrival_timestamp, batch_size, prompt_size, token_size``): a header is required and must name
``arrival_timestamp`` (seconds from the trace's start), ``prompt_size`` and ``token_size`` (tokens); other
columns are ignored. Every row is checked and the first bad one refused with its row and column: sizes are whole
numbers of at least 1 (a request has a prompt token to prefill and produces a token); timestamps are finite
numbers ≥ 0 in non-decreasing order. An out-of-order file is refused rather than sorted: a trace replays
exactly what it says or not at all, and disorder usually means two files were concatenated.

Tiers
-----
Every request has a tenant tier (premium, standard or best_effort, recovery.policy.slo_rules.TIERS), which the
degradation levels shed by (recovery.policy.capacity.EFFECTS: best_effort is answered 429 from level 2). A
workload's ``tiers`` gives the mix as weights; the default, ``DEFAULT_TIER_MIX``, is a third each, as the demo's
traffic generator sends them (workers/traffic.py picks one of the demo's three keys, one per tier, at random).
A replayed trace gets its tiers from the same mix: splitwise-sim's format has no tier column.

Determinism: a workload draws from ``random.Random`` instances seeded by strings derived from the run's seed
(a string seed is hashed with SHA-512, the same in every process), one for arrivals, one for lengths and one for
tiers, so the i-th request's lengths do not depend on the arrival process or its rate, and a different tier mix
changes which requests are best-effort, never when they arrive or how long they are.
"""

import csv
import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from recovery.policy.slo_rules import TIERS
from recovery.sim.distributions import LogNormal
from recovery.sim.errors import ScenarioError

ARRIVALS = ("poisson", "gamma")
DEFAULT_TIER_MIX: tuple[tuple[str, float], ...] = tuple((tier, 1.0) for tier in TIERS)
MAX_RATE_RPS = 1e5
MAX_CV = 20.0


@dataclass(frozen=True, slots=True)
class Request:
    """One request; its id is its place in the list a workload returns. (Slots: a long run holds millions.)"""

    arrival_s: float  # seconds from the run's start
    model: str
    prompt_tokens: int
    output_tokens: int
    tier: str = "standard"  # the tenant's tier: what a degradation level sheds by


# --- tiers -------------------------------------------------------------------------------------
def tier_mix(raw: object, where: str = "tiers") -> tuple[tuple[str, float], ...]:
    """A tier mix from JSON ({"premium": 1, "standard": 3, "best_effort": 1}), checked: known tiers, weights ≥ 0,
    not all 0. A tier left out gets none of the requests."""
    if not isinstance(raw, dict):
        raise ScenarioError(where, f"is a {type(raw).__name__}", 'a JSON object of weights, e.g. {"standard": 1}')
    mix = []
    for tier, weight in raw.items():
        if tier not in TIERS:
            raise ScenarioError(f"{where}.{tier}", "is not a tier", ", ".join(TIERS))
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight < math.inf:
            raise ScenarioError(f"{where}.{tier}", f"{weight!r}", "a weight ≥ 0")
        mix.append((tier, float(weight)))
    if not sum(w for _, w in mix) > 0:
        raise ScenarioError(where, "gives every tier a weight of 0", "at least one weight above 0")
    return tuple(mix)


def tier_stream(mix: tuple[tuple[str, float], ...], seed: int | str) -> Iterator[str]:
    """Tiers drawn from `mix`, from their own random stream, one at a time (`random.choices` draws one number per
    tier, so these are the tiers it would draw for any count at once)."""
    rng = random.Random(f"{seed}:tiers")
    tiers, weights = [t for t, _ in mix], [w for _, w in mix]
    while True:
        yield rng.choices(tiers, weights)[0]


# --- arrivals ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arrivals:
    process: str  # one of ARRIVALS
    rate_rps: float
    cv: float = 1.0  # coefficient of variation of the gaps; gamma only

    def __post_init__(self) -> None:
        if self.process not in ARRIVALS:
            raise ScenarioError("arrival", f"{self.process!r} is not an arrival process", " or ".join(ARRIVALS))
        if not _in_range(self.rate_rps, MAX_RATE_RPS):
            raise ScenarioError(
                "rate_rps", f"{self.rate_rps!r} requests/s", f"a number above 0, at most {MAX_RATE_RPS:g}"
            )
        if not _in_range(self.cv, MAX_CV):
            raise ScenarioError("cv", f"{self.cv!r}", f"a number above 0, at most {MAX_CV:g} (1 is Poisson)")
        if self.process == "poisson" and self.cv != 1:
            raise ScenarioError("cv", f"{self.cv!r} with Poisson arrivals, whose CV is 1", '1, or arrival "gamma"')

    def gap(self, rng: random.Random) -> float:
        """The time from one arrival to the next."""
        if self.process == "poisson":
            return rng.expovariate(self.rate_rps)
        shape = 1 / self.cv**2
        return rng.gammavariate(shape, 1 / (self.rate_rps * shape))

    def times(self, rng: random.Random, duration_s: float) -> list[float]:
        """Arrival times in [0, duration_s), the first one gap after 0."""
        return list(self.stream(rng, duration_s))

    def stream(self, rng: random.Random, duration_s: float) -> Iterator[float]:
        """`times`, one at a time."""
        t = self.gap(rng)
        while t < duration_s:
            yield t
            t += self.gap(rng)


def _in_range(value: object, maximum: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= maximum


# --- lengths -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LengthModel:
    name: str
    prompt: LogNormal
    output: LogNormal
    source: str

    def sample(self, rng: random.Random, context_tokens: int | None = None) -> tuple[int, int]:
        prompt = max(1, round(self.prompt.sample(rng)))
        output = max(1, round(self.output.sample(rng)))
        return clip_to_context(prompt, output, context_tokens)


LENGTHS: dict[str, LengthModel] = {
    m.name: m
    for m in (
        LengthModel(
            "splitwise-conversation",
            LogNormal.from_median_p90(1020, 2735),
            LogNormal.from_median_p90(129, 424),
            "Azure LLM inference trace 2023 (Splitwise, ISCA 2024), conversation",
        ),
        LengthModel(
            "splitwise-code",
            LogNormal.from_median_p90(1469, 5194),
            LogNormal.from_median_p90(13, 55),
            "Azure LLM inference trace 2023 (Splitwise, ISCA 2024), code",
        ),
        LengthModel(
            "sharegpt",
            LogNormal.from_median_p90(35, 507),
            LogNormal.from_median_p90(271, 754),
            "ShareGPT as in the vLLM paper (SOSP 2023), first turns within 2,048 tokens",
        ),
    )
}


def clip_to_context(prompt: int, output: int, context_tokens: int | None) -> tuple[int, int]:
    """Prompt and output cut to fit the context: the prompt leaves room for at least one output token, the output
    gets what is left."""
    if context_tokens is None:
        return prompt, output
    prompt = min(prompt, context_tokens - 1)
    return prompt, min(output, context_tokens - prompt)


# --- synthetic workloads -----------------------------------------------------------------------
@dataclass(frozen=True)
class SyntheticWorkload:
    model: str
    arrivals: Arrivals
    lengths: str = "splitwise-conversation"
    tiers: tuple[tuple[str, float], ...] = DEFAULT_TIER_MIX

    def __post_init__(self) -> None:
        if self.lengths not in LENGTHS:
            raise ScenarioError("lengths", f"{self.lengths!r} is not a length distribution", ", ".join(LENGTHS))

    def requests(self, duration_s: float, seed: int | str, context_tokens: int | None = None) -> list[Request]:
        return list(self.stream(duration_s, seed, context_tokens))

    def stream(self, duration_s: float, seed: int | str, context_tokens: int | None = None) -> Iterator[Request]:
        """The requests one at a time, in arrival order, as they are drawn: a long run need not hold them all. The
        arrivals, the lengths and the tiers each have their own random stream, so drawing a request's three
        together gives the same requests as drawing every arrival first."""
        lengths_rng = random.Random(f"{seed}:lengths")
        length_model = LENGTHS[self.lengths]
        tiers = tier_stream(self.tiers, seed)
        for t in self.arrivals.stream(random.Random(f"{seed}:arrivals"), duration_s):
            prompt, output = length_model.sample(lengths_rng, context_tokens)
            yield Request(t, self.model, prompt, output, next(tiers))


# --- replayed traces ---------------------------------------------------------------------------
TRACE_COLUMNS = ("arrival_timestamp", "prompt_size", "token_size")
TOO_LONG = ("refuse", "clip")


@dataclass(frozen=True)
class TraceRow:
    row: int  # as a spreadsheet numbers it: the header is row 1
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def read_trace(path: str | Path, field: str = "trace") -> tuple[TraceRow, ...]:
    """The rows of a CSV trace file, every one checked; `field` names the trace in errors."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a spreadsheet's byte-order mark
            return parse_trace(f, field, str(path))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ScenarioError(field, f"cannot be read: {reason}", "a readable CSV file", source=str(path)) from None
    except UnicodeDecodeError as exc:
        raise ScenarioError(field, f"is not text: {exc.reason}", "a UTF-8 CSV file", source=str(path)) from None


def parse_trace(lines: Iterable[str], field: str = "trace", source: str | None = None) -> tuple[TraceRow, ...]:
    """Parse CSV lines in splitwise-sim's format; refuse the first bad row, naming its row and column.

    `field` names the trace in errors, `source` its file."""

    def refuse(problem: str, allowed: str, row: int, column: str | None = None) -> ScenarioError:
        return ScenarioError(field, problem, allowed, source=source, row=row, column=column)

    reader = csv.reader(lines, strict=True)
    header = _next_row(reader, refuse)
    header_allowed = f"a header row naming {', '.join(TRACE_COLUMNS)} (splitwise-sim's format; other columns ignored)"
    if not header or not any(name.strip() for name in header):
        raise refuse("has no header", header_allowed, 1)
    names = [name.strip() for name in header]
    for name in names:
        if names.count(name) > 1:
            raise refuse("appears twice in the header", "each column once", 1, name)
    for name in TRACE_COLUMNS:
        if name not in names:
            raise refuse(f"is missing from the header {', '.join(names)}", header_allowed, 1, name)
    at = {name: names.index(name) for name in TRACE_COLUMNS}

    rows: list[TraceRow] = []
    previous = 0.0
    while (values := _next_row(reader, refuse)) is not None:
        row = reader.line_num
        if not any(v.strip() for v in values):
            continue  # a blank line
        if len(values) != len(names):
            problem = f"has {len(values)} values where the header has {len(names)} columns"
            raise refuse(problem, "one value per header column", row)
        arrival = _timestamp(values[at["arrival_timestamp"]].strip())
        if isinstance(arrival, str):
            raise refuse(arrival, "seconds from the trace's start: a finite number ≥ 0 (not a date)", row, TIME)
        if arrival < previous:
            problem = f"{arrival:g} s comes before the previous row's {previous:g} s"
            raise refuse(problem, "timestamps in non-decreasing order (sort the file by arrival_timestamp)", row, TIME)
        previous = arrival
        sizes = []
        for column, why in (("prompt_size", "prompt token to prefill"), ("token_size", "token to produce")):
            tokens = _tokens(values[at[column]].strip())
            if isinstance(tokens, str):
                raise refuse(tokens, f"a whole number of tokens, at least 1 (a request has a {why})", row, column)
            sizes.append(tokens)
        rows.append(TraceRow(row, arrival, sizes[0], sizes[1]))
    if not rows:
        raise refuse("has no requests, only a header", "at least one request row", 2)
    return tuple(rows)


TIME = "arrival_timestamp"


def _next_row(reader: Iterator[list[str]], refuse: Callable[..., ScenarioError]) -> list[str] | None:
    try:
        return next(reader, None)
    except csv.Error as exc:
        raise refuse(f"is not CSV: {exc}", "comma-separated values", max(getattr(reader, "line_num", 1), 1)) from None


def _timestamp(text: str) -> float | str:
    """Seconds, or what is wrong with them."""
    try:
        value = float(text)
    except ValueError:
        return f"{text!r} is not a number"
    if "_" in text:
        return f"{text!r} is not a number"
    if not math.isfinite(value) or value < 0:
        return f"{text!r} is not a time in the trace"
    return value


def _tokens(text: str) -> int | str:
    """A token count, or what is wrong with it."""
    if not text.isascii() or not text.isdigit():
        return f"{text!r} is not a whole number"
    if int(text) < 1:
        return f"{int(text)} tokens"
    return int(text)


@dataclass(frozen=True)
class TraceWorkload:
    """A replayed trace: its rows that arrive within the run, as they are (or clipped, when asked)."""

    model: str
    path: str
    rows: tuple[TraceRow, ...]
    too_long: str = "refuse"  # a row longer than the model's context: refuse the scenario, or clip the row
    tiers: tuple[tuple[str, float], ...] = DEFAULT_TIER_MIX

    def __post_init__(self) -> None:
        if self.too_long not in TOO_LONG:
            raise ScenarioError("too_long", f"{self.too_long!r}", " or ".join(TOO_LONG))

    def check(self, duration_s: float, context_tokens: int, field: str = "trace") -> None:
        """Refuse a trace that cannot run: nothing arrives within the run, or (unless clipped) a row that does
        is longer than the model's context."""
        if self.rows[0].arrival_s >= duration_s:
            raise ScenarioError(
                field,
                f"its first request arrives at {self.rows[0].arrival_s:g} s, after the run's {duration_s:g} s",
                "arrival_timestamp in seconds from the trace's start, some within the run's duration",
                source=self.path,
                row=self.rows[0].row,
                column=TIME,
            )
        if self.too_long == "clip":
            return
        for r in self.rows:
            if r.arrival_s >= duration_s:
                break
            if r.prompt_tokens + r.output_tokens > context_tokens:
                raise ScenarioError(
                    field,
                    f"{r.prompt_tokens} + {r.output_tokens} tokens do not fit {self.model}'s context of "
                    f"{context_tokens} tokens on this fleet",
                    f'prompt_size + token_size ≤ {context_tokens}, or the workload\'s too_long: "clip"',
                    source=self.path,
                    row=r.row,
                    column="prompt_size",
                )

    def requests(self, duration_s: float, seed: int | str = 0, context_tokens: int | None = None) -> list[Request]:
        """The rows that arrive before `duration_s`, as they are; the seed draws only their tiers."""
        return list(self.stream(duration_s, seed, context_tokens))

    def stream(self, duration_s: float, seed: int | str = 0, context_tokens: int | None = None) -> Iterator[Request]:
        """`requests`, one at a time."""
        tiers = tier_stream(self.tiers, seed)
        for r in self.rows:
            if r.arrival_s >= duration_s:
                break  # in arrival order (parse_trace refuses any other): the first late row ends them
            prompt, output = r.prompt_tokens, r.output_tokens
            if self.too_long == "clip":
                prompt, output = clip_to_context(prompt, output, context_tokens)
            yield Request(r.arrival_s, self.model, prompt, output, next(tiers))


Workload = SyntheticWorkload | TraceWorkload
