"""Lifeline's gateway beside the routers people deploy instead, on the same nodes and the same workload.

Issue 16's first figure. The same emulated nodes (a fast time scale, so the nodes are not the bottleneck), the same
open-loop streaming workload from one load generator in this process, through each path in turn:

- ``direct``: the load generator sends to the nodes itself, round-robin: the floor;
- ``lifeline``: Lifeline's gateway (``manage.py gateway``, on uvloop), the routing table in Redis as the control
  plane publishes it, the cluster's default placement policy (KV checkpoints streamed to holders: node work the
  other paths do not ask for); ``lifeline-none``: the same with placement policy ``none`` (routing and relay
  only, as the other routers do); ``lifeline-asyncio``: as ``lifeline``, on asyncio's own event loop;
  ``lifeline-x2``: as ``lifeline``, two gateway processes sharing one port (``--reuse-port``, one per core);
- ``vllm-router`` and ``sglang-router``: the Rust routers on PyPI (``vllm-router``, ``sglang-router``),
  round-robin;
- ``litellm``: LiteLLM's proxy (``litellm[proxy]``), the nodes as one model group.

Each peer is installed in a virtualenv of its own under ``~/.cache/lifeline/peers/<name>`` the first time (its pins
are not ours); a peer that cannot be installed or started is skipped with the reason in the results.

Per path and arrival rate: TTFT and inter-token latency (p50, p99) and what the path adds over ``direct`` at the
same rate; relayed tokens per second; the router's CPU time (its whole process tree, from /proc) per 1,000 relayed
tokens and relayed tokens per second per router CPU core; the highest rate at which the added TTFT p50 stayed
within twice its value at the lowest rate ("sustained before added latency doubles"). Everything runs on this
machine: the nodes, the load generator and the router share its cores, so the added latency includes the router's
competition for CPU with the nodes; the CPU figures are the router's own and do not.

    python -m benchmarks.gateway_peers [--nodes 2] [--rates 8,16,32] [--seconds 15] [--paths direct,lifeline,...]
"""

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.common import percentile, save
from benchmarks.harness import KEY, WORDS, Harness

PEERS_DIR = Path.home() / ".cache" / "lifeline" / "peers"
PATHS = (
    "direct",
    "lifeline",
    "lifeline-none",
    "lifeline-asyncio",
    "lifeline-x2",
    "vllm-router",
    "sglang-router",
    "litellm",
)
PACKAGES = {
    "vllm-router": "vllm-router",
    "sglang-router": "sglang-router",
    "litellm": "litellm[proxy]",
    "aiperf": "aiperf",  # NVIDIA's load client, run offline beside ours as a second opinion
}
AIPERF_TOKENIZER = "lifeline/emulated-tokenizer"  # the emulated models' word vocabulary, as a local HF cache entry
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- peers ---------------------------------------------------------------------------------------------------------
def peer_venv(name: str) -> Path:
    """The peer's own virtualenv, installed from PyPI the first time. Raises RuntimeError with pip's last words."""
    venv = PEERS_DIR / name
    done = venv / ".installed"
    if done.exists():
        return venv
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    print(f"installing {PACKAGES[name]} into {venv} (once)…", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", PACKAGES[name]],
        capture_output=True,
        text=True,
    )
    if pip.returncode != 0:
        raise RuntimeError(f"pip install {PACKAGES[name]} failed: {pip.stderr.strip().splitlines()[-1:]}")
    done.write_text(PACKAGES[name] + "\n")
    return venv


LITELLM_KEY = "sk-lifeline-benchmark"  # LiteLLM's proxy will not start without a master key


