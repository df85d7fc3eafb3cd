"""Make this machine's engine caches ahead of the tests that need them: llama.cpp's server (built, several minutes)
and vLLM's CPU virtualenv (installed, a few minutes), both in ~/.cache/lifeline and kept from one run to the next.

`./lifeline test` runs this in the background, at the lowest CPU priority, while the parallel phase runs: on a
machine that has them it returns at once; on a first run it takes the cores' idle time, and a test that needs an
engine waits for it on the same lock instead of building it then. A failure here is only said: the test that needs
the engine builds it again itself and fails with the reason.

    python -m harness.prepare
"""

import sys
import time
from concurrent.futures import ThreadPoolExecutor


def make(name: str, maker) -> bool:
    started = time.monotonic()
    try:
        path = maker()
    except Exception as exc:  # noqa: BLE001 - said; the tests that need it build it again and say why
        print(f"prepare: {name} could not be made ({exc}); the tests that need it will try again", flush=True)
        return False
    print(f"prepare: {name} ready in {time.monotonic() - started:.0f} s: {path}", flush=True)
    return True


def main() -> int:
    """Both at once: the build is the cores' work, vLLM's install mostly the disk's and the network's."""
    from harness import real_engine, vllm_engine

    with ThreadPoolExecutor(max_workers=2) as pool:
        made = pool.map(make, ("llama-server", "vLLM"), (real_engine.llama_server_binary, vllm_engine.vllm_python))
        return 0 if all(made) else 1


if __name__ == "__main__":
    sys.exit(main())
