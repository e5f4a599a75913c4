"""The decoder of the Llama / Qwen2 / Qwen3 / Mistral family, tensor-parallel, in Hugging Face names.

The module tree mirrors the checkpoint's names (``model.layers.{i}.self_attn.q_proj.weight``, ...)
so a rank's weights dict (from disk or mapped from the daemon) is assigned as is: the model is built
on the meta device and ``load_state_dict(assign=True)`` makes each parameter the very tensor of the
dict (no copy). Those tensors may be read-only mappings shared with other engines: the model never
writes to them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.kv_cache import AttentionBatch, KVPool
from engine.fused import silu_mul
from engine.fusion import spanning_view
from engine.layers import Linear, RMSNorm, RopeAt, Rotary, RowParallelLinear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, fp8: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.head_dim
        d, q, kv = cfg.hidden_size, self.heads * cfg.head_dim, self.kv_heads * cfg.head_dim
        self.q_proj = Linear(d, q, cfg.qkv_bias, fp8)
        self.k_proj = Linear(d, kv, cfg.qkv_bias, fp8)
        self.v_proj = Linear(d, kv, cfg.qkv_bias, fp8)
        self.o_proj = RowParallelLinear(q, d, cfg.o_bias, fp8, tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (weight, bias): fuse()

    def fuse(self) -> bool:
        """Run q/k/v as one GEMM when their weights lie back to back (``engine.fusion``)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weight = None if self.q_proj.fp8 else spanning_view([p.weight for p in projections])
        if weight is None:
            return False
        bias = None
        if self.q_proj.bias is not None:
            biases = [p.bias for p in projections]
            bias = spanning_view(biases)
            bias = torch.cat(biases) if bias is None else bias
        self.qkv = (weight, bias)
        return True

    def forward(self, x, rope: RopeAt, layer: int, kv: KVPool, batch: AttentionBatch) -> torch.Tensor:
        b, t, _ = x.shape
        if self.qkv is not None:
            nq, nkv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            q, k, v = F.linear(x, *self.qkv).split((nq, nkv, nkv), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, self.heads, self.head_dim)
        k = k.view(b, t, self.kv_heads, self.head_dim)
        v = v.view(b, t, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if batch.rotating:  # CUDA decode: RoPE and the K/V store in one kernel
            o = kv.attend_rotating(layer, q, k, v, rope, batch)
        else:
            q, k = rope(q), rope(k)
            # [B, T, H, D] -> [B, H, T, D] for attention
            o = kv.attend(layer, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), batch)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, fp8: bool) -> None:
        super().__init__()
        d, i = cfg.hidden_size, cfg.intermediate_size // tp
        self.gate_proj = Linear(d, i, False, fp8)
        self.up_proj = Linear(d, i, False, fp8)
        self.down_proj = RowParallelLinear(i, d, False, fp8, tp)
        self.gate_up: torch.Tensor | None = None  # fuse()

    def fuse(self) -> bool:
        """Run gate/up as one GEMM when their weights lie back to back (``engine.fusion``)."""
        if not self.gate_proj.fp8:
            self.gate_up = spanning_view([self.gate_proj.weight, self.up_proj.weight])
        return self.gate_up is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
            return self.down_proj(silu_mul(gate, up))
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, fp8: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp, fp8)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp, fp8)

    def forward(self, x, residual, rope, layer, kv, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the add of the two is the next
        norm's (fused into it on CUDA); ``residual`` None for the first layer."""
        h, residual = self.input_layernorm(x, residual) if residual is not None else (self.input_layernorm(x), x)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, layer, kv, batch), residual)
        return self.mlp(h), residual


class Embedding(nn.Module):
    # not nn.Embedding: its random init costs ~1.5 s even on the meta device
    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, fp8: bool) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, fp8) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """``forward`` gives the last hidden states; ``logits`` the float32 logits of chosen rows."""

    def __init__(self, cfg: ModelConfig, tp: int = 1, fp8: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg, tp, fp8)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, fp8=False)
        self.rotary: Rotary | None = None

    @classmethod
    def skeleton(cls, cfg: ModelConfig, tp: int, fp8: bool) -> CausalLM:
        """The module tree on the meta device, without weights (CPU only: a zygote may build it
        before it forks, ``engine.prepared``)."""
        with torch.device("meta"):
            model = cls(cfg, tp, fp8)
        return model.requires_grad_(False)

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, tp: int, fp8: bool,
                     max_len: int, device) -> CausalLM:
        """Build on the meta device, then make every parameter the tensor of ``weights`` (no copy)."""
        model = cls.skeleton(cfg, tp, fp8)
        model.assign(weights)
        model.fuse()
        model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_len, device)
        return model.eval()

    def assign(self, weights: dict[str, torch.Tensor]) -> None:
        """Make every parameter of this (meta-device) model the very tensor of ``weights``."""
        weights = dict(weights)
        if "lm_head.weight" not in weights and self.cfg.tie_word_embeddings:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        expected = set(self.state_dict())
        missing, unexpected = expected - set(weights), set(weights) - expected
        if missing or unexpected:
            raise ValueError(f"weights do not match the {self.cfg.arch} config: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        self.load_state_dict(weights, strict=True, assign=True)

    def fuse(self) -> tuple[int, int]:
        """Fuse every layer's projections whose weights allow it (``engine.fusion``); returns how many
        layers' q/k/v and gate/up now run as one GEMM each."""
        layers = self.model.layers
        return (sum(layer.self_attn.fuse() for layer in layers), sum(layer.mlp.fuse() for layer in layers))

    def forward(self, tokens: torch.Tensor, kv: KVPool, batch: AttentionBatch) -> torch.Tensor:
        # tokens [B, T] -> hidden [B, T, hidden]
        x = self.model.embed_tokens(tokens)
        rope, residual = self.rotary(batch.positions, x.dtype), None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, rope, i, kv, batch)
        return self.model.norm(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
