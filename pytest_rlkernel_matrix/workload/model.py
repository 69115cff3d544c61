"""Qwen3-architecture decoder used by the reference workload.

One readable file: RMSNorm, RoPE, grouped-query attention with q/k RMSNorm, SwiGLU MLP and an
untied LM head. The weights live in a flat ``dict`` keyed by Hugging Face Qwen3 names
(``model.layers.0.self_attn.q_proj.weight``...), so a checkpoint directory loads as-is and the
rollout engine can hold its own copy of the same dict. The math of each module is not here: the
forward takes a per-side ``kernels`` object (see ``kernels/``) that picks the P or R
implementation of attention, FFN and selected-token logp.

Tensor parallelism is a view of the same dict: ``shard_weights`` cuts it Megatron-style
(column-parallel q/k/v and gate/up by rows, row-parallel o/down by columns, vocab-parallel LM
head), and the forward adds each row-parallel output to the residual through
``kernels.reduce_add`` (which all-reduces the partial sums first). Context parallelism passes
``kv_gather``: local query rows attend to the keys/values of every CP rank.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from pytest_rlkernel_matrix.workload.kernels.side import SideKernels
from pytest_rlkernel_matrix.workload.weights import AttnInputs, KVCache, LayerWeights


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters (Hugging Face ``config.json`` names)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    eos_token_id: int = 1

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (unknown keys ignored)."""
        names = {f.name for f in fields(cls)}
        kept = {k: v for k, v in cfg.items() if k in names}
        if "head_dim" not in kept:
            kept["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
        if isinstance(kept.get("eos_token_id"), list):
            kept["eos_token_id"] = kept["eos_token_id"][0]
        return cls(**kept)

    def to_hf(self) -> dict:
        """The ``config.json`` dict for this config."""
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **asdict(self)}


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(128, 2, 4, 2, 32, 256, 512),
    "small": ModelConfig(256, 4, 8, 4, 32, 768, 4096),
    "qwen3-0.6b": ModelConfig(1024, 28, 16, 8, 128, 3072, 151936, eos_token_id=151645),
}


def weight_names(cfg: ModelConfig) -> list[str]:
    """All parameter names of the model, in Hugging Face Qwen3 spelling."""
    names = ["model.embed_tokens.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + n for n in (
            "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
            "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
            "self_attn.k_norm.weight", "post_attention_layernorm.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
    return [*names, "model.norm.weight", "lm_head.weight"]


def init_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype,
                 device: torch.device) -> dict[str, Tensor]:
    """Deterministic random init from ``seed`` (normal(0, 0.02) matrices, norms near 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    shapes = {
        "embed_tokens": (cfg.vocab_size, h), "q_proj": (hq * d, h), "k_proj": (hkv * d, h),
        "v_proj": (hkv * d, h), "o_proj": (h, hq * d), "gate_proj": (cfg.intermediate_size, h),
        "up_proj": (cfg.intermediate_size, h), "down_proj": (h, cfg.intermediate_size),
        "lm_head": (cfg.vocab_size, h), "q_norm": (d,), "k_norm": (d,),
        "input_layernorm": (h,), "post_attention_layernorm": (h,), "norm": (h,),
    }
    out: dict[str, Tensor] = {}
    for name in weight_names(cfg):
        shape = shapes[name.split(".")[-2]]
        w = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        w = 1.0 + 0.1 * w if len(shape) == 1 else 0.02 * w
        if name == "lm_head.weight":
            w = w * 4.0  # sharper next-token distribution than a flat random init
        out[name] = w.to(dtype)
    return out


def checkpoint_fingerprint(path: str | Path) -> str:
    """Fingerprint a Hugging Face checkpoint directory.

    Method: sha256 over the bytes of ``config.json``, then for every ``*.safetensors`` file in
    sorted name order: the file name (utf-8), a NUL byte, the decimal file size, a NUL byte, and
    the file contents. Returned as ``sha256:<hex>``.
    """
    root = Path(path)
    h = hashlib.sha256((root / "config.json").read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        h.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def load_checkpoint(path: str | Path, dtype: torch.dtype,
                    device: torch.device) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Load ``config.json`` + ``*.safetensors`` (HF Qwen3 key names) from a directory."""
    from safetensors.torch import load_file

    root = Path(path)
    cfg = ModelConfig.from_hf(json.loads((root / "config.json").read_text()))
    raw: dict[str, Tensor] = {}
    for f in sorted(root.glob("*.safetensors")):
        raw.update(load_file(str(f)))
    if "lm_head.weight" not in raw:  # tied checkpoint: untie by copying the embedding
        raw["lm_head.weight"] = raw["model.embed_tokens.weight"].clone()
    missing = [n for n in weight_names(cfg) if n not in raw]
    if missing:
        raise ValueError(f"checkpoint {root} lacks {len(missing)} weights, e.g. {missing[:3]}")
    return cfg, {n: raw[n].to(device=device, dtype=dtype) for n in weight_names(cfg)}


