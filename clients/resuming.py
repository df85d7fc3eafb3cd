"""A streaming client that survives the death of the gateway it talks to.

Lifeline's gateway gives every token's server-sent event an id, ``<request id>.<tokens so far>``. When the stream
breaks (its gateway was killed, a load balancer dropped the connection), this client sends the same request again,
to the next gateway in its list or through the same load balancer, with the standard ``Last-Event-ID`` header; any
gateway takes the stream over from the node that holds the request and sends the rest, from the next token: nothing
is lost or repeated. A plain OpenAI client sees the stream end with an error instead, and can only send the request
again from the start.

    async with aiohttp.ClientSession() as session:
        async for chunk in stream(session, ["http://gw-a:8100", "http://gw-b:8100"], key, body):
            print(chunk["choices"][0]["delta"].get("content", ""), end="")

Only aiohttp is needed. ``chunks`` are the OpenAI chunk objects as the gateway sends them.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Sequence

import aiohttp

RETRYABLE = (502, 503, 504)  # a gateway or balancer in trouble: try again, elsewhere


class StreamFailed(Exception):
    """The stream could not be finished: the gateway refused or ended it with an error that a resume cannot mend."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class Resumes:
    """What happened to one stream: how many times it was taken up again, and from which event."""

    def __init__(self) -> None:
        self.count = 0
        self.from_ids: list[str] = []
        self.restarts = 0  # sent again from the start: it broke before its first token


async def stream(
    session: aiohttp.ClientSession,
    gateways: Sequence[str],
    api_key: str,
    body: dict,
    *,
    path: str = "/v1/chat/completions",
    attempts: int = 8,
    backoff_s: float = 0.2,
    resumes: Resumes | None = None,
) -> AsyncIterator[dict]:
    """Yield the request's chunks, resuming on another gateway (round-robin over `gateways`) when one breaks."""
    last_id: str | None = None
    failures = 0
    turn = 0
    why, last_status = "", None  # the last failure's cause, said when the client gives up
    while True:
        url = gateways[turn % len(gateways)].rstrip("/") + path
        headers = {"Authorization": f"Bearer {api_key}"}
        if last_id is not None:
            headers["Last-Event-ID"] = last_id
            if resumes is not None:
                resumes.count += 1
                resumes.from_ids.append(last_id)
        elif failures and resumes is not None:
            resumes.restarts += 1
        try:
            async with session.post(url, json={**body, "stream": True}, headers=headers) as response:
                if response.status == 503 and "Retry-After" in response.headers and last_id is None:
                    # The gateway's own answer to a new request (the model sheds: its degradation level takes no
                    # new ones), not a gateway in trouble: said to the caller, who waits Retry-After seconds.
                    raise StreamFailed(f"503: {(await response.text())[:300]}", 503)
                if response.status in RETRYABLE:
                    raise aiohttp.ClientResponseError(
                        response.request_info, (), status=response.status, message=(await response.text())[:200]
                    )
                if response.status != 200:
                    raise StreamFailed(f"{response.status}: {(await response.text())[:300]}", response.status)
                event_id = None
                async for line in response.content:
                    if line.startswith(b"id: "):
                        event_id = line[4:].strip().decode()
                    elif line.startswith(b"data: "):
                        data = line[6:].strip()
                        if data == b"[DONE]":
                            return
                        chunk = json.loads(data)
                        if "error" in chunk:
                            raise StreamFailed(chunk["error"].get("message", "the stream ended with an error"))
                        yield chunk
                        if event_id is not None:
                            last_id, event_id = event_id, None
                            failures = 0  # progress: the attempts count failures in a row
            # The connection ended without [DONE]: the gateway went away mid-stream.
            why, last_status = "the stream ended without [DONE]", None
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            why, last_status = f"{exc.__class__.__name__}: {exc}", getattr(exc, "status", None)
        failures += 1
        if failures >= attempts:
            raise StreamFailed(f"gave up after {failures} attempts in a row (last at {url}: {why[:200]})", last_status)
        turn += 1
        await asyncio.sleep(backoff_s * min(failures, 5))
