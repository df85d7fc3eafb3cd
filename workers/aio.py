"""Small asyncio helpers shared by the node side and the gateway."""

import asyncio
import contextlib


async def cancel(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has stopped."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