def shard_weights(cfg: ModelConfig, weights: dict[str, Tensor], tp: int,
                  rank: int) -> dict[str, Tensor]:
    """This TP rank's slice of a full weight dict (Megatron/vLLM layout, HF names kept).

    Column-parallel (output rows): q/k/v by heads, gate/up by intermediate rows; row-parallel
    (input columns): o_proj by q heads, down_proj by intermediate columns; vocab-parallel LM head.
    Embedding and norms are replicated.
    """
    if tp == 1:
        return weights
    for what, n in (("attention heads", cfg.num_attention_heads),
                    ("key/value heads", cfg.num_key_value_heads),
                    ("intermediate size", cfg.intermediate_size), ("vocab size", cfg.vocab_size)):
        if n % tp:
            raise ValueError(f"tp={tp} does not divide the {what} ({n})")

    def rows(w: Tensor) -> Tensor:
        n = w.shape[0] // tp
        return w[rank * n:(rank + 1) * n].contiguous()

    def cols(w: Tensor) -> Tensor:
        n = w.shape[1] // tp
        return w[:, rank * n:(rank + 1) * n].contiguous()

    out: dict[str, Tensor] = {}
    for name, w in weights.items():
        leaf = name.split(".")[-2]
        if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"):
            out[name] = rows(w)
        elif leaf in ("o_proj", "down_proj"):
            out[name] = cols(w)
        else:
            out[name] = w
    return out


def weights_sha256(weights: dict[str, Tensor]) -> str:
    """sha256 over sorted (name, dtype, shape, raw bytes) of a weight dict: the weight version."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class Qwen3:
    """Qwen3 decoder over a flat HF-named weight dict; math delegated to a ``SideKernels``."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, Tensor], max_seq_len: int) -> None:
        self.cfg = cfg
        self.weights = weights
        self.max_seq_len = max_seq_len
        self.layers = [self._layer(i) for i in range(cfg.num_hidden_layers)]
        dev = weights["model.embed_tokens.weight"].device
        inv_freq = 1.0 / (cfg.rope_theta ** (
            torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device=dev) / cfg.head_dim))
        freqs = torch.arange(max_seq_len, dtype=torch.float64, device=dev)[:, None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        self.rope_cos, self.rope_sin = emb.cos().float(), emb.sin().float()

    def _layer(self, i: int) -> LayerWeights:
        w, p = self.weights, f"model.layers.{i}."
        return LayerWeights(
            i, w[p + "input_layernorm.weight"], w[p + "self_attn.q_proj.weight"],
            w[p + "self_attn.k_proj.weight"], w[p + "self_attn.v_proj.weight"],
            w[p + "self_attn.o_proj.weight"], w[p + "self_attn.q_norm.weight"],
            w[p + "self_attn.k_norm.weight"], w[p + "post_attention_layernorm.weight"],
            w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
            w[p + "mlp.down_proj.weight"])

    def new_cache(self, batch: int) -> list[KVCache]:
        """Zero-filled KV caches (one per layer) with capacity ``max_seq_len``."""
        c = self.cfg
        w = self.weights["model.embed_tokens.weight"]
        kv_heads = self.layers[0].k_proj.shape[0] // c.head_dim  # this rank's heads under TP
        shape = (batch, self.max_seq_len, kv_heads, c.head_dim)
        return [KVCache(w.new_zeros(shape), w.new_zeros(shape)) for _ in self.layers]

    def hidden(self, kernels: SideKernels, tokens: Tensor, positions: Tensor,
               caches: list[KVCache] | None, span: int | None = None,
               kv_gather: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
               ) -> Tensor:
        """Final hidden states ``[B, T, H]`` (before the final norm) for ``tokens [B, T]``.

        ``span`` (keys in use, decode only) defaults to ``max(positions) + 1``, a host sync;
        a graph-captured decode step passes a fixed one.
        """
        x = kernels.out("model.embed_tokens", self.weights["model.embed_tokens.weight"][tokens])
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        if span is None:
            span = int(positions.max()) + 1 if caches is not None else 0
        for layer in self.layers:
            cache = None if caches is None else caches[layer.index]
            inp = AttnInputs(positions, cos, sin, cache, span, kv_gather)
            x = kernels.reduce_add(x, kernels.attention(x, layer, inp))
            x = kernels.reduce_add(x, kernels.ffn(x, layer))
        return x

    def decode_step(self, kernels: SideKernels, tokens: Tensor, positions: Tensor,
                    caches: list[KVCache], temperature: float, span: int = 0) -> Tensor:
        """One decode step with no host sync (graph-capturable).

        Tokens ``[B]`` at positions ``[B]`` -> fp32 log-probabilities ``[B, V]`` of the next
        token; keys span ``span`` positions of the cache (default: the whole cache).
        """
        h = self.hidden(kernels, tokens[:, None], positions[:, None], caches,
                        span=span or self.max_seq_len)[:, 0]
        return self.logprobs(kernels, h, temperature)

    def logprobs(self, kernels: SideKernels, hidden: Tensor, temperature: float) -> Tensor:
        """Full-vocabulary fp32 log-probabilities ``[N, V]`` for hidden rows ``[N, H]``."""
        return kernels.logp.full(hidden, self.weights["model.norm.weight"],
                                 self.weights["lm_head.weight"], temperature)

    def selected_logprobs(self, kernels: SideKernels, hidden: Tensor, targets: Tensor,
                          temperature: float) -> Tensor:
        """fp32 log-probability ``[N]`` of ``targets [N]`` under hidden rows ``[N, H]``."""
        return kernels.logp.selected(hidden, self.weights["model.norm.weight"],
                                     self.weights["lm_head.weight"], targets, temperature)
