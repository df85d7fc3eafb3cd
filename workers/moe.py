"""Mixture-of-experts, decoupled (document 001, TARRAGON): what attention workers (AWs) and expert workers (EWs)
share.

An AW runs attention for its requests layer by layer and, at each layer, sends every token's activations to the
EWs hosting the experts its gating network selected, waiting for their answers before the next layer. Three things
here are the contract between them:

- the gate: the top-k experts of a token at a layer, and their weights, a pure function of the model, the layer
  and the token's context (so a replay, on any AW, selects the same experts);
- an expert's answer: a pure function of the model, the layer, the expert and its input, whichever EW computes it
  (a primary or a shadow), so a layer replayed elsewhere after an EW failure gives the same result (document 001
  §5.1: expert computation is stateless and deterministic);
- the expert routing table (ERT): logical expert → the EWs that hold it, primaries first, then shadows (§4.2).
  The control plane owns it (recovery.policy.moe plans it); every AW holds a copy and is told of each change.

Payloads are digests, never tensors; bytes are accounted in full (DESIGN.md contract 3): `activation_bytes` is
what one token's hidden state costs on the AW–EW link, `expert_bytes` what one expert's weights cost in memory.
"""

import hashlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from workers.catalog import BYTES_PER_PARAM, Model, load_time_s


class MoeError(ValueError):
    """A message or table an AW or EW cannot take; `field` names the part that was wrong."""

    def __init__(self, field_: str, message: str):
        super().__init__(f"{field_}: {message}")
        self.field = field_


def require_moe(model: Model) -> Model:
    if not model.experts or not model.experts_per_token or model.active_params_b is None:
        raise MoeError("model", f"{model.key} is not a mixture of experts: it has no experts to route to")
    return model


def expert_params(model: Model) -> float:
    """Parameters of one expert of one layer: the routed experts' share of the parameters not active per token."""
    return require_moe(model).expert_params_b * 1e9 / model.layers


def expert_bytes(model: Model) -> int:
    """GPU memory one expert (all its layers) takes: what an EW spends to hold it, as a primary or a shadow."""
    return int(expert_params(model) * model.layers * BYTES_PER_PARAM)


def attention_share(model: Model) -> float:
    """The share of a decoupled MoE's per-token work its attention worker keeps: what every token uses but its
    selected experts (those run on the expert workers). 1 for a dense model."""
    return model.shared_params_b / (model.active_params_b or model.params_b)


def attention_worker_load_s(model: Model) -> float:
    """An attention worker's cold (re)load: only the weights it runs (attention and the shared ones; the experts
    live on the EWs), plus the engine's start."""
    return load_time_s(model, weight_bytes=model.shared_params_b * 1e9 * BYTES_PER_PARAM)


def hidden_size(model: Model) -> int:
    return model.hidden or model.q_heads * model.head_dim


def activation_bytes(model: Model) -> int:
    """One token's hidden state, one way, on the AW–EW link (BF16)."""
    return hidden_size(model) * BYTES_PER_PARAM


def _digest(*parts) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part if isinstance(part, bytes) else str(part).encode())
        h.update(b"\x00")
    return h.digest()


def gate(model: Model, layer: int, context: bytes) -> tuple[tuple[int, float], ...]:
    """The top-k experts of the token whose context digest is `context` at `layer`, with their gating weights
    (summing to 1), highest first. Deterministic: the same model, layer and context select the same experts."""
    require_moe(model)
    if not 0 <= layer < model.layers:
        raise MoeError("layer", f"{layer} is not a layer of {model.key} (0 to {model.layers - 1})")
    scores = []
    for expert in range(model.experts):
        (value,) = struct.unpack("<Q", _digest(model.key, layer, expert, context)[:8])
        scores.append((value, expert))
    top = sorted(scores, reverse=True)[: model.experts_per_token]
    total = sum(score for score, _ in top) or 1
    return tuple((expert, score / total) for score, expert in top)


