"""A real LLM engine for the tests: llama.cpp's `llama-server` serving a tiny random-weight Llama model.

- llama_server_binary(): llama-server built once per machine from the llama.cpp tree vendored in the PyPI sdist of
  llama-cpp-python (only PyPI is needed), cached in ${XDG_CACHE_HOME:-~/.cache}/lifeline/. ~8 min on 2 cores.
- tiny_model(path, seed=): a GGUF Llama (4 layers, n_embd 256, 4 heads / 2 KV heads, n_ff 768, f32, ctx 4096)
  with random weights and a byte-level BPE (958 tokens) trained here on a built-in text. ~0.1 s.
- LlamaServer(model): the server as a subprocess on a free port; ready in ~0.05-0.1 s.

What this llama-server (llama-cpp-python 0.3.36, llama.cpp commit 0c1e570, "b1-0c1e570") does, checked by hand
against the tiny model (examples trimmed; ids are this tokenizer's: 0 <|endoftext|> = BOS = EOS, 1 <|im_start|>,
2 <|im_end|>, 3..258 the bytes):

4a. POST /completion {"prompt": [0, 75, 104, 288, 114, 358, 307], "n_predict": 3, "temperature": 0,
    "stream": true, "return_tokens": true, "n_probs": 2} streams `data: {...}` lines (no [DONE]). Each chunk is
    one decoded token: {"index": 0, "content": " year", "tokens": [582], "stop": false, "id_slot": -1,
    "tokens_predicted": 1, "tokens_evaluated": 7, "completion_probabilities": [{"id": 582, "token": " year",
    "bytes": [32, ...], "logprob": -0.107, "top_logprobs": [{"id": 582, ..., "logprob": -0.107},
    {"id": 381, "token": " cl", ..., "logprob": -3.03}]}]} ("prob"/"top_probs" instead with
    "post_sampling_probs": true). Streamed chunks carry "tokens" even without return_tokens (a non-streamed
    answer has "tokens" only with it). Content and ids need not line up per chunk: text held back for a partial
    stop-word match comes out later (chunks ("", [582]), (" yearhing", [462])), so accumulate the two apart.
    The final chunk: {"content": "", "tokens": [], "id_slot": 3, "stop": true, "model": "tiny-llama",
    "tokens_predicted": 3, "tokens_evaluated": 7, "prompt": "<|endoftext|>Hello world", "stop_type": "limit",
    "stopping_word": "", "truncated": false, "tokens_cached": 9, "generation_settings": {...}, "timings":
    {"cache_n": 0, "prompt_n": 7, "prompt_ms": 3.0, "predicted_n": 3, "predicted_ms": 3.3,
    "predicted_per_token_ms": 1.6, ...}}. stop_type: "limit" (n_predict reached, and also when the slot's context
    is full: n_predict 2000 in a 1024-token slot stopped at 1019 with "limit"), "word" (with "stopping_word"),
    "eos". tokens_evaluated is the prompt length (BOS included); cache_n the prompt tokens reused.
4b. POST /tokenize {"content": "Hello world", "add_special": true} -> {"tokens": [0, 75, 104, 288, 114, 358, 307]}
    (add_special false: without the leading BOS 0; "with_pieces": true gives [{"id", "piece"}]; special-token
    text such as "<|im_start|>" becomes its id). POST /detokenize {"tokens": [...]} ->
    {"content": "<|endoftext|>Hello world"} (specials rendered as text). POST /apply-template {"messages":
    [{"role": "user", "content": "Hi"}]} -> {"prompt": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"}
    (the GGUF's Jinja template; no BOS in the text). /tokenize of that prompt with add_special true gives exactly
    the ids /v1/chat/completions evaluates (usage.prompt_tokens equal, BOS included, and the same greedy reply
    from /completion with those ids).
4c. /v1/completions and /v1/chat/completions (stream or not) carry no "tokens" field, return_tokens or not. The
    ids are there only through logprobs: chat "logprobs": true (top_logprobs >= 1; with top_logprobs 0 the
    logprobs vanish) and completions "logprobs": N >= 1 give choices[0].logprobs.content[i] = {"id": 549,
    "token": " pa", "bytes": [...], "logprob": -0.70, "top_logprobs": [...]}, one entry per chunk. /v1/completions
    accepts a prompt given as a list of ids ("prompt": [0, 75, ...]; usage.prompt_tokens 7). The last streamed
    chunk has "finish_reason" and "timings"; "usage" too on /v1/completions, while /v1/chat/completions sends it
    only with "stream_options": {"include_usage": true} (as a further chunk with "choices": []).
4d. /metrics (only with --metrics, else 501): llamacpp:prompt_tokens_total, prompt_tokens_cached_total,
    prompt_seconds_total, tokens_predicted_total, tokens_predicted_seconds_total, n_decode_total, n_tokens_max,
    spec_decode_num_draft_tokens_total, spec_decode_num_accepted_tokens_total, spec_decode_num_drafts_total
    (counters); prompt_tokens_seconds, predicted_tokens_seconds, requests_processing, requests_deferred,
    n_busy_slots_per_decode (gauges). No KV-cache usage series in this version.
    /slots (on by default): a list, one per slot: {"id": 0, "n_ctx": 1024, "speculative": false,
    "is_processing": false}; a slot that has run a task adds "id_task", "n_prompt_tokens",
    "n_prompt_tokens_processed", "n_prompt_tokens_cache", "params" (the sampling settings) and "next_token":
    [{"has_next_token": true, "has_new_line": false, "n_remain": 1676, "n_decoded": 324}] (live while busy).
    `-c` is the total context, split between the slots (-np 4 -c 4096: n_ctx 1024 each; kv_unified false).
    /props: total_slots, model_alias, model_path, model_ftype, bos_token, eos_token, build_info, chat_template,
    chat_template_caps, modalities, endpoint_slots / endpoint_metrics / endpoint_props (false: POST /props off),
    is_sleeping, default_generation_settings {"params": {...}, "n_ctx": 1024}. /v1/models (also /models):
    {"object": "list", "data": [{"id": "tiny-llama", "aliases": ["tiny-llama"], "owned_by": "llamacpp",
    "meta": {"n_vocab": 958, "n_ctx": 1024, "n_ctx_train": 4096, "n_params": 3638528, ...}}], "models": [...]}:
    the id is the `-a` alias; without -a it is the -m path as given. /health: 200 {"status":"ok"}.
4e. Resuming by ids: at temperature 0, is full[:k] + greedy(prompt + full[:k], 200 - k) == full (ids and text),
    for k in 1, 2, 5, 17, 50, 100, 150, 199, 6 prompts, 4 seeds? With llama-server's defaults (flash attention
    "auto" = on for CPU, f16 KV cache): yes with cache_prompt true on the same server (the slot reuses the KV
    the first reply wrote: 0 mismatches / 192), but NOT when the continuation is computed afresh (cache_prompt
    false, i.e. what another server sees: 18 / 192 mismatches) nor when requests share decode batches
    (7 / 24 runs of 4 concurrent requests differed). The logits move by up to ~0.02 between a batched prefill and
    one-token decodes, so greedy flips at near-ties (which any random model has, whatever the logit scale). With
    `--flash-attn off --cache-type-k f32 --cache-type-v f32` (LlamaServer's default, exact=True) the drift is
    ~4e-6 and there were 0 mismatches in 408 checks (cache_prompt true and false, and concurrent).
4f. At --threads 1 (this 2-core AMD EPYC, AVX2 build): decode ~1.1 ms/token for short contexts (200 tokens in
    223 ms), ~1.8 ms/token on average up to 1000 tokens of context; prompt ~0.2-0.4 ms/token (597 tokens in
    124 ms). Server start to /health 200: 0.05-0.1 s.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import gguf
import numpy as np

# --- the llama-server binary ------------------------------------------------------------------------------------

#: The llama.cpp sources come from this llama-cpp-python sdist on PyPI (vendor/llama.cpp): PyPI is reachable from
#: CI and dev machines where GitHub and Hugging Face may not be, and the pin fixes the server's behaviour.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"

#: CPU only, static, nothing downloaded: the UI step would fetch prebuilt assets from Hugging Face unless both UI
#: options are off. (LLAMA_CURL no longer exists in this version: the server has its own HTTP client, OpenSSL off.)
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",  # baseline AVX2/FMA build: the cached binary also runs on the next machine of the fleet
    "-DGGML_OPENMP=OFF",  # ggml's own thread pool: no libgomp.so needed at run time
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)

#: Set to a llama-server binary to skip the build (a packaged llama.cpp, a faster native build).
BINARY_ENV = "LIFELINE_LLAMA_SERVER"


def _say(message: str) -> None:
    print(f"real_engine: {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Per-machine cache, outside the checkout, so a fresh clone reuses the binary built by an earlier run."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lifeline"


def llama_server_binary() -> Path:
    """The path to a built `llama-server`, building it the first time on this machine (several minutes).

    A lock keeps two pytest processes from building at once: the second waits, then finds the binary.
    """
    if override := os.environ.get(BINARY_ENV):
        return Path(override)
    final = cache_dir() / f"llama-server-{LLAMA_CPP_PYTHON_VERSION}"
    binary = final / "llama-server"
    if os.access(binary, os.X_OK):
        return binary
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{final.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say("another process is building llama-server; waiting for it…")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.access(binary, os.X_OK):
            _build(final)
    return binary


class _BuildError(Exception):
    pass


def _build(final: Path) -> None:
    """Download the sdist, build only the llama-server target in a temp dir, then rename it into place at once."""
    log_path = final.parent / f"{final.name}-build.log"
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))  # same filesystem: rename is atomic
    started = time.monotonic()
    _say(f"building llama-server once (several minutes)… log: {log_path}")
    try:
        with open(log_path, "w") as log:
            if shutil.which("cmake") is None:
                raise _BuildError("cmake is not on PATH")
            source = _fetch_source(work, log)
            build = work / "build"
            _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS], log)
            _run(["cmake", "--build", str(build), "--target", "llama-server", "--config", "Release", "-j", "2"], log)
            stage = work / "out"
            stage.mkdir()
            shutil.copy2(build / "bin" / "llama-server", stage / "llama-server")
            _run([str(stage / "llama-server"), "--version"], log)
            shutil.rmtree(final, ignore_errors=True)  # a leftover without a binary; we hold the lock
            stage.rename(final)
    except (_BuildError, OSError, ValueError, tarfile.TarError) as error:  # ValueError: no/several sdists found
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise RuntimeError(
            f"building llama-server failed: {error}\n--- last lines of {log_path} ---\n{tail}---\n"
            f"The build needs cmake, gcc/g++ (C++17) and PyPI (pip download of llama-cpp-python=="
            f"{LLAMA_CPP_PYTHON_VERSION}). Fix that and rerun, or set {BINARY_ENV} to a llama-server binary."
        ) from error
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _say(f"built {final / 'llama-server'} in {time.monotonic() - started:.0f} s")


def _fetch_source(work: Path, log: IO[str]) -> Path:
    """pip-download the llama-cpp-python sdist and extract its vendored llama.cpp tree."""
    sdist_dir = work / "sdist"
    spec = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
    pip_download = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    _run([*pip_download, spec, "-d", str(sdist_dir)], log)
    (archive,) = sdist_dir.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        tar.extractall(work / "src", members=members, filter="data")
    (source,) = (work / "src").glob("*/vendor/llama.cpp")
    return source


def _run(command: list[str], log: IO[str]) -> None:
    """Run a build step into the log, echoing cmake's progress every 10 % so a waiting developer sees it move."""
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    shown = -10
    for line in process.stdout:
        log.write(line)
        if (match := re.match(r"\[\s*(\d+)%\]", line)) and int(match[1]) >= shown + 10:
            shown = int(match[1])
            _say(f"building llama-server: {shown}%")
    if process.wait() != 0:
        log.flush()
        raise _BuildError(f"`{' '.join(command[:3])} …` exited with {process.returncode}")