def peer_command(name: str, venv: Path, port: int, workers: list[str], model: str, scratch: Path) -> list[str]:
    from console.stack import free_port

    bin_ = venv / "bin"
    if name == "vllm-router":
        return [str(bin_ / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                "--log-level", "warning", "--prometheus-port", str(free_port()), "--worker-urls", *workers]  # fmt: skip
    if name == "sglang-router":
        return [str(bin_ / "sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port), "--policy",
                "round_robin", "--log-level", "warn", "--prometheus-port", str(free_port()),
                "--worker-urls", *workers]  # fmt: skip
    if name == "litellm":
        config = scratch / "litellm.yaml"
        deployments = [
            {"model_name": model, "litellm_params": {"model": f"openai/{model}", "api_base": f"{w}/v1", "api_key": "x"}}
            for w in workers
        ]
        config.write_text(
            json.dumps(
                {
                    "model_list": deployments,
                    "litellm_settings": {"drop_params": True},
                    "general_settings": {"master_key": LITELLM_KEY},
                }
            )
        )
        return [str(bin_ / "litellm"), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    raise ValueError(name)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and all its descendants, from /proc."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += times.get(current, 0.0)
        todo.extend(child for child, parent in parents.items() if parent == current)
    return total


# --- aiperf, the outside load client ------------------------------------------------------------------------------
def aiperf_home() -> Path:
    """An HF cache holding a tokenizer of the emulated models' vocabulary (workers.tokens), for aiperf to run offline
    (HF_HUB_OFFLINE=1): it counts prompt tokens with it; output tokens come from the server (--use-server-token-count).
    """
    from workers import tokens

    home = PEERS_DIR / "aiperf-hf"
    repo = home / "hub" / ("models--" + AIPERF_TOKENIZER.replace("/", "--"))
    snapshot = repo / "snapshots" / ("0" * 39 + "1")
    if (snapshot / "tokenizer.json").exists():
        return home
    venv = peer_venv("aiperf")
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(snapshot.name)
    script = (
        "import json, sys\n"
        "from tokenizers import Tokenizer, models, pre_tokenizers\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "words = json.loads(sys.argv[1])\n"
        "ids = {w: i for i, w in enumerate(['<unk>', '<eos>'] + words)}\n"
        "tok = Tokenizer(models.WordLevel(vocab=ids, unk_token='<unk>'))\n"
        "tok.pre_tokenizer = pre_tokenizers.Whitespace()\n"
        "fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token='<unk>', eos_token='<eos>')\n"
        "fast.save_pretrained(sys.argv[2])"
    )
    words = [w for w in tokens.VOCAB if w not in ("<unk>", "<eos>")]
    subprocess.run([str(venv / "bin" / "python"), "-c", script, json.dumps(words), str(snapshot)], check=True)
    return home


def run_aiperf(targets: list[str], headers: dict, rate: float, seconds: float, body: dict, scratch: Path) -> dict:
    """aiperf's own measurement of the same path at the same rate: TTFT and inter-token latency as it reports them
    (its ITL is each request's mean gap; the percentiles are over requests)."""
    venv = peer_venv("aiperf")
    out = scratch / f"aiperf-{time.monotonic_ns()}"
    argv = [str(venv / "bin" / "aiperf"), "profile", "--model", body["model"], "--tokenizer", AIPERF_TOKENIZER,
            "--endpoint-type", "chat", "--streaming", "--use-server-token-count", "--request-rate", str(rate),
            "--request-count", str(max(int(rate * seconds), 10)), "--synthetic-input-tokens-mean", "60",
            "--output-tokens-mean", str(body["max_tokens"]), "--artifact-dir", str(out),
            "--ui-type", "none"]  # fmt: skip
    for url in targets:
        argv += ["--url", url]
    if len(targets) > 1:
        argv += ["--url-strategy", "round_robin"]
    key = headers.get("Authorization", "").removeprefix("Bearer ")
    if key:
        argv += ["--api-key", key]
    env = {**os.environ, "HF_HOME": str(aiperf_home()), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds * 6 + 120)
    report_file = out / "profile_export_aiperf.json"
    if done.returncode != 0 or not report_file.exists():
        raise RuntimeError(f"aiperf failed ({done.returncode}): {(done.stdout + done.stderr)[-300:]}")
    data = json.loads(report_file.read_text())
    pick = lambda name: {q: _r(data[name][q]) for q in ("p50", "p99")}  # noqa: E731
    return {
        "rate": rate,
        "requests": data["request_count"]["avg"] if isinstance(data.get("request_count"), dict) else None,
        "ttft_ms": pick("time_to_first_token"),
        "itl_ms": pick("inter_token_latency"),
        "output_tokens_per_s": _r(data["output_token_throughput"]["avg"], 1),
        "errors": (data.get("error_summary") or []),
    }


# --- the load generator --------------------------------------------------------------------------------------------
@dataclass
class Stream:
    sent: float
    first: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


async def one_stream(session, url: str, body: dict, headers: dict) -> Stream:
    stream = Stream(time.perf_counter())
    last = None
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                stream.error = f"{response.status}: {(await response.text())[:200]}"
                return stream
            async for raw in response.content:
                if not raw.startswith(b"data: {") or b'"content":"' not in raw:
                    continue
                now = time.perf_counter()
                if last is None:
                    stream.first = now
                else:
                    stream.gaps.append(now - last)
                last = now
                stream.tokens += 1
    except (TimeoutError, aiohttp.ClientError) as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    return stream


async def open_loop(targets: list[str], headers: dict, rate: float, seconds: float, body: dict, seed: int) -> list:
    """Poisson arrivals at `rate` for `seconds`, each a streamed chat completion to the next target in turn."""
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks, start, at, index = [], time.perf_counter(), 0.0, 0
        while at < seconds:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 80)))
            request = {**body, "messages": [{"role": "user", "content": f"{index} {words}"}]}
            url = targets[index % len(targets)] + "/v1/chat/completions"
            tasks.append(asyncio.create_task(one_stream(session, url, request, headers)))
            index += 1
            at += rng.expovariate(rate)
        return await asyncio.gather(*tasks)


