"""Deterministic text: the next token is a pure function of (model, seed, context).

The context is folded into a 16-byte rolling state, one hash per token, so a
request migrated or restored at token N continues exactly as an undisturbed
run would: the new node refolds prompt plus the N tokens and gets the same
state. Candidates and their logprobs come from the same digest, so greedy
decoding (temperature 0) and seeded sampling are both reproducible.
"""

import functools
import hashlib
import math
import re
import struct
from dataclasses import dataclass

_WORDS = """
the of and to in is that for it as with was on be by at this are from or have an they which one you were
all we there can been has more if will would their what so about when who some up out them other into its then
two time could these may first new also only like most over such after than made where way many even because
through much before must good well any those same each between under still work system node cluster service
request token model memory network signal state health load traffic capacity latency failure recovery
checkpoint holder rack server process stream batch queue decode prefill cache page block engine worker gateway
operator window level record timeline event alert metric report budget schedule route path link device
data value result answer question reason method design plan review change update version release build test
river mountain forest ocean island valley city village garden window bridge road harbor field meadow desert
morning evening night summer winter spring autumn weather light shadow color sound voice music story letter
book paper table chair door house room kitchen market street station train ship plane engine wheel machine
people person child family friend teacher student doctor worker farmer writer artist builder leader member
water fire earth air stone metal glass wood iron silver gold paper cloth bread fruit apple grain salt sugar
small large long short high low early late quick slow bright dark warm cold clear quiet simple careful steady
strong gentle honest patient curious calm ready stable healthy busy free open closed whole partial
make take give find keep hold move turn start stop send receive carry bring build write read learn teach show
watch listen speak answer follow lead help serve measure count check drain restore migrate place assign
balance recover observe predict verify accept reject approve report record notice explain compare improve
always often never sometimes again together already almost perhaps quite rather nearly slowly quickly carefully
""".split()

# Duplicates would make two ids share a word and text ambiguous to read back.
VOCAB: tuple[str, ...] = tuple(dict.fromkeys(_WORDS)) + (".", ",", "<eos>")
VOCAB_INDEX = {word: i for i, word in enumerate(VOCAB)}
PERIOD = VOCAB_INDEX["."]
COMMA = VOCAB_INDEX[","]
EOS = VOCAB_INDEX["<eos>"]
WORD_COUNT = len(VOCAB) - 3
# Prompt words outside the vocabulary still get stable ids, above the vocabulary.
UNKNOWN_BASE = 1 << 20
UNKNOWN_SPAN = 1 << 30
MAX_TOKEN_ID = UNKNOWN_BASE + UNKNOWN_SPAN  # every id encode() gives is below this

CANDIDATES = 5
MIN_TOKENS_BEFORE_EOS = 8
EOS_PER_MILLE = 4  # about one sequence in 250 tokens ends on its own

_TOKEN_RE = re.compile(r"[A-Za-z0-9_']+|[^\sA-Za-z0-9_']")


def _stable_hash(text: str) -> int:
    # surrogatepass: a lone surrogate is refused at the API, but the tokenizer itself never fails on text.
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


@functools.lru_cache(maxsize=1 << 16)
def _unknown_id(lowered: str) -> int:
    # Words repeat (Zipf): hashing each distinct one once makes a long prompt several times cheaper to encode.
    return UNKNOWN_BASE + _stable_hash(lowered) % UNKNOWN_SPAN


def encode(text: str) -> list[int]:
    """Prompt text to token ids: vocabulary words keep their id, others hash."""
    ids = []
    for piece in _TOKEN_RE.findall(text):
        lowered = piece.lower()
        index = VOCAB_INDEX.get(lowered)
        ids.append(index if index is not None else _unknown_id(lowered))
    return ids


def piece(token_id: int, previous: int | None) -> str:
    """The text one generated token adds, spaced and capitalised as prose."""
    if token_id == EOS:
        return ""
    word = VOCAB[token_id] if token_id < len(VOCAB) else f"w{token_id}"
    if token_id in (PERIOD, COMMA):
        return word
    if previous is None or previous == PERIOD:
        word = word.capitalize()
    return word if previous is None else " " + word


def decode(token_ids: list[int], previous: int | None = None) -> str:
    out = []
    for token_id in token_ids:
        out.append(piece(token_id, previous))
        previous = token_id
    return "".join(out)


def initial_state(model_key: str) -> bytes:
    # Greedy text depends on the model and the context only; the seed enters
    # when sampling, as in a real engine.
    return hashlib.blake2b(model_key.encode(), digest_size=16, person=b"lifeline-model").digest()


def advance(state: bytes, token_id: int) -> bytes:
    return hashlib.blake2b(state + token_id.to_bytes(8, "little"), digest_size=16).digest()


def fold(state: bytes, token_ids) -> bytes:
    for token_id in token_ids:
        state = advance(state, token_id)
    return state


@dataclass(frozen=True)
class Choice:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the candidates, most likely first


# Precomputed so that the token function, run once per token for every stream, stays cheap.
_UNPACK_CANDIDATES = struct.Struct(f"<{CANDIDATES}I").unpack_from
_MARGIN = [0.4 + b / 255 * 1.6 for b in range(256)]  # logit step between candidates, from one digest byte
_REST = math.log(max(WORD_COUNT - CANDIDATES, 1)) - 1.0  # the rest of the vocabulary, below the last candidate