# --- the tiny model ----------------------------------------------------------------------------------------------

N_EMBD = 256
N_LAYER = 4
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 768
N_CTX_TRAIN = 4096
N_VOCAB = 1024  # at most: the corpus runs out of pairs to merge at 958
#: Logit spread (std) of the output layer: top tokens with probabilities ~0.3-0.9, so n_probs shows a winner.
#: It does not make greedy decoding more robust: a different arithmetic moves the logits in proportion.
LOGIT_STD = 4.0

#: Special tokens, at the start of the vocabulary so their ids are easy to remember.
BOS = EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: The tokenizer's training text: fixed, plain ASCII English, so every machine trains the same merges.
CORPUS = """\
The keeper of the lighthouse wrote in his log every evening, before the lamp was lit. He wrote the time of the
tide, the strength of the wind, and the number of ships that had passed the point since the morning. On most days
the entries were short: calm sea, light wind from the west, three boats, one of them late. On other days the
page was full, because a storm had come in from the north and the waves had climbed the rocks to the door.

In the spring of that year the weather changed quickly. A clear morning could turn grey by noon, and the rain
would follow before anyone had time to bring in the washing. The children from the village learned to read the
clouds: long thin clouds meant wind, low dark clouds meant rain, and a ring around the moon meant a cold night.
Their teacher said that people had watched the sky in the same way for thousands of years, long before there
were instruments to measure the pressure of the air.

A small machine can also learn to predict what comes next. It reads a sentence one piece at a time, and for
each piece it gives a score to every word it knows. The word with the highest score is the one it chooses, and
then it reads its own choice and scores again. When the machine is large and well trained, the words form
sentences that people can understand. When it is small and its weights are random, the words still come out in
order, one after another, but they do not mean anything at all.

The engineers who run such machines care about different things. They want each request to be answered, even
when a server fails in the middle of a reply. They want to know how many requests are waiting, how long each
one has waited, and whether the answers arrive at a steady pace. They count tokens per second, they measure
the time to the first token, and they keep a record of every error so that the same mistake is not made twice.

Here are some numbers from a busy day: 12 servers, 4 slots on each, 48 requests at once; 3 failures before
noon and 2 after; an average of 250 tokens per reply; the slowest reply took 9.5 seconds and the fastest took
0.2 seconds. The plan for the next week is simple. First, find out why the third server stopped at 10:40.
Second, make sure that a reply which was cut short can be finished by another server, from the point where
it stopped, with exactly the same words that the first server would have written.

She opened the window and looked at the harbour. The boats were coming back, one by one, with their lights on
and their nets full. It had been a good day after all. Tomorrow the wind would turn, the old sailors said, and
nobody would go out until it was over. So tonight there would be music in the square, bread and fish on the
tables, and stories about the sea that everyone had heard before and wanted to hear again.

Questions, answers, and small facts: What is the capital of France? Paris. How many days are in a week? Seven.
Which is larger, a mountain or a hill? A mountain. Why is the sky blue? Because the air scatters blue light
more than red light. Can you count to ten? One, two, three, four, five, six, seven, eight, nine, ten.
"""

