"""Hardware and model catalogs, and the roofline performance model built on them.

Figures come from ../shared/REFERENCE.md. Times are in seconds of real GPU time;
the engine multiplies them by its time scale.
"""

from collections.abc import Iterable
from dataclasses import dataclass, replace

GB = 1e9
GIB = 1024**3
BYTES_PER_PARAM = 2  # BF16 weights
KV_BYTES_PER_ELEMENT = 2  # BF16 KV cache
BLOCK_TOKENS = 16  # paged KV block size, as vLLM's default

# Achieved fractions of peak (REFERENCE.md: decode 0.6-0.7 of HBM bandwidth,
# prefill 0.4-0.55 of peak FLOP/s).
DECODE_BANDWIDTH_EFFICIENCY = 0.65
PREFILL_COMPUTE_EFFICIENCY = 0.5
# vLLM's default gpu_memory_utilization: the rest is activations and the CUDA context.
GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    tflops: float  # dense BF16
    hbm_gbps: float
    memory_gb: float
    link: str  # intra-node link type, a key of LINK_GBPS

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * GB)


@dataclass(frozen=True)
class Model:
    key: str
    name: str
    params_b: float  # total parameters, billions
    layers: int
    kv_heads: int
    head_dim: int
    q_heads: int
    active_params_b: float | None = None  # MoE: parameters used per token
    experts: int = 0
    experts_per_token: int = 0
    draft: str | None = None  # the catalogued draft model of the same family
    # Modelled, not measured: the share of this model's next tokens its draft predicts, each drafted token agreeing
    # with the target's independently (a per-pair property; published same-family pairs accept about 0.5 to 0.9 of
    # drafted tokens, Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", 2023). What a
    # node then reports as acceptance is counted from the drafts it verified.
    draft_agreement: float = 0.0
    is_draft: bool = False
    # The longest context (prompt plus output) it serves: vLLM's max_model_len, which it takes
    # from max_position_embeddings in the model's config.json.
    context_tokens: int = 8192
    hidden: int = 0  # config.json's hidden_size where it is not query heads × head dim (0: it is)

    @property
    def weight_bytes(self) -> int:
        return int(self.params_b * 1e9 * BYTES_PER_PARAM)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * KV_BYTES_PER_ELEMENT

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * BLOCK_TOKENS

    @property
    def active_params(self) -> float:
        return (self.active_params_b or self.params_b) * 1e9

    @property
    def expert_params_b(self) -> float:
        """An MoE's one expert, all its layers, in billions: the parameters a token does not use, over the experts
        it does not use. 0 for a dense model (or experts without an active count: every parameter active)."""
        if not self.experts or self.active_params_b is None:
            return 0.0
        return (self.params_b - self.active_params_b) / (self.experts - self.experts_per_token)

    @property
    def shared_params_b(self) -> float:
        """The parameters every token uses: all of a dense model's; an MoE's active ones but its selected experts."""
        return (self.active_params_b or self.params_b) - self.experts_per_token * self.expert_params_b


GPUS: dict[str, Gpu] = {
    g.key: g
    for g in (
        Gpu("H100-SXM", "NVIDIA H100 80GB HBM3", 989, 3350, 80, "nvlink"),
        Gpu("H100-PCIe", "NVIDIA H100 PCIe", 756, 2000, 80, "pcie"),
        Gpu("H200-SXM", "NVIDIA H200", 989, 4800, 141, "nvlink"),
        # Grace Hopper, the 96 GB HBM3 part (document 004's fleet): an H100's compute with faster memory.
        Gpu("GH200", "NVIDIA GH200 480GB", 989, 4000, 96, "nvlink"),
        Gpu("A100-80GB", "NVIDIA A100-SXM4-80GB", 312, 2039, 80, "nvswitch"),
        Gpu("L40S", "NVIDIA L40S", 362, 864, 48, "pcie"),
        Gpu("RTX-4090", "NVIDIA GeForce RTX 4090", 165, 1008, 24, "pcie"),
        Gpu("RTX-3090", "NVIDIA GeForce RTX 3090", 71, 936, 24, "pcie"),
    )
}