def _candidates(state: bytes, position: int, min_tokens: int = 0) -> tuple[list[int], list[float]]:
    digest = hashlib.blake2b(state, digest_size=32, person=b"lifeline-next").digest()
    ids: list[int] = []
    for raw in _UNPACK_CANDIDATES(digest):
        token = raw % WORD_COUNT
        while token in ids:
            token = (token + 1) % WORD_COUNT
        ids.append(token)
    # Punctuation and the end of the sequence take the lead now and then, so text reads as sentences.
    selector = digest[20]
    if position >= MIN_TOKENS_BEFORE_EOS and position >= min_tokens and digest[21] * 1000 // 256 < EOS_PER_MILLE:
        ids[0] = EOS
    elif selector < 22:
        ids[0] = PERIOD
    elif selector < 40:
        ids[0] = COMMA
    # Descending logits: the leader's margin varies with the context. The rest of the
    # vocabulary shares a small mass, so even a confident choice is below 0 logprob.
    l1 = -_MARGIN[digest[23]]
    l2 = l1 - _MARGIN[digest[24]]
    l3 = l2 - _MARGIN[digest[25]]
    l4 = l3 - _MARGIN[digest[26]]
    exp = math.exp
    norm = math.log(1.0 + exp(l1) + exp(l2) + exp(l3) + exp(l4) + exp(l4 + _REST))
    return ids, [-norm, l1 - norm, l2 - norm, l3 - norm, l4 - norm]


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn: temperature and seed, and vLLM's filters and minimum length."""

    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    min_p: float = 0.0
    min_tokens: int = 0  # no end of sequence before this many output tokens

    @property
    def filtered(self) -> bool:
        return self.top_p < 1.0 or 0 < self.top_k < CANDIDATES or self.min_p > 0.0


GREEDY = Sampling()


def next_token(state: bytes, position: int, temperature: float, seed: int, sampling: Sampling | None = None) -> Choice:
    """The token after the context folded into `state`, `position` tokens into the output.

    `sampling`, when given, carries the filters (top_p, top_k, min_p) and the
    minimum length; its temperature and seed are the ones passed here.
    """
    ids, logprobs = _candidates(state, position, sampling.min_tokens if sampling is not None else 0)
    top = tuple(zip(ids, logprobs))
    if temperature <= 0:
        return Choice(ids[0], logprobs[0], top)
    # Seeded sampling among the candidates, from a uniform drawn off the same state.
    scaled = [lp / temperature for lp in logprobs]
    peak = max(scaled)
    weights = [math.exp(s - peak) for s in scaled]
    if sampling is not None and sampling.filtered:
        weights = _filter(weights, sampling)
    total = sum(weights)
    u_digest = hashlib.blake2b(
        state + seed.to_bytes(8, "little", signed=True), digest_size=8, person=b"lifeline-samp"
    ).digest()
    u = int.from_bytes(u_digest, "little") / 2**64 * total
    for token_id, logprob, weight in zip(ids, logprobs, weights):
        if weight <= 0:
            continue
        u -= weight
        if u <= 0:
            return Choice(token_id, logprob, top)
    last = max(i for i, w in enumerate(weights) if w > 0)
    return Choice(ids[last], logprobs[last], top)


def _filter(weights: list[float], sampling: Sampling) -> list[float]:
    """vLLM's order: top-k, then top-p over what is left (the leader always stays), then min-p.

    The weights come most likely first, as the candidates do.
    """
    kept = list(weights)
    if 0 < sampling.top_k < len(kept):
        kept[sampling.top_k :] = [0.0] * (len(kept) - sampling.top_k)
    if sampling.top_p < 1.0:
        total, running = sum(kept), 0.0
        for i, weight in enumerate(kept):
            if i and running >= sampling.top_p * total:
                kept[i] = 0.0
            running += weight
    if sampling.min_p > 0.0:
        floor = sampling.min_p * kept[0]
        kept = [w if w >= floor else 0.0 for w in kept]
    return kept


def more_candidates(state: bytes, choice: Choice, count: int) -> tuple[tuple[int, float], ...]:
    """Candidates beyond the sampled five, for top_logprobs above CANDIDATES.

    They come from the rest of the vocabulary's share, each less likely than
    the fifth candidate and all of them together well inside that share, so the
    distribution stays a distribution. Sampling never draws them, as before.
    """
    digest = hashlib.blake2b(state, digest_size=64, person=b"lifeline-more").digest()
    taken = {token for token, _ in choice.top}
    logprob = choice.top[-1][1]
    extra = []
    for i in range(count):
        token = int.from_bytes(digest[2 * i : 2 * i + 2], "little") % WORD_COUNT
        while token in taken:
            token = (token + 1) % WORD_COUNT
        taken.add(token)
        logprob -= _MARGIN[digest[40 + i % 24]] / 2
        extra.append((token, logprob))
    return tuple(extra)


def token_text(token_id: int) -> str:
    return VOCAB[token_id] if token_id < len(VOCAB) else f"w{token_id}"