def expert_output(model: Model, layer: int, expert: int, activation: bytes) -> bytes:
    """What `expert` of `layer` answers for a token whose activation digest is `activation`: a pure function of
    its inputs, whichever EW holds the expert."""
    if not 0 <= expert < model.experts:
        raise MoeError("expert", f"{expert} is not an expert of {model.key} (0 to {model.experts - 1})")
    return _digest("out", model.key, layer, expert, activation)


def combine(model: Model, layer: int, answers: Mapping[int, bytes], weights: Iterable[tuple[int, float]]) -> bytes:
    """The layer's output for one token: its selected experts' answers, weighted (as a digest). Every selected
    expert must have answered; a missing one is the AW's to replay elsewhere, never to skip."""
    parts = []
    for expert, weight in weights:
        if expert not in answers:
            raise MoeError("answers", f"expert {expert} of layer {layer} has not answered")
        parts.append(answers[expert] + struct.pack("<d", weight))
    return _digest("layer", model.key, layer, *parts)


@dataclass(frozen=True)
class Locations:
    """Where one logical expert lives: the EWs that serve it (primaries) and those holding an inactive copy in
    residual memory (shadows), each in the order they are tried."""

    primaries: tuple[str, ...] = ()
    shadows: tuple[str, ...] = ()

    def ews(self) -> tuple[str, ...]:
        return self.primaries + self.shadows


@dataclass(frozen=True)
class ExpertRoutingTable:
    """Logical expert → its locations, for one model, at one version (a change always raises it)."""

    model: str
    version: int
    experts: tuple[Locations, ...] = field(default_factory=tuple)

    def resolve(self, expert: int, down: Iterable[str] = ()) -> str | None:
        """The EW to send `expert`'s tokens to: its first live primary, else its first live shadow; None when
        every location of it is down (the AW waits for the control plane's next table)."""
        down = set(down)
        return next((ew for ew in self.experts[expert].ews() if ew not in down), None)

    def ews(self) -> set[str]:
        return {ew for loc in self.experts for ew in loc.ews()}

    def primaries_of(self, ew: str) -> list[int]:
        return [i for i, loc in enumerate(self.experts) if ew in loc.primaries]

    def shadows_of(self, ew: str) -> list[int]:
        return [i for i, loc in enumerate(self.experts) if ew in loc.shadows]

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "version": self.version,
            "experts": [{"primaries": list(loc.primaries), "shadows": list(loc.shadows)} for loc in self.experts],
        }

    @classmethod
    def parse(cls, data, model: Model) -> "ExpertRoutingTable":
        """A table as the control plane sends it; refused, naming the part, when it is not one for `model`."""
        if not isinstance(data, dict):
            raise MoeError("ert", "must be a JSON object")
        if data.get("model") != model.key:
            raise MoeError("ert.model", f"{data.get('model')!r} is not this worker's model {model.key}")
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise MoeError("ert.version", f"must be a non-negative int, got {version!r}")
        rows = data.get("experts")
        if not isinstance(rows, list) or len(rows) != model.experts:
            raise MoeError("ert.experts", f"must list the {model.experts} experts of {model.key}, in order")
        experts = []
        for i, row in enumerate(rows):
            where = f"ert.experts[{i}]"
            if not isinstance(row, dict):
                raise MoeError(where, "must be an object with primaries and shadows")
            lists = []
            for key in ("primaries", "shadows"):
                names = row.get(key, [])
                if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
                    raise MoeError(f"{where}.{key}", "must be a list of EW names")
                lists.append(tuple(names))
            if not lists[0] and not lists[1]:
                raise MoeError(where, f"expert {i} has no location: the table would lose it")
            if set(lists[0]) & set(lists[1]):
                raise MoeError(where, f"expert {i} is both a primary and a shadow on one EW")
            experts.append(Locations(*lists))
        return cls(model.key, version, tuple(experts))


def balancedness(tokens_per_ew: Mapping[str, float]) -> float | None:
    """vLLM's EPLB balancedness: mean over max tokens per EW (1 is perfectly even); None with no tokens."""
    values = list(tokens_per_ew.values())
    if not values or max(values) <= 0:
        return None
    return (sum(values) / len(values)) / max(values)