def summarise(streams: list[Stream], seconds: float) -> dict:
    ok = [s for s in streams if s.error is None and s.first is not None]
    ttft = [(s.first - s.sent) * 1000 for s in ok]
    itl = [g * 1000 for s in ok for g in s.gaps]
    tokens = sum(s.tokens for s in ok)
    return {
        "requests": len(streams),
        "errors": len(streams) - len(ok),
        "first_error": next((s.error for s in streams if s.error), None),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "ttft_ms": {"p50": _r(percentile(ttft, 0.5)), "p99": _r(percentile(ttft, 0.99))},
        "itl_ms": {"p50": _r(percentile(itl, 0.5)), "p99": _r(percentile(itl, 0.99))},
    }


def _r(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


# --- the run -------------------------------------------------------------------------------------------------------
async def wait_ready(url: str, headers: dict, model: str, seconds: float = 90.0) -> None:
    """Until one streamed request through `url` answers 200 with tokens (the router has found its workers)."""
    body = {"model": model, "messages": [{"role": "user", "content": "ready"}], "max_tokens": 4, "stream": True}
    deadline = time.monotonic() + seconds
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while time.monotonic() < deadline:
            stream = await one_stream(session, url + "/v1/chat/completions", body, headers)
            if stream.error is None and stream.tokens:
                return
            last = stream.error or "no tokens"
            await asyncio.sleep(0.5)
    raise RuntimeError(f"not ready after {seconds:.0f} s: {last}")


async def measure_path(path, targets, headers, pids, rates, seconds, body) -> dict:
    """Each rate in turn through `targets`; `pids`: the router's processes (their CPU is summed), none for direct."""
    rows = []
    for rate in rates:
        cpu_before = [tree_cpu_s(pid) for pid in pids]
        started = time.perf_counter()
        streams = await open_loop(targets, headers, rate, seconds, body, seed=int(rate * 1000))
        wall = time.perf_counter() - started
        row = {"rate": rate, "wall_s": round(wall, 2), **summarise(streams, wall)}
        if pids:
            each = [tree_cpu_s(pid) - before for pid, before in zip(pids, cpu_before)]
            cpu = sum(each)
            if len(pids) > 1:  # how evenly the kernel spread the connections over the processes sharing the port
                row["router_cpu_s_per_process"] = [round(c, 3) for c in each]
            row["router_cpu_s"] = round(cpu, 3)
            row["router_cores"] = round(cpu / wall, 3)
            row["cpu_ms_per_1000_tokens"] = _r(1e6 * cpu / row["tokens"]) if row["tokens"] else None
            row["tokens_per_s_per_core"] = round(row["tokens"] / cpu, 1) if cpu > 0 else None
        print(f"  {path:>14} {rate:6.1f} req/s: {json.dumps(row)}", flush=True)
        rows.append(row)
        await asyncio.sleep(1.0)  # the nodes drain
    return {"rates": rows}


def added(path_rows: list[dict], direct_rows: list[dict]) -> list[dict]:
    """What a path adds over direct at each rate: TTFT and ITL percentiles, path minus direct."""
    out = []
    for row, floor in zip(path_rows, direct_rows):
        entry = {"rate": row["rate"]}
        for metric in ("ttft_ms", "itl_ms"):
            for q in ("p50", "p99"):
                a, b = row[metric][q], floor[metric][q]
                entry[f"added_{metric[:-3]}_{q}_ms"] = _r(a - b) if a is not None and b is not None else None
        out.append(entry)
    return out


def sustained(added_rows: list[dict], path_rows: list[dict]) -> float | None:
    """The highest rate at which the added TTFT p50 stayed within twice its value at the lowest rate, with no
    errors (a floor of 1 ms, so that a path adding next to nothing is not held to doubling a rounding error)."""
    if not added_rows or added_rows[0]["added_ttft_p50_ms"] is None:
        return None
    limit = 2 * max(added_rows[0]["added_ttft_p50_ms"], 1.0)
    best = None
    for entry, row in zip(added_rows, path_rows):
        if row["errors"] or entry["added_ttft_p50_ms"] is None or entry["added_ttft_p50_ms"] > limit:
            break
        best = entry["rate"]
    return best


async def run(args) -> dict:
    rates = [float(r) for r in args.rates.split(",")]
    harness = Harness(args.nodes, model=args.model, policy=args.policy, time_scale=args.time_scale, restart="warm")
    scratch = Path(tempfile.mkdtemp(prefix="gateway-peers-"))
    body = {"model": args.model, "max_tokens": args.max_tokens, "stream": True}
    results: dict = {"paths": {}, "skipped": {}}
    await asyncio.to_thread(harness.start_nodes)
    workers = [node.address for node in harness.nodes.values()]
    try:
        for path in args.paths.split(","):
            print(f"{path}:", flush=True)
            proc, headers, targets, pids = None, {}, workers, []
            try:
                if path.startswith("lifeline"):
                    # lifeline-asyncio: the same gateway on asyncio's own event loop instead of uvloop
                    os.environ["LIFELINE_GATEWAY_LOOP"] = "asyncio" if path == "lifeline-asyncio" else "uvloop"
                    # lifeline-none: no KV checkpoints (placement policy none), the relay and routing alone
                    harness.config["placement_policy"] = "none" if path == "lifeline-none" else args.policy
                    harness.publish()
                    await harness.start_gateway(processes=2 if path == "lifeline-x2" else 1)
                    targets, headers, pids = (
                        [harness.gateway_url],
                        {"Authorization": f"Bearer {KEY}"},
                        harness.gateway_pids(),
                    )
                elif path != "direct":
                    venv = await asyncio.to_thread(peer_venv, path)
                    from console.stack import free_port

                    port = free_port()
                    log = open(scratch / f"{path}.log", "wb")
                    proc = subprocess.Popen(
                        peer_command(path, venv, port, workers, args.model, scratch),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    )
                    targets, pids = [f"http://127.0.0.1:{port}"], [proc.pid]
                    if path == "litellm":
                        headers = {"Authorization": f"Bearer {LITELLM_KEY}"}
                await wait_ready(targets[0], headers, args.model)
                results["paths"][path] = await measure_path(path, targets, headers, pids, rates, args.seconds, body)
                if args.aiperf_rate:
                    try:
                        seen = await asyncio.to_thread(
                            run_aiperf, targets, headers, args.aiperf_rate, args.seconds, body, scratch
                        )
                    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                        seen = {"skipped": str(exc)}
                    print(f"  {path:>14} aiperf: {json.dumps(seen)}", flush=True)
                    results["paths"][path]["aiperf"] = seen
            except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
                reason = str(exc)
                if proc is not None:
                    reason += f" (log: {(scratch / f'{path}.log').read_text(errors='replace')[-300:]!r})"
                print(f"  skipped: {reason}", flush=True)
                results["skipped"][path] = reason
            finally:
                if proc is not None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                if path.startswith("lifeline"):
                    harness.stop_gateway()
    finally:
        await harness.close()
    return report(results, rates, args)


def report(results: dict, rates: list[float], args) -> dict:
    paths = results["paths"]
    if "direct" not in paths:
        return results
    direct = paths["direct"]["rates"]
    for name, data in paths.items():
        if name == "direct":
            continue
        data["added"] = added(data["rates"], direct)
        data["sustained_rate"] = sustained(data["added"], data["rates"])
        per_core = [r["tokens_per_s_per_core"] for r in data["rates"] if r.get("tokens_per_s_per_core")]
        cpu = [r["cpu_ms_per_1000_tokens"] for r in data["rates"] if r.get("cpu_ms_per_1000_tokens")]
        data["tokens_per_s_per_core"] = max(per_core) if per_core else None
        data["cpu_ms_per_1000_tokens"] = min(cpu) if cpu else None
    ours = paths.get("lifeline")
    ratios = {}
    if ours:
        for name, data in paths.items():
            if name.startswith("lifeline") or name == "direct":
                continue
            ratios[name] = _ratios(ours, data)
    results["ratios_lifeline_over_peer"] = ratios
    results["setup"] = {
        "nodes": args.nodes,
        "model": args.model,
        "time_scale": args.time_scale,
        "max_tokens": args.max_tokens,
        "seconds_per_rate": args.seconds,
        "rates": rates,
        "placement_policy": args.policy,
        "cpus": os.cpu_count(),
    }
    results["note"] = (
        "measured on one machine: the nodes, the load generator and the router share its cores; added latency is "
        "the path's percentile minus direct's at the same rate; CPU is the router's whole process tree from /proc"
    )
    _print_table(paths, ratios)
    return results


def _ratios(ours: dict, peer: dict) -> dict:
    """Lifeline over the peer at each common rate (below 1 is better for latency and CPU, above 1 for tokens/core)."""

    def div(a, b):
        return round(a / b, 2) if a is not None and b not in (None, 0) else None

    by_rate = []
    for a, b in zip(ours["added"], peer["added"]):
        by_rate.append(
            {
                "rate": a["rate"],
                **{k: div(a[k], b[k]) for k in a if k.startswith("added_") and b.get(k) is not None and b[k] > 0},
            }
        )
    return {
        "by_rate": by_rate,
        "tokens_per_s_per_core": div(ours["tokens_per_s_per_core"], peer["tokens_per_s_per_core"]),
        "cpu_ms_per_1000_tokens": div(ours["cpu_ms_per_1000_tokens"], peer["cpu_ms_per_1000_tokens"]),
    }


def _print_table(paths: dict, ratios: dict) -> None:
    print(
        "\npath            rate  TTFT p50/p99 ms   +TTFT p50/p99   ITL p50/p99 ms   +ITL p50/p99   "
        "tok/s/core  CPU ms/1k tok"
    )
    for name, data in paths.items():
        adds = data.get("added") or [{}] * len(data["rates"])
        for row, add in zip(data["rates"], adds):
            print(
                f"{name:<14} {row['rate']:5.1f}  {row['ttft_ms']['p50']!s:>7}/{row['ttft_ms']['p99']!s:<7}"
                f"  {add.get('added_ttft_p50_ms', '-')!s:>6}/{add.get('added_ttft_p99_ms', '-')!s:<7}"
                f"  {row['itl_ms']['p50']!s:>6}/{row['itl_ms']['p99']!s:<7}"
                f"  {add.get('added_itl_p50_ms', '-')!s:>6}/{add.get('added_itl_p99_ms', '-')!s:<7}"
                f"  {row.get('tokens_per_s_per_core', '-')!s:>9}  {row.get('cpu_ms_per_1000_tokens', '-')!s:>8}"
            )
    for name, ratio in ratios.items():
        print(f"lifeline / {name}: {json.dumps(ratio)}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--model", default="Qwen3-32B")
    parser.add_argument("--time-scale", type=float, default=0.05, help="emulated GPU time × this: fast nodes")
    parser.add_argument("--rates", default="4,8,16", help="arrival rates (requests per second), comma-separated")
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds of arrivals per rate")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--policy", default="lifeline", help="Lifeline's placement policy (lifeline, none, …)")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--out", default="gateway_peers", help="results file name under benchmarks/results/")
    parser.add_argument(
        "--aiperf-rate", type=float, default=16.0, help="each path measured by aiperf too, at this rate; 0: not"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    save(args.out, asyncio.run(run(args)))


if __name__ == "__main__":
    main()
