"""Restore of a 4k-token Qwen3-32B request from the local store versus re-prefill.

A request with a 4,096-token prompt is checkpointed on holder B while node A
serves it; A is killed with SIGKILL after 32 tokens; the request is resumed
on B (pages in B's host memory: bytes over PCIe) and, separately, on C
(no pages: prefill of prompt plus generated tokens). Reports the time to the
first resumed token in both cases, the model's figures, and the ratio.

    python -m benchmarks.restore [--repeats 3]
"""

import argparse
import asyncio
import json
import signal
import statistics
import time

import aiohttp

from benchmarks.common import HEAD, Node, save
from workers import catalog

PROMPT_WORDS = 4096 - 1  # with the word the template adds, 4,096 prompt tokens
GENERATED = 32


def body(request_id: str, **lifeline) -> dict:
    prompt = " ".join(f"w{i % 997}" for i in range(PROMPT_WORDS)) + " go"
    return {
        "model": "Qwen3-32B",
        "prompt": prompt,
        "max_tokens": GENERATED + 16,
        "temperature": 0,
        "stream": True,
        "lifeline": {"request_id": request_id, "return_token_ids": True, **lifeline},
    }


async def first_tokens(node: Node, payload: dict, until: int, then=None) -> tuple[list[int], float, dict]:
    """Stream until `until` tokens; return ids, seconds to the first token, and the first chunk's extension."""
    ids, started, first_at, extension = [], time.monotonic(), None, {}
    async with aiohttp.ClientSession() as session:
        async with session.post(node.address + "/v1/completions", json=payload, headers=HEAD) as response:
            async for raw in response.content:
                if not raw.startswith(b"data: {"):
                    continue
                chunk = json.loads(raw[6:])
                if chunk.get("choices") and chunk["choices"][0].get("token_ids"):
                    first_at = first_at or time.monotonic()
                    extension = extension or chunk.get("lifeline", {})
                    ids += chunk["choices"][0]["token_ids"]
                    if len(ids) >= until:
                        if then is not None:
                            await then()
                        break
    return ids, first_at - started, extension


async def one(repeat: int) -> dict:
    a = Node(f"rs-a{repeat}", "--model", "Qwen3-32B", "--gpu", "H100-SXM", "--tp", "1")
    b = Node(f"rs-b{repeat}", "--model", "Qwen3-32B", "--gpu", "H100-SXM", "--tp", "1")
    c = Node(f"rs-c{repeat}", "--model", "Qwen3-32B", "--gpu", "H100-SXM", "--tp", "1")
    request_id = f"restore-{repeat}"
    try:

        async def kill_after_pages():
            for _ in range(200):
                held = b.status()["checkpoints"]["bytes_held"]
                if held >= (4096 + 16) // 16 * catalog.model("Qwen3-32B").kv_bytes_per_block:
                    break
                await asyncio.sleep(0.02)
            a.stop(signal.SIGKILL)

        generated, _, _ = await first_tokens(a, body(request_id, holders=[b.peer()]), GENERATED, kill_after_pages)
        resume = {"generated_token_ids": generated[:GENERATED]}
        _, local_s, local = await first_tokens(b, body(request_id, resume=resume), 1)
        _, prefill_s, prefill = await first_tokens(c, body(request_id, resume=resume), 1)
    finally:
        for node in (a, b, c):
            node.stop()
    return {
        "local_restore_ttft_s": local_s,
        "reprefill_ttft_s": prefill_s,
        "local": local.get("resume"),
        "reprefill": prefill.get("resume"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = [asyncio.run(one(i)) for i in range(args.repeats)]
    deployment = catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1)
    context = 4096 + GENERATED
    restored = runs[0]["local"]["restored_tokens"]
    model_restore = catalog.kv_transfer_s(restored * deployment.model.kv_bytes_per_token, catalog.HOST_TO_GPU_LINK)
    # Re-prefill in 2,048-token chunks, as the engine schedules it.
    model_prefill = sum(deployment.step_s(min(2048, context - done), done, 0, 0) for done in range(0, context, 2048))
    local = statistics.median(r["local_restore_ttft_s"] for r in runs)
    prefill = statistics.median(r["reprefill_ttft_s"] for r in runs)
    save(
        "restore",
        {
            "config": {
                "deployment": "Qwen3-32B on 1x H100-SXM",
                "prompt_tokens": 4096,
                "generated_before_failure": GENERATED,
                "time_scale": 1.0,
                "repeats": args.repeats,
                "host_to_gpu_link": catalog.HOST_TO_GPU_LINK,
            },
            "figures": {
                "restore_from_local_store_ttft_s": round(local, 4),
                "reprefill_ttft_s": round(prefill, 4),
                "ratio_reprefill_over_restore": round(prefill / local, 2),
                "restored_tokens": restored,
                "restored_gb": round(restored * deployment.model.kv_bytes_per_token / 1e9, 3),
                "model_restore_s": round(model_restore, 4),
                "model_reprefill_s": round(model_prefill, 4),
                "model_ratio": round(model_prefill / model_restore, 2),
            },
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