# GPT-2's pre-tokenizer (llama.cpp's "gpt-2"), restricted to the ASCII the corpus is made of.
_PRE_TOKEN = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


@cache
def _byte_chars() -> tuple[str, ...]:
    """GPT-2's byte-to-unicode map: byte-level BPE tokens are strings of these 256 printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {}
    extra = 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return tuple(chars[byte] for byte in range(256))


@cache
def tokenizer() -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    """(tokens, token types, merges) of a byte-level BPE trained on CORPUS: the same for every seed and machine.

    Trained here rather than with the `tokenizers` package so the result does not depend on its version.
    Ids: 0..2 the special tokens, 3..258 the 256 bytes, then one token per merge.
    """
    byte_chars = _byte_chars()
    word_counts = Counter(_PRE_TOKEN.findall(CORPUS))
    words = [[byte_chars[b] for b in word.encode()] for word in word_counts]
    freqs = list(word_counts.values())
    pairs: Counter[tuple[str, str]] = Counter()
    where: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
    for i, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pairs[pair] += freqs[i]
            where[pair].add(i)

    tokens = [*SPECIAL_TOKENS, *byte_chars]
    known = set(tokens)
    merges: list[str] = []
    while len(tokens) < N_VOCAB and pairs:
        best = min(pairs, key=lambda p: (-pairs[p], p))  # most frequent; ties broken by the pair itself
        merged = best[0] + best[1]
        merges.append(f"{best[0]} {best[1]}")
        if merged not in known:
            tokens.append(merged)
            known.add(merged)
        for i in sorted(where.pop(best)):
            old = words[i]
            for pair in zip(old, old[1:]):
                pairs[pair] -= freqs[i]
                if pairs[pair] <= 0:
                    del pairs[pair]
            new: list[str] = []
            j = 0
            while j < len(old):
                if j + 1 < len(old) and (old[j], old[j + 1]) == best:
                    new.append(merged)
                    j += 2
                else:
                    new.append(old[j])
                    j += 1
            words[i] = new
            for pair in zip(new, new[1:]):
                pairs[pair] += freqs[i]
                where[pair].add(i)
    types = [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    return tuple(tokens), tuple(int(t) for t in types), tuple(merges)


def _silenced_tokens(tokens: Sequence[str]) -> list[int]:
    """Ids greedy decoding must never pick: the specials (so it never stops early) and the bytes outside printable
    ASCII (so every generated token is whole UTF-8 text, and streamed text == detokenized ids)."""
    byte_chars = _byte_chars()
    allowed = {byte_chars[b] for b in [*range(0x20, 0x7F), 0x0A]}
    return [i for i, token in enumerate(tokens) if token in SPECIAL_TOKENS or len(token) == 1 and token not in allowed]


@cache
def tiny_weights(seed: int) -> dict[str, np.ndarray]:
    """The tiny model's tensors under llama.cpp's GGUF names, fixed by `seed` (read-only: shared between calls).

    As llama.cpp lays them out: the rows of attn_q and attn_k are in its rotary order, which Hugging Face's
    checkpoints permute (harness/vllm_engine.py undoes it for vLLM, so both engines compute the same model)."""
    tokens = tokenizer()[0]
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    head_dim = N_EMBD // N_HEAD
    tensors: dict[str, np.ndarray] = {"token_embd.weight": normal((len(tokens), N_EMBD), 1.0)}
    for layer in range(N_LAYER):
        blk = f"blk.{layer}"
        tensors |= {
            f"{blk}.attn_norm.weight": np.ones(N_EMBD, dtype=np.float32),
            # q·k of std ~1: attention that depends on what came before, so the text does not fall into a loop
            # as soon as with softer attention (0.5/sqrt(n): "want want want…"). Exact resumption does not come
            # from the weights but from LlamaServer(exact=True): see the module docstring, section 4e.
            f"{blk}.attn_q.weight": normal((N_HEAD * head_dim, N_EMBD), 1.0 / N_EMBD**0.5),
            f"{blk}.attn_k.weight": normal((N_HEAD_KV * head_dim, N_EMBD), 1.0 / N_EMBD**0.5),
            f"{blk}.attn_v.weight": normal((N_HEAD_KV * head_dim, N_EMBD), 1.0 / N_EMBD**0.5),
            f"{blk}.attn_output.weight": normal((N_EMBD, N_HEAD * head_dim), 1.0 / N_EMBD**0.5),
            f"{blk}.ffn_norm.weight": np.ones(N_EMBD, dtype=np.float32),
            f"{blk}.ffn_gate.weight": normal((N_FF, N_EMBD), 1.0 / N_EMBD**0.5),
            f"{blk}.ffn_up.weight": normal((N_FF, N_EMBD), 1.0 / N_EMBD**0.5),
            f"{blk}.ffn_down.weight": normal((N_EMBD, N_FF), 1.0 / N_FF**0.5),
        }
    output = normal((len(tokens), N_EMBD), LOGIT_STD / N_EMBD**0.5)  # the final RMS norm makes |h| = sqrt(n_embd)
    output[_silenced_tokens(tokens)] = 0.0  # logit 0, far below the ~3 std winner: never chosen greedily
    tensors |= {"output_norm.weight": np.ones(N_EMBD, dtype=np.float32), "output.weight": output}

    for array in tensors.values():
        array.flags.writeable = False
    return tensors


def tiny_model(path: Path, *, seed: int = 0) -> Path:
    """Write a small Llama GGUF with random weights (fixed by `seed`) and the tokenizer above; return `path`.

    The same seed gives the same bytes; another seed other weights but the same tokenizer. Writing takes
    well under a second (~15 MB of f32), so there is no cache: each call writes the file afresh.
    """
    path = Path(path)
    tokens, types, merges = tokenizer()
    tensors = tiny_weights(seed)

    writer = gguf.GGUFWriter(None, "llama")
    writer.add_name("lifeline-tiny-llama")
    writer.add_description(f"random weights, seed {seed}, written by harness/real_engine.py")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(list(tokens))
    writer.add_token_types(list(types))
    writer.add_token_merges(list(merges))
    writer.add_bos_token_id(tokens.index(BOS))
    writer.add_eos_token_id(tokens.index(EOS))
    writer.add_eot_token_id(tokens.index(IM_END))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, array in tensors.items():
        writer.add_tensor(name, array)

    # Write next to the target and rename: a server reading the old file keeps its (unlinked) copy.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(fd)
    try:
        writer.write_header_to_file(Path(tmp))
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


# --- the server --------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, process: subprocess.Popen, timeout: float, interval: float = 0.05) -> bool:
    """Whether the server at `url` answers /health with 200 within `timeout`, while `process` runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or 503 while the model loads
        time.sleep(interval)
    return False


