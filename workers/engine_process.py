"""The real engine the node agent owns: started, supervised, restarted and stopped by its sidecar.

`python -m workers.node --engine-url http://127.0.0.1:8000 --engine-command "vllm serve Qwen/Qwen3-32B --port 8000 …"`

A sidecar beside an engine it does not own (a container of its own, say) routes, watches, canaries and resumes it,
but cannot restart it or reset its GPUs. Given `--engine-command`, the node agent starts the engine itself, as a
child in a process group of its own, and owns its life:

- supervision: an engine that exits unbidden is started again, after 1 s, doubling up to 30 s while it keeps dying
  within a minute of its start; the node is out of service until the engine answers as its adapter needs again;
- reload (a drain's remediation): the engine's own graceful shutdown (SIGTERM to its group; SIGKILL after the stop
  timeout), then a fresh start;
- GPU reset, where the host allows it: the engine stopped (a GPU in use cannot be reset), the reset command run on
  the node's GPUs, the engine started again whether the reset worked or not. The default command is
  `nvidia-smi --gpu-reset -i {gpus}`, offered only when NVML sees GPUs, nvidia-smi is installed and the agent runs
  as root (what a reset needs); `--gpu-reset-command` names another (a site's own script), `{gpus}` replaced by
  the GPUs' indices, comma-separated;
- stop: the agent's own stop stops the engine the same way, so no engine outlives its sidecar.
"""

import asyncio
import logging
import os
import shlex
import shutil
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

RESTART_DELAY_S = 1.0  # an engine that died unbidden starts again after this, doubled while it keeps dying
MAX_RESTART_DELAY_S = 30.0
STABLE_AFTER_S = 60.0  # an engine that ran this long before dying starts again after RESTART_DELAY_S
DEFAULT_RESET_COMMAND = "nvidia-smi --gpu-reset -i {gpus}"
RESET_TIMEOUT_S = 120.0


def default_reset_command(gpus: Sequence[int]) -> str | None:
    """`nvidia-smi --gpu-reset` where this host allows it: NVML saw GPUs, nvidia-smi is here, the agent is root."""
    if gpus and shutil.which("nvidia-smi") and os.geteuid() == 0:
        return DEFAULT_RESET_COMMAND
    return None


