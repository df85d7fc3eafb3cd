"""A node holds a gateway's request whose stream broke (issue 16): it goes on generating, and a gateway with the
agent token takes the stream over from the token its client has (`lifeline.attach`), with the ids of the tokens
before it; a plain client's request is aborted when it goes away, and a held one when nobody came in time."""

import asyncio
import json

import aiohttp

from tests.helpers import http_json, wait_for

AGENT = "agent-token-for-parking"
BODY = {
    "model": "Qwen3-32B",
    "prompt": "the operator drains node seven " * 8,
    "max_tokens": 300,
    "temperature": 0,
    "stream": True,
}


async def read_stream(response, limit=None) -> tuple[list[int], list[dict]]:
    ids, other = [], []
    async for line in response.content:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices"):
            ids.extend(chunk["choices"][0].get("token_ids") or [])
        else:
            other.append(chunk)
        if limit is not None and len(ids) >= limit:
            break
    return ids, other


def running(node) -> int:
    return http_json(node.address + "/agent/status")[1]["load"]["running"]


async def test_a_held_stream_is_taken_over_from_the_clients_token_with_the_ids_before_it(node_factory):
    node = node_factory("park-a", "--time-scale", "0.3", "--park-grace", "2", env={"LIFELINE_AGENT_TOKEN": AGENT})
    url = node.address + "/v1/completions"
    agent = {"Authorization": f"Bearer {AGENT}"}
    async with aiohttp.ClientSession() as session:
        lifeline = {"request_id": "park-ref", "return_token_ids": True}
        async with session.post(url, json={**BODY, "lifeline": lifeline}) as response:
            reference, _ = await read_stream(response)
        assert len(reference) > 12

        lifeline = {"request_id": "park-1", "return_token_ids": True}
        async with session.post(url, json={**BODY, "lifeline": lifeline}) as response:
            first, _ = await read_stream(response, limit=7)  # then the "gateway" goes away
        await asyncio.sleep(0.3)
        assert running(node) == 1  # held, not aborted

        attach = {"request_id": "park-1", "return_token_ids": True, "attach": 7}
        async with session.post(url, json={**BODY, "lifeline": attach}) as response:
            assert response.status == 401  # a gateway's, with the agent token only
        async with session.post(url, json={**BODY, "lifeline": attach}, headers=agent) as response:
            assert response.status == 200
            rest, other = await read_stream(response)
        assert other[0]["lifeline"]["attached"]["generated_token_ids"] == reference[:7]
        assert first[:7] + rest == reference

        # Taken over, it is not held twice; a plain client's request is aborted when it goes away.
        async with session.post(url, json={**BODY, "lifeline": attach}, headers=agent) as response:
            assert response.status == 404 and "not held" in (await response.json())["error"]["message"]
        async with session.post(url, json=BODY) as response:
            await read_stream(response, limit=3)
        await asyncio.to_thread(wait_for, lambda: running(node) == 0, 5, 0.05, "the plain request aborted")

        # Held, and nobody came: aborted when the hold ends.
        lifeline = {"request_id": "park-2", "return_token_ids": True}
        async with session.post(url, json={**BODY, "max_tokens": 2000, "lifeline": lifeline}) as response:
            await read_stream(response, limit=3)
        await asyncio.sleep(0.5)
        assert running(node) == 1
        await asyncio.to_thread(wait_for, lambda: running(node) == 0, 5, 0.05, "the held request aborted")
        attach = {"request_id": "park-2", "return_token_ids": True, "attach": 3}
        async with session.post(url, json={**BODY, "lifeline": attach}, headers=agent) as response:
            assert response.status == 404


async def test_a_takeover_claiming_more_tokens_than_were_written_is_refused(node_factory):
    node = node_factory("park-b", "--time-scale", "0.3", env={"LIFELINE_AGENT_TOKEN": AGENT})
    url = node.address + "/v1/completions"
    async with aiohttp.ClientSession() as session:
        lifeline = {"request_id": "park-3", "return_token_ids": True}
        async with session.post(url, json={**BODY, "max_tokens": 2000, "lifeline": lifeline}) as response:
            await read_stream(response, limit=4)
        attach = {"request_id": "park-3", "return_token_ids": True, "attach": 100000}
        async with session.post(
            url, json={**BODY, "lifeline": attach}, headers={"Authorization": f"Bearer {AGENT}"}
        ) as response:
            answer = await response.json()
        assert response.status == 409 and "more output tokens than this node has written" in answer["error"]["message"]