class ServerProcess:
    """What the test suite's engine servers share: a subprocess on a port of 127.0.0.1, its log, stopped on exit."""

    log_path: Path
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def _log_tail(self, lines: int = 40) -> str:
        return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])

    def stop(self) -> None:
        raise NotImplementedError

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


class LlamaServer(ServerProcess):
    """`llama-server` on a model, as a subprocess on a free port of 127.0.0.1.

    Use as a context manager (`with LlamaServer(model) as server:`), or call start() and stop(). llama-server
    does not take `--port 0`, so the port is picked here; if another process takes it first, start() retries.

    `exact` (the default) turns flash attention off and keeps the KV cache in f32: only then is a greedy reply
    the same whether its tokens were decoded one by one, re-read as a batched prompt, or batched with another
    request's (see the module docstring, 4e). `alias` is the model id the server reports (None: the file path).
    """

    def __init__(
        self,
        model: Path,
        *,
        alias: str | None = "tiny-llama",
        parallel: int = 4,
        ctx_per_slot: int = 2048,
        threads: int = 1,
        exact: bool = True,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
    ) -> None:
        self.model = Path(model)
        self.alias = alias
        self.parallel = parallel
        self.ctx_per_slot = ctx_per_slot
        self.threads = threads
        self.exact = exact
        self.extra_args = tuple(extra_args)
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        self.port = 0
        self.process = None

    def command(self) -> list[str]:
        """The command line; `-c` is the total context, which llama-server splits evenly between the slots."""
        return [
            str(llama_server_binary()),
            *("-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port)),
            *(("-a", self.alias) if self.alias else ()),
            *("--metrics", "--slots", "-np", str(self.parallel), "-c", str(self.ctx_per_slot * self.parallel)),
            *("--threads", str(self.threads), "--threads-batch", str(self.threads)),
            *(("--flash-attn", "off", "--cache-type-k", "f32", "--cache-type-v", "f32") if self.exact else ()),
            *self.extra_args,
        ]

    def start(self, timeout: float = 60.0, port: int | None = None) -> LlamaServer:
        """Start the server and return once /health answers 200; raise RuntimeError with the log's end if not.

        `port`: this one (a restart where its clients expect it), else a free one.
        """
        for _attempt in range(1 if port else 3):
            self.port = port or _free_port()
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
            if self._wait_healthy(timeout):
                return self
            if "bind" not in self._log_tail():  # a port taken in between is worth another try; the rest is not
                break
        self.stop()
        raise RuntimeError(f"llama-server did not become healthy; end of {self.log_path}:\n{self._log_tail()}")

    def _wait_healthy(self, timeout: float) -> bool:
        assert self.process is not None
        return wait_healthy(self.url, self.process, timeout)

    def request(self, path: str, body: object = None, timeout: float = 60.0) -> Any:
        """GET `path` (POST `body` as JSON when given) and return the decoded JSON answer."""
        with urllib.request.urlopen(self._request(path, body), timeout=timeout) as response:
            return json.loads(response.read())

    def stream(self, path: str, body: object, timeout: float = 60.0) -> list[dict[str, Any]]:
        """POST `body` to a streaming endpoint and return its server-sent events, decoded (without `[DONE]`)."""
        events = []
        with urllib.request.urlopen(self._request(path, body), timeout=timeout) as response:
            for line in response:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    events.append(json.loads(line[len(b"data: ") :]))
        return events

    def _request(self, path: str, body: object) -> urllib.request.Request:
        if body is None:
            return urllib.request.Request(self.url + path)
        data = json.dumps(body).encode()
        return urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` (a crash by default) and reap the process if the signal ends it."""
        assert self.process is not None, "not started"
        if self.process.poll() is None:
            self.process.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
                self.process.wait(timeout=10)

    def stop(self) -> None:
        """Stop gracefully (SIGTERM), then SIGKILL after 10 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> LlamaServer:
        return self.start() if self.process is None else self
