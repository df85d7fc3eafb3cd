"""Real processes for the tests: serving nodes and whole Lifeline stacks."""

import asyncio
import json
import os
import shutil
import time
from contextlib import asynccontextmanager

from harness.processes import (  # noqa: F401 - the tests' helpers too
    BASE_DIR,
    DemoStack,
    NodeProcess,
    chat_stream,
    completion_stream,
    http_json,
    pid_alive,
    processes_mentioning,
    wait_for,
)

# Examples a property test draws by default, in the suite's `ci` profile and in the `full` one (tests/conftest.py).
EXAMPLES_CI, EXAMPLES_FULL = 25, 100


def examples(full: int) -> int:
    """The examples for a property test that draws `full` under the `full` profile: the same share of it as the
    loaded profile draws by default (a quarter in `ci`), never fewer than 10."""
    import hypothesis

    return max(10, round(full * hypothesis.settings.default.max_examples / EXAMPLES_FULL))


# --- the browser -------------------------------------------------------------------------
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def chromium_path() -> str:
    path = os.environ.get("LIFELINE_CHROMIUM") or shutil.which("chromium")
    if not path:
        raise RuntimeError(
            "Chromium is not installed: `./lifeline test` installs Debian's chromium when run as root, "
            "or set LIFELINE_CHROMIUM"
        )
    return path


def log_in(page, stack, role):
    login = next(item for item in stack.info["logins"] if item["role"] == role)
    page.goto(stack.info["urls"]["cluster"])
    page.fill("#id_username", login["username"])
    page.fill("#id_password", login["password"])
    page.click("button[type=submit]")
    page.wait_for_selector("#live-status[data-state=live]", timeout=10_000)


def follow_stream(client, results: dict, key, model: str, prompt: str, max_tokens: int) -> None:
    """A greedy completion (ignore_eos) streamed through the gateway by an OpenAI client into results[key], as it
    comes: the node that took it, its request id, the text and token ids, and the SSE comments (OpenAI clients skip
    them; a live move is announced in one)."""
    with client.completions.with_streaming_response.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True}
    ) as response:
        text, ids, comments = [], [], []
        results[key] = {
            "node": response.headers["x-lifeline-node"],
            "request_id": response.headers["x-request-id"],
            "text": text,
            "ids": ids,
            "comments": comments,
        }
        for line in response.iter_lines():
            if line.startswith(":"):
                comments.append(line)
            elif line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    text.append(choice["text"])
                    ids.extend(choice.get("token_ids") or [])


async def sse_choices(address: str, path: str, body: dict, headers: dict | None = None) -> tuple[list[dict], dict]:
    """The choices of every chunk of a streamed answer, and its usage."""
    import aiohttp

    choices, usage = [], None
    async with aiohttp.ClientSession() as session:
        async with session.post(
            address + path,
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
            headers=headers or {},
        ) as response:
            assert response.status == 200, await response.text()
            async for raw in response.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    choices += chunk["choices"]
                    usage = chunk.get("usage") or usage
    return choices, usage


@asynccontextmanager
async def buffered_burst(body: bytes):
    """A response whose whole `body` (an event stream) already sits in the client's buffer, as when a node or an
    engine sends faster than it is relayed: served by a local aiohttp server in one write."""
    import aiohttp
    from aiohttp import web

    async def burst(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(body)
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", burst)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json={}) as response:
                deadline = time.monotonic() + 10
                while not response.content.is_eof() and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert response.content.is_eof(), "the burst did not arrive whole"
                yield response
    finally:
        await runner.cleanup()


async def longest_hold_of_the_loop(items) -> tuple[int, int]:
    """How many items of the async iterator `items` came one after another with no other task given a turn of the
    event loop in between (the longest such run), and how many items there were."""
    turns = 0

    async def other_work() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    task = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    longest = run = count = 0
    seen = turns
    try:
        async for _ in items:
            count += 1
            run = run + 1 if turns == seen else 1
            seen, longest = turns, max(longest, run)
    finally:
        task.cancel()
    return longest, count