_LLAMA_3_70B = Model(
    "Llama-3-70B",
    "meta-llama/Meta-Llama-3-70B-Instruct",
    70.6,
    80,
    8,
    128,
    64,
    draft="Llama-3.2-1B",
    draft_agreement=0.65,
    context_tokens=8192,
)

MODELS: dict[str, Model] = {
    m.key: m
    for m in (
        Model(
            "Llama-3-8B",
            "meta-llama/Meta-Llama-3-8B-Instruct",
            8.0,
            32,
            8,
            128,
            32,
            draft="Llama-3.2-1B",
            draft_agreement=0.7,
            context_tokens=8192,
        ),
        _LLAMA_3_70B,
        # Document 004's placement experiment (its Table 1): Llama 2 13B has no grouped-query attention.
        Model("Llama-2-13B", "meta-llama/Llama-2-13b-chat-hf", 13.0, 40, 40, 128, 40, context_tokens=4096),
        Model("CodeLlama-34B", "codellama/CodeLlama-34b-Instruct-hf", 33.7, 48, 8, 128, 64, context_tokens=16384),
        # Llama 3.3 is Llama 3's 70B architecture with a 128k context.
        replace(_LLAMA_3_70B, key="Llama-3.3-70B", name="meta-llama/Llama-3.3-70B-Instruct", context_tokens=131072),
        Model(
            "Qwen3-14B",
            "Qwen/Qwen3-14B",
            14.8,
            40,
            8,
            128,
            40,
            draft="Qwen3-1.7B",
            draft_agreement=0.72,
            context_tokens=40960,
        ),
        Model(
            "Qwen3-32B",
            "Qwen/Qwen3-32B",
            32.8,
            64,
            8,
            128,
            64,
            draft="Qwen3-1.7B",
            draft_agreement=0.7,
            context_tokens=40960,
        ),
        Model(
            "Mixtral-8x7B",
            "mistralai/Mixtral-8x7B-Instruct-v0.1",
            46.7,
            32,
            8,
            128,
            32,
            active_params_b=12.9,
            experts=8,
            experts_per_token=2,
            context_tokens=32768,
        ),
        # Qwen3's MoE (config.json: 48 layers, 32 query and 4 KV heads of 128, 128 experts, 8 per token).
        Model(
            "Qwen3-30B-A3B",
            "Qwen/Qwen3-30B-A3B",
            30.5,
            48,
            4,
            128,
            32,
            active_params_b=3.3,
            experts=128,
            experts_per_token=8,
            context_tokens=32768,
            hidden=2048,
        ),
        # DeepSeek-V3: 61 layers, 256 routed experts, 8 per token (its one shared expert is counted in the active
        # parameters). Multi-head latent attention caches 576 values per token and layer (a 512 latent and a 64
        # RoPE key), which the KV formula reads as one head of 288 for K and V together. It fits no single node in
        # BF16: it is served decoupled, its experts spread over expert workers (issue 15).
        Model(
            "DeepSeek-V3",
            "deepseek-ai/DeepSeek-V3",
            671.0,
            61,
            1,
            288,
            128,
            active_params_b=37.0,
            experts=256,
            experts_per_token=8,
            context_tokens=131072,
            hidden=7168,
        ),
        Model("Qwen3-1.7B", "Qwen/Qwen3-1.7B", 1.7, 28, 8, 128, 16, is_draft=True, context_tokens=40960),
        Model(
            "Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct", 1.2, 16, 8, 64, 32, is_draft=True, context_tokens=131072
        ),
        # A Llama of random weights generated on the machine (harness/real_engine.py) and served by a real
        # llama.cpp server: the real engine of the test suite, where no trained weights can be downloaded.
        Model("Tiny-Llama", "lifeline/tiny-llama", 0.0037, 4, 2, 64, 4, context_tokens=4096),
    )
}

# KV transfer bandwidth by link type, GB/s (source document 003's cost model). RoCE is not in it:
# RoCE v2 on 400 GbE has NDR InfiniBand's 400 Gb/s line rate, and Meta reports its RoCE training
# fabric on par with its InfiniBand one (Gangidi et al., "RDMA over Ethernet for Distributed AI
# Training at Meta Scale", SIGCOMM 2024), so it gets InfiniBand's figure under its own name.
LINK_GBPS = {"nvlink": 900.0, "nvswitch": 600.0, "infiniband": 50.0, "roce": 50.0, "pcie": 28.0, "other": 10.0}
# Latency of one collective over the link (the fixed part of a tensor-parallel all-reduce).
LINK_LATENCY_S = {"nvlink": 8e-6, "nvswitch": 10e-6, "infiniband": 15e-6, "pcie": 25e-6, "other": 50e-6}
# Model load: weights from local NVMe, then the engine's own start (CUDA graphs, allocator).
DISK_GBPS = 5.0
ENGINE_START_S = 10.0
DRAFT_ENGINE_START_S = 2.0
# A link shared with live traffic gives about a third of its bandwidth (REFERENCE.md).
LOADED_LINK_FACTOR = 1 / 3
TP_DEGREES = (1, 2, 4, 8)


class CatalogError(ValueError):
    pass


def gpu(key: str) -> Gpu:
    try:
        return GPUS[key]
    except KeyError:
        raise CatalogError(f"unknown GPU {key!r}: expected one of {', '.join(GPUS)}") from None


def model(key: str) -> Model:
    try:
        return MODELS[key]
    except KeyError:
        raise CatalogError(f"unknown model {key!r}: expected one of {', '.join(MODELS)}") from None


@dataclass(frozen=True)
class Deployment:
    """One serving node: a model on a tensor-parallel group of identical GPUs."""

    model: Model
    gpu: Gpu
    tp: int = 1

    def __post_init__(self):
        if self.tp not in TP_DEGREES:
            raise CatalogError(f"tensor-parallel degree {self.tp} is not supported: expected one of {TP_DEGREES}")
        if self.kv_capacity_bytes <= self.model.kv_bytes_per_block:
            usable = self.gpu.memory_bytes * GPU_MEMORY_UTILIZATION
            fits = [tp for tp in TP_DEGREES if usable * tp - self.model.weight_bytes > self.model.kv_bytes_per_block]
            advice = (
                f"use a tensor-parallel degree of at least {fits[0]}"
                if fits
                else f"it does not fit even on {TP_DEGREES[-1]} of them"
            )
            raise CatalogError(
                f"{self.model.key} ({self.model.weight_bytes / GB:.1f} GB of weights) does not fit on "
                f"{self.tp}x {self.gpu.key}: {advice}"
            )

    @classmethod
    def of(cls, model_key: str, gpu_key: str, tp: int = 1) -> "Deployment":
        return cls(model(model_key), gpu(gpu_key), tp)

    # --- memory --------------------------------------------------------------
    @property
    def kv_capacity_bytes(self) -> int:
        """HBM left for the KV cache: GPU memory minus weights, over the TP group."""
        return int(self.gpu.memory_bytes * GPU_MEMORY_UTILIZATION * self.tp - self.model.weight_bytes)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_capacity_bytes // self.model.kv_bytes_per_token

    @property
    def kv_blocks(self) -> int:
        return self.kv_capacity_bytes // self.model.kv_bytes_per_block

    @property
    def max_context_tokens(self) -> int:
        """The longest sequence this node can hold: the model's context, or less where the KV cache is smaller
        (vLLM will not start with a max_model_len its cache cannot hold; it is lowered to fit)."""
        return min(self.model.context_tokens, self.kv_blocks * BLOCK_TOKENS)

    # --- compute -------------------------------------------------------------
    @property
    def peak_flops(self) -> float:
        return self.gpu.tflops * 1e12 * self.tp

    @property
    def bandwidth(self) -> float:
        return self.gpu.hbm_gbps * GB * self.tp

    def _weight_bytes_read(self, batch: int) -> float:
        """Weight bytes one forward pass streams from HBM for `batch` sequences."""
        m = self.model
        # Dense, or experts without an active count (every parameter active, as `active_params` reads it).
        if not m.experts or m.active_params_b is None:
            return m.weight_bytes
        # MoE: shared weights always, each expert only if some token routes to it.
        touched = 1 - (1 - m.experts_per_token / m.experts) ** max(batch, 1)
        return (m.shared_params_b + m.experts * m.expert_params_b * touched) * 1e9 * BYTES_PER_PARAM

    def _attention_flops(self, query_tokens: int, context_tokens: float) -> float:
        # QK^T and AV: 2 FLOPs each per query head dimension per attended token.
        m = self.model
        return 4 * m.layers * m.q_heads * m.head_dim * query_tokens * context_tokens

    def tp_comm_s(self, tokens: int, link: str | None = None) -> float:
        """Tensor-parallel all-reduces of one forward pass over `tokens` tokens.

        Two per layer, each moving 2(tp-1)/tp of the activations; over NVLink it
        is small, over PCIe (an NVLink down) it is not.
        """
        if self.tp == 1 or tokens <= 0:
            return 0.0
        link = link or self.gpu.link
        hidden_bytes = self.model.q_heads * self.model.head_dim * 2
        per_reduce = tokens * hidden_bytes * 2 * (self.tp - 1) / self.tp
        reduces = 2 * self.model.layers
        return reduces * (per_reduce / (LINK_GBPS[link] * GB) + LINK_LATENCY_S[link])

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One decode step for `batch` sequences holding `context_tokens` in total."""
        if batch <= 0:
            return 0.0
        m = self.model
        flops = 2 * m.active_params * batch + self._attention_flops(1, context_tokens)
        bytes_read = self._weight_bytes_read(batch) + context_tokens * m.kv_bytes_per_token
        return max(
            flops / (self.peak_flops * PREFILL_COMPUTE_EFFICIENCY),
            bytes_read / (self.bandwidth * DECODE_BANDWIDTH_EFFICIENCY),
        )

    def decode_step_times(self, batch: int, contexts: Iterable[int]) -> list[float]:
        """step_s(0, 0, batch, c) for each context c, in one pass: the same operations in the same order, so the
        same floats (the simulator's closed-form decode runs must equal its step-by-step ones to the bit)."""
        if batch <= 0:
            return [self.step_s(0, 0, batch, c) for c in contexts]
        m = self.model
        base_flops = 2 * m.active_params * batch
        per_context = 4 * m.layers * m.q_heads * m.head_dim * 1  # _attention_flops(1, c) is this times c
        flop_rate = self.peak_flops * PREFILL_COMPUTE_EFFICIENCY
        weights = self._weight_bytes_read(batch)
        kv = m.kv_bytes_per_token
        byte_rate = self.bandwidth * DECODE_BANDWIDTH_EFFICIENCY
        comm = self.tp_comm_s(batch)
        return [
            max((base_flops + per_context * c) / flop_rate, (weights + c * kv) / byte_rate) + comm for c in contexts
        ]

    def prefill_s(self, tokens: int, context_before: int = 0) -> float:
        """A prefill chunk of `tokens` new tokens after `context_before` cached ones."""
        if tokens <= 0:
            return 0.0
        m = self.model
        flops = 2 * m.active_params * tokens + self._attention_flops(tokens, context_before + tokens / 2)
        bytes_read = self._weight_bytes_read(tokens) + (context_before + tokens) * m.kv_bytes_per_token
        return max(
            flops / (self.peak_flops * PREFILL_COMPUTE_EFFICIENCY),
            bytes_read / (self.bandwidth * DECODE_BANDWIDTH_EFFICIENCY),
        )

    def step_s(
        self,
        prefill_tokens: int,
        prefill_context: int,
        decode_batch: int,
        decode_context: int,
        tp_link: str | None = None,
    ) -> float:
        """A whole engine step: compute, plus the tensor-parallel all-reduces over `tp_link`."""
        return self.compute_s(prefill_tokens, prefill_context, decode_batch, decode_context) + self.tp_comm_s(
            prefill_tokens + decode_batch, tp_link
        )

    def compute_s(self, prefill_tokens: int, prefill_context: int, decode_batch: int, decode_context: int) -> float:
        """A mixed step (chunked prefill beside decode) shares one weight pass."""
        if prefill_tokens <= 0:
            return self.decode_step_s(decode_batch, decode_context)
        if decode_batch <= 0:
            return self.prefill_s(prefill_tokens, prefill_context)
        m = self.model
        flops = (
            2 * m.active_params * (prefill_tokens + decode_batch)
            + self._attention_flops(prefill_tokens, prefill_context + prefill_tokens / 2)
            + self._attention_flops(1, decode_context)
        )
        bytes_read = (
            self._weight_bytes_read(prefill_tokens + decode_batch)
            + (prefill_context + prefill_tokens + decode_context) * m.kv_bytes_per_token
        )
        return max(
            flops / (self.peak_flops * PREFILL_COMPUTE_EFFICIENCY),
            bytes_read / (self.bandwidth * DECODE_BANDWIDTH_EFFICIENCY),
        )


def load_time_s(
    model_: Model, disk_gbps: float = DISK_GBPS, engine_start_s: float | None = None, weight_bytes: float | None = None
) -> float:
    """Model (re)load: weight bytes (all of the model's unless given) over the disk's bandwidth plus engine start."""
    if engine_start_s is None:
        engine_start_s = DRAFT_ENGINE_START_S if model_.is_draft else ENGINE_START_S
    return (model_.weight_bytes if weight_bytes is None else weight_bytes) / (disk_gbps * GB) + engine_start_s


# The scale-out networks a node can sit on, between hosts and between racks.
NETWORKS = ("infiniband", "roce")


@dataclass(frozen=True)
class Placement:
    """Where a node sits in the fabric, which decides the link its KV takes to another node.

    `server` is the machine whose PCIe bus the node's GPUs share; `nvl_domain` the NVLink
    domain they belong to: the eight GPUs of a DGX H100 inside one server, or the 72 of an
    NVL72 rack across its compute trays. Empty means one of the node's own, which is where a
    node that does not say is placed: alone on its server, reached over `network`, as every
    node was before the fabric was modelled. `nvlink_down`: the node's NVLink has failed (Xid 74;
    on an emulated node, the injected nvlink_down fault), so its traffic takes the next path.
    """

    rack: str
    server: str = ""
    nvl_domain: str = ""
    network: str = "infiniband"
    nvlink_down: bool = False


def node_link(a: Placement, b: Placement, gpu: Gpu) -> tuple[str, float]:
    """(link type, share of its bandwidth) for KV moving between nodes at `a` and `b`, whose GPUs are `gpu`.

    The fastest path the two share, as document 003 picks its link by topology:
    - the same NVLink domain: the GPU's own NVLink (document 003: 900 GB/s effective between
      GPUs of one NVL72 rack, across its trays as inside one server), unless either end's
      NVLink is down, when the path falls back to the next rule (document 003's failure table:
      NVLink failure, PCIe fallback);
    - the same server: PCIe between its GPUs;
    - the same rack: the network through the rack's leaf switch, at full rate;
    - across racks: the network through the spine, which the whole fleet shares, so a third
      of it (REFERENCE.md: a loaded link may give a third).
    InfiniBand and RoCE carry no RDMA between each other: a pair on different networks gets
    the catalog's "other" link.
    """
    nvlink_up = not (a.nvlink_down or b.nvlink_down)
    if nvlink_up and a.nvl_domain and a.nvl_domain == b.nvl_domain and gpu.link != "pcie":
        return gpu.link, 1.0
    if a.server and a.server == b.server:
        return "pcie", 1.0
    network = a.network if a.network == b.network else "other"
    return network, 1.0 if a.rack == b.rack else LOADED_LINK_FACTOR


HOST_TO_GPU_LINK = "pcie"  # a holder's host memory to its own GPUs


def kv_transfer_s(num_bytes: float, link: str, share: float = 1.0) -> float:
    """Time to move `num_bytes` of KV cache over a link of the given type, at `share` of its bandwidth."""
    return num_bytes / (LINK_GBPS.get(link, LINK_GBPS["other"]) * share * GB)


def kv_bytes(model_: Model, tokens: int) -> int:
    return model_.kv_bytes_per_token * tokens
