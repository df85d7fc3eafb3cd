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


def main() -> int:
    from harness import real_engine, vllm_engine

    failed = 0
    for name, make in (("llama-server", real_engine.llama_server_binary), ("vLLM", vllm_engine.vllm_python)):
        started = time.monotonic()
        try:
            path = make()
        except Exception as exc:  # noqa: BLE001 - said; the tests that need it build it again and say why
            print(f"prepare: {name} could not be made ({exc}); the tests that need it will try again", flush=True)
            failed += 1
        else:
            print(f"prepare: {name} ready in {time.monotonic() - started:.0f} s: {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
