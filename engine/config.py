"""Engine configuration: the model's geometry (from ``config.json``) and the engine's own options.

Both are frozen dataclasses validated where they are built; the CLI builds one ``EngineConfig`` and
every rank of a tensor-parallel group gets its own copy (with its own ``tp_rank``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
WEIGHT_SOURCES = ("cache", "disk", "auto")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_BLOCK_SIZE = 16  # positions per KV block, by default


def kv_block_bytes(layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: str) -> int:
    """Bytes of one KV block (keys and values of ``block_size`` positions, every layer), per rank.
    Torch-free, so the supervisor sizes pools with the engine's own arithmetic."""
    return 2 * layers * kv_heads * block_size * head_dim * DTYPE_BYTES[dtype]
TRANSFORMS = ("none", "fp8-block")
ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


class ConfigError(ValueError):
    """A bad option or an unsupported model config; the message says which field and what to do."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": ..., "factor": ..., ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ConfigError(f"model_type {self.arch!r} is not supported; supported: {', '.join(ARCHS)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_scaling type {self.rope_type!r} is not supported; "
                              f"supported: {', '.join(ROPE_TYPES)}")

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def context_len(self) -> int:
        """Longest sequence the engine serves: the model's positions, capped by a sliding window
        (attention here is full, so a window shorter than the context would change the outputs)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def served_len(self, max_model_len: int | None) -> int:
        """The context an engine serves: ``--max-model-len`` capped by the model's."""
        return min(max_model_len or self.context_len, self.context_len)

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {path}: {e}; --model must name a Hugging Face model dir") from e
        return cls.from_hf(raw, _generation_eos(Path(model_dir)))

    @classmethod
    def from_hf(cls, raw: dict, extra_eos: tuple[int, ...] = ()) -> ModelConfig:
        arch = raw.get("model_type", "")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        heads = raw["num_attention_heads"]
        # transformers 5 writes rope_parameters (theta inside); older configs rope_theta + rope_scaling
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        window = raw.get("sliding_window")
        if arch in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
            window = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return cls(
            arch=arch,
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=arch != "qwen2" and bool(raw.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            sliding_window=window,
            eos_token_ids=tuple(dict.fromkeys(eos_ids + extra_eos)),
        )


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    try:
        eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return ()
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: Path
    weights: str = "auto"
    socket: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    tp: int = 1
    tp_rank: int = 0
    dist_init: str = ""  # tcp://host:port of rank 0's rendezvous; set for tp > 1
    device: str = "cpu"
    dtype: str = "float32"
    transform: str = "none"
    kv_memory: int = 256 << 20
    kv_min_memory: int | None = None  # the pool's floor; None: one sequence of the longest context
    kv_block_size: int = KV_BLOCK_SIZE  # positions per KV block
    max_batch: int = 16
    max_model_len: int | None = None
    served_model_name: str = ""
    drain_timeout: float = 30.0
    max_body_bytes: int = 4 << 20
    admin_token_file: Path | None = None  # guards POST /admin/kv; None: admin calls get 403
    warmup_batch: int = 1  # sequences of the warm-up wave before /ready (LLMEngine.warmup)
    cudnn_attention: bool = False  # cuDNN SDPA: faster steady decode, a slow first use of each shape
    cuda_graphs: bool = True  # CUDA, tp 1: decode graphs captured per batch bucket after /ready
    prefill_chunk: int = 512  # prompt tokens prefilled per step while others decode (0: no chunking)
    # CUDA graphs: rows of the largest step graph; a step whose prefill tokens and decode rows fit
    # runs as one graph replay, each prompt token a row (engine.cuda_graphs); 0: prefill eagerly
    graph_tokens: int = 256
    # torch's intra-op threads in this process (0: torch's default, one per core). Engines that
    # compute at once on one CPU node must not ask for more than its cores together: a step's
    # threads meet at a barrier after every op, and one thread descheduled for another engine's
    # holds back the rest (measured: docs/operations.md, "CPU threads")
    cpu_threads: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.weights in WEIGHT_SOURCES, f"--weights must be one of {', '.join(WEIGHT_SOURCES)}"),
            (self.weights != "cache" or self.socket is not None, "--weights cache needs --socket PATH"),
            (self.tp >= 1, "--tp must be at least 1"),
            (0 <= self.tp_rank < self.tp, "tp_rank must be in [0, tp)"),
            (self.device in ("cpu", "cuda"), "--device must be cpu or cuda"),
            (self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}"),
            (self.transform in TRANSFORMS, f"--transform must be one of {', '.join(TRANSFORMS)}"),
            (self.kv_memory > 0, "--kv-memory must be positive"),
            (self.kv_min_memory is None or 0 < self.kv_min_memory <= self.kv_memory,
             "--kv-min-memory must be positive and at most --kv-memory"),
            (self.kv_block_size >= 1, "--kv-block-size must be at least 1"),
            (self.max_batch >= 1, "--max-batch must be at least 1"),
            (self.prefill_chunk >= 0, "--prefill-chunk must not be negative (0: whole prompts)"),
            (self.graph_tokens >= 0, "--graph-tokens must not be negative (0: prefill eagerly)"),
            (self.cpu_threads >= 0, "--cpu-threads must not be negative (0: torch's default)"),
            (1 <= self.warmup_batch <= self.max_batch,
             "--warmup-batch must be in 1..--max-batch"),
            (self.max_model_len is None or self.max_model_len >= 2, "--max-model-len must be at least 2"),
            (self.drain_timeout >= 0, "--drain-timeout must not be negative"),
            (0 < self.port < 65536, "--port must be in 1..65535"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def for_rank(self, rank: int) -> EngineConfig:
        return replace(self, tp_rank=rank)