class EngineProcess:
    """One engine process, as a supervisor keeps it. `on_exit` is awaited when it dies unbidden (before it starts
    again), `on_start` each time it was started again (not the first time)."""

    def __init__(
        self,
        command: str,
        *,
        log_path: Path | None = None,
        stop_timeout_s: float = 30.0,
        reset_command: str | None = None,
        gpus: Sequence[int] = (),
    ):
        self.argv = shlex.split(command)
        if not self.argv:
            raise ValueError("--engine-command is empty: give the command that starts the engine")
        self.log_path = log_path
        self.stop_timeout_s = stop_timeout_s
        self.reset_command = reset_command
        self.gpus = tuple(gpus)
        self.process: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self.starts = 0
        self.unbidden_exits = 0
        self.exits_unanswered = 0  # unbidden exits since the engine last answered (`answered`)
        self._quick_exits = 0  # unbidden exits in a row, each within STABLE_AFTER_S of its start
        self.resets = 0
        self.reset_failures = 0
        self.last_reset: str | None = None  # what the last reset command said, in a line
        self.on_exit: Callable[[int], Awaitable[None]] | None = None
        self.on_start: Callable[[], Awaitable[None]] | None = None
        self._stopping = False  # a stop asked for: its exit is not a crash
        self._supervisor: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    def answered(self) -> None:
        """The engine answered its health check: its earlier exits no longer count against it."""
        self.exits_unanswered = 0

    @property
    def can_reset(self) -> bool:
        return self.reset_command is not None

    @property
    def pid(self) -> int | None:
        return None if self.process is None or self.process.returncode is not None else self.process.pid

    def describe(self) -> dict:
        return {
            "command": shlex.join(self.argv),
            "pid": self.pid,
            "starts": self.starts,
            "unbidden_exits": self.unbidden_exits,
            "gpu_reset": self.reset_command,
            "resets": self.resets,
            "reset_failures": self.reset_failures,
            "last_reset": self.last_reset,
        }

    # --- life ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        async with self._lock:
            await self._spawn()

    async def _spawn(self) -> None:
        out = open(self.log_path, "ab") if self.log_path else None  # the child holds its own copy
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out if out else asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.STDOUT if out else asyncio.subprocess.DEVNULL,
                start_new_session=True,  # its own process group: a stop reaches the workers it forks
            )
        except OSError as exc:
            raise EngineStartError(f"cannot start the engine ({shlex.join(self.argv)}): {exc}") from None
        finally:
            if out:
                out.close()
        self._stopping = False
        self.started_at = time.monotonic()
        self.starts += 1
        log.info("engine started (pid %d): %s", self.process.pid, shlex.join(self.argv))
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(self.process), name="engine-process")

    async def _supervise(self, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        if self._stopping or process is not self.process:
            return
        self.unbidden_exits += 1
        self.exits_unanswered += 1
        ran = time.monotonic() - self.started_at
        self._quick_exits = 0 if ran >= STABLE_AFTER_S else self._quick_exits + 1
        delay = min(MAX_RESTART_DELAY_S, RESTART_DELAY_S * 2 ** max(self._quick_exits - 1, 0))
        log.warning(
            "engine (pid %d) exited with %s after %.1f s: starting it again in %.0f s", process.pid, code, ran, delay
        )
        if self.on_exit is not None:
            await self.on_exit(code)
        await asyncio.sleep(delay)
        async with self._lock:
            if self._stopping or process is not self.process:
                return  # stopped, or started by someone else, meanwhile
            try:
                await self._spawn()
            except EngineStartError as exc:
                log.error("%s", exc)
                return
        if self.on_start is not None:
            await self.on_start()

    async def stop(self) -> int | None:
        """The engine's graceful shutdown: SIGTERM to its process group, SIGKILL after the stop timeout."""
        async with self._lock:
            return await self._stop()

    async def _stop(self) -> int | None:
        self._stopping = True
        process = self.process
        if process is None or process.returncode is not None:
            return None if process is None else process.returncode
        _signal_group(process.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(self.stop_timeout_s):
                code = await process.wait()
        except TimeoutError:
            log.warning("engine (pid %d) still running %.0f s after SIGTERM: SIGKILL", process.pid, self.stop_timeout_s)
            _signal_group(process.pid, signal.SIGKILL)
            code = await process.wait()
        _signal_group(process.pid, signal.SIGKILL)  # anything of its group left behind
        log.info("engine (pid %d) stopped (%s)", process.pid, code)
        return code

    async def restart(self, reset: bool = False) -> bool:
        """Stop the engine, reset the GPUs first if asked (False if the reset failed), and start it again."""
        async with self._lock:
            await self._stop()
            ok = await self._reset() if reset else True
            await self._spawn()
        return ok

    async def _reset(self) -> bool:
        assert self.reset_command is not None, "reset only where can_reset"
        command = self.reset_command.replace("{gpus}", ",".join(map(str, self.gpus)))
        self.resets += 1
        try:
            child = await asyncio.create_subprocess_exec(
                *shlex.split(command), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
            async with asyncio.timeout(RESET_TIMEOUT_S):
                out, _ = await child.communicate()
            code = child.returncode
        except (OSError, TimeoutError) as exc:
            out, code = str(exc).encode(), -1
        said = out.decode(errors="replace").strip().splitlines()
        self.last_reset = f"{command}: exit {code}" + (f": {said[-1]}" if said else "")
        if code != 0:
            self.reset_failures += 1
            log.error("GPU reset failed: %s", self.last_reset)
            return False
        log.warning("GPUs reset: %s", self.last_reset)
        return True


class EngineStartError(Exception):
    """The engine command could not be started (not found, not executable)."""


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass
