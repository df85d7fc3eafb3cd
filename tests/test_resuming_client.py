"""The reference resuming client (clients/resuming.py) against a stand-in gateway that answers what it is told: what
it retries, what it gives up on, and what it says when it does."""

import aiohttp
import pytest
from aiohttp import web

from clients.resuming import Resumes, StreamFailed, stream


@pytest.fixture
async def gateway(unused_tcp_port_factory):
    """A server answering each POST with the next of `answers` (status, headers), counting the attempts."""
    state = {"answers": [], "attempts": 0}

    async def completions(request: web.Request) -> web.Response:
        state["attempts"] += 1
        status, headers = state["answers"][min(state["attempts"], len(state["answers"])) - 1]
        return web.json_response({"error": {"message": f"answer {state['attempts']}"}}, status=status, headers=headers)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = unused_tcp_port_factory()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    state["url"] = f"http://127.0.0.1:{port}"
    yield state
    await runner.cleanup()


async def read(state: dict, resumes: Resumes | None = None) -> list[dict]:
    async with aiohttp.ClientSession() as session:
        body = {"model": "m", "prompt": "p"}
        path = "/v1/completions"
        return [c async for c in stream(session, [state["url"]], "k", body, path=path, backoff_s=0.01, resumes=resumes)]


async def test_a_shed_new_request_is_said_at_once_not_retried_against_its_retry_after(gateway):
    gateway["answers"] = [(503, {"Retry-After": "5"})]
    with pytest.raises(StreamFailed) as failed:
        await read(gateway)
    assert failed.value.status == 503 and "answer 1" in str(failed.value)
    assert gateway["attempts"] == 1


async def test_a_gateway_in_trouble_is_retried_and_the_give_up_names_the_last_cause_and_status(gateway):
    gateway["answers"] = [(503, {}), (502, {})]  # a balancer with no gateway behind it: no Retry-After
    resumes = Resumes()
    with pytest.raises(StreamFailed) as failed:
        await read(gateway, resumes)
    assert gateway["attempts"] == 8 and resumes.restarts == 7
    assert failed.value.status == 502
    assert "gave up after 8 attempts in a row" in str(failed.value) and "502" in str(failed.value)
