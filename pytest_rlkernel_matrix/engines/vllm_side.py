"""Rollout in vLLM: an out-of-tree Qwen3 registered through ``ModelRegistry``, R per module.

``RlkQwen3ForCausalLM`` subclasses vLLM's own ``Qwen3ForCausalLM`` (same modules, same weight
loader). It is registered under its own architecture name, either by :func:`register` in the
job process or by vLLM's general-plugin entry point (``vllm.general_plugins`` in
``pyproject.toml``) in a spawned engine process, and selected with
``hf_overrides={"architectures": [ARCH]}``. The route comes from ``RLK_ENGINES_ROLLOUT_IMPLS``
(JSON module -> ``production`` | ``rl_kernel``), read when vLLM builds the model.

- All modules P: ``forward`` and ``compute_logits`` are vLLM's own (stock Qwen3 code path: fused
  residual RMSNorm, vLLM's attention backend and paged KV cache, ``LogitsProcessor``); forward
  pre-hooks only count calls.
- Attention R: per request, the R attention kernel runs on the request's tokens with a key/value
  store indexed by vLLM's own ``slot_mapping`` / ``block_table`` (from the forward context's
  attention metadata), so prefill, chunked prefill and decode all use the scheduler's paging.
- FFN R: the R FFN kernel on the flattened token rows.
- logp R: ``compute_logits`` returns the R kernel's full fp32 log-probabilities; the engine runs
  with ``logprobs_mode="raw_logits"`` so the sampler reports exactly those values (and samples
  from ``softmax`` of them, i.e. the same distribution).
In a mixed route the P modules are vLLM's modules called on the explicit residual stream
(``x + attn(norm(x))``) instead of the fused add+norm; documented in docs/en/engines.md.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import Tensor

from pytest_rlkernel_matrix.workload.kernels.side import MODULES, SideKernels, Tiling
from pytest_rlkernel_matrix.workload.weights import AttnInputs, KVCache, LayerWeights

from .megatron_side import rope_tables

ARCH = "RlkQwen3ForCausalLM"
IMPLS_ENV = "RLK_ENGINES_ROLLOUT_IMPLS"
LIVE: list[Any] = []  # model instances built in this process (the job reads their kernels)


def register() -> None:
    """vLLM general plugin: register the out-of-tree model class (idempotent, lazy import)."""
    from vllm import ModelRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, f"{__name__}:RlkQwen3ForCausalLM")


def _model_class() -> type:
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    class RlkQwen3(Qwen3ForCausalLM):
        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            raw = os.environ.get(IMPLS_ENV) or json.dumps({m: "production" for m in MODULES})
            self.impls: dict[str, str] = json.loads(raw)
            cfg = self.config
            self.vllm_cfg = vllm_config
            self.key_span = int(vllm_config.model_config.max_model_len)
            self.head_dim = int(getattr(cfg, "head_dim", None)
                                or cfg.hidden_size // cfg.num_attention_heads)
            theta = getattr(cfg, "rope_theta", None) or (
                getattr(cfg, "rope_parameters", None) or {})["rope_theta"]
            self.cos, self.sin = rope_tables(self.head_dim, float(theta), self.key_span)
            self.kernels = SideKernels.build(
                "rollout", self.impls, vllm_config.model_config.dtype,
                Tiling.for_device(torch.device("cpu"), self.key_span), cfg.rms_norm_eps)
            self._kv: dict[int, tuple[Tensor, Tensor]] = {}
            self._lw: dict[int, LayerWeights] = {}
            self._w: dict[str, Tensor] = {}
            self.probe_rows: Any = None  # engines.probe.RequestRows while probing
            for layer in self.model.layers:
                if self.impls["attention"] != "rl_kernel":
                    layer.self_attn.register_forward_pre_hook(self._counter("attention"))
                if self.impls["ffn"] != "rl_kernel":
                    layer.mlp.register_forward_pre_hook(self._counter("ffn"))
            LIVE.append(self)

        def _counter(self, module: str) -> Any:
            def hook(*_: Any) -> None:
                self.kernels.module(module).call_count += 1
            return hook

        @property
        def all_production(self) -> bool:
            return all(v != "rl_kernel" for v in self.impls.values())

        # -- weights in HF layout, captured right after vLLM's loader filled the modules ----
        def load_weights(self, weights: Any) -> set[str]:
            """vLLM's own loader, then a copy of the loaded tensors under HF names.

            vLLM's CPU backend prepacks linear weights for its GEMM after loading and drops
            ``.weight``; the R kernels and the weight audit use this copy of what was loaded.
            """
            loaded = super().load_weights(weights)
            cfg, d = self.config, self.head_dim
            hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
            w = {"model.embed_tokens.weight": self.model.embed_tokens.weight,
                 "model.norm.weight": self.model.norm.weight,
                 "lm_head.weight": self.lm_head.weight}
            for i, layer in enumerate(self.model.layers):
                at, mlp, p = layer.self_attn, layer.mlp, f"model.layers.{i}."
                q, k, v = at.qkv_proj.weight.split([hq * d, hkv * d, hkv * d])
                gate, up = mlp.gate_up_proj.weight.chunk(2)
                w.update({
                    p + "input_layernorm.weight": layer.input_layernorm.weight,
                    p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                    p + "self_attn.v_proj.weight": v,
                    p + "self_attn.o_proj.weight": at.o_proj.weight,
                    p + "self_attn.q_norm.weight": at.q_norm.weight,
                    p + "self_attn.k_norm.weight": at.k_norm.weight,
                    p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
                    p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": mlp.down_proj.weight})
            self._w = {n: t.detach().clone().contiguous() for n, t in w.items()}
            return loaded

        def layer_weights(self, i: int) -> LayerWeights:
            if i not in self._lw:
                w, p = self._w, f"model.layers.{i}."
                self._lw[i] = LayerWeights(i, *(w[p + n + ".weight"] for n in (
                    "input_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                    "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
                    "self_attn.k_norm", "post_attention_layernorm", "mlp.gate_proj",
                    "mlp.up_proj", "mlp.down_proj")))
            return self._lw[i]

        def hf_weights(self) -> dict[str, Tensor]:
            """The engine's loaded weights under HF names (rollout-side weight audit)."""
            return dict(self._w)

        # -- forward ---------------------------------------------------------------------
        def forward(self, input_ids: Tensor | None, positions: Tensor,
                    intermediate_tensors: Any = None, inputs_embeds: Tensor | None = None,
                    **kwargs: Any) -> Any:
            tap = self.kernels.tap
            if self.probe_rows is not None and tap is not None and tap.recording:
                self.probe_rows.step(tap, input_ids, positions,
                                     get_forward_context().attn_metadata)
            if self.all_production:
                return super().forward(input_ids, positions, intermediate_tensors,
                                       inputs_embeds, **kwargs)
            x = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            meta = get_forward_context().attn_metadata
            for i, layer in enumerate(self.model.layers):
                if self.impls["attention"] == "rl_kernel":
                    a = self._r_attention(i, x, positions, meta)
                else:
                    a = layer.self_attn(positions, layer.input_layernorm(x))
                x = x + a
                if self.impls["ffn"] == "rl_kernel":
                    f = self.kernels.ffn(x[None], self.layer_weights(i))[0]
                else:
                    f = layer.mlp(layer.post_attention_layernorm(x))
                x = x + f
            return x if self.impls["logp"] == "rl_kernel" else self.model.norm(x)

        def compute_logits(self, hidden_states: Tensor) -> Tensor | None:
            tap = self.kernels.tap
            if self.probe_rows is not None and tap is not None and tap.recording:
                keys = self.probe_rows.logit_keys  # each request's last row of the step
                if len(keys) != int(hidden_states.shape[0]):
                    raise RuntimeError(f"probe: {hidden_states.shape[0]} logit rows, the step "
                                       f"has {len(keys)} requests")
                tap.rows(keys)
            if self.impls["logp"] == "rl_kernel":
                return self.kernels.logp.full(hidden_states, self._w["model.norm.weight"],
                                              self._w["lm_head.weight"], 1.0)
            self.kernels.logp.call_count += 1
            return super().compute_logits(hidden_states)

        def _store(self, i: int, need: int, hkv: int, d: int,
                   dtype: torch.dtype) -> tuple[Tensor, Tensor]:
            k, v = self._kv.get(i, (None, None))
            if k is None or k.shape[0] < need:
                cap = max(1024, 1 << (need - 1).bit_length())
                nk, nv = (torch.zeros(cap, hkv, d, dtype=dtype) for _ in range(2))
                if k is not None:
                    nk[:k.shape[0]], nv[:v.shape[0]] = k, v
                self._kv[i] = (nk, nv)
            return self._kv[i]

        def _r_attention(self, i: int, x: Tensor, positions: Tensor, meta: Any) -> Tensor:
            lw = self.layer_weights(i)
            if meta is None:  # profiling / dummy run: no requests, no cache
                return torch.zeros_like(x)
            if not isinstance(meta, dict):
                raise RuntimeError(f"R attention: unsupported attention metadata {type(meta)}")
            m = meta[f"model.layers.{i}.self_attn.attn"]
            bs = int(self.vllm_cfg.cache_config.block_size)
            hkv, d = lw.k_proj.shape[0] // self.head_dim, self.head_dim
            n = int(m.num_actual_tokens)
            qsl, seq = m.query_start_loc.tolist(), m.seq_lens.tolist()
            slots = m.slot_mapping[:n].long()
            store_k, store_v = self._store(i, int(slots.max()) + 1, hkv, d, x.dtype)
            out = torch.zeros_like(x)
            tap = self.kernels.tap
            rows = self.probe_rows if tap is not None and tap.recording else None
            for r, total in enumerate(seq):
                s0, s1 = qsl[r], qsl[r + 1]
                if s1 <= s0:
                    continue
                start = int(total) - (s1 - s0)
                cache = KVCache(x.new_zeros(1, self.key_span, hkv, d),
                                x.new_zeros(1, self.key_span, hkv, d))
                if start > 0:
                    p = torch.arange(start)
                    old = m.block_table[r, p // bs].long() * bs + p % bs
                    cache.k[0, :start], cache.v[0, :start] = store_k[old], store_v[old]
                pos = positions[s0:s1].long()
                if rows is not None:  # this request's rows only
                    tap.rows(rows.keys[s0:s1])
                o = self.kernels.attention(
                    x[s0:s1][None], lw, AttnInputs(pos[None], self.cos[pos][None],
                                                   self.sin[pos][None], cache))
                store_k[slots[s0:s1]], store_v[slots[s0:s1]] = cache.k[0, pos], cache.v[0, pos]
                out[s0:s1] = o[0]
            if rows is not None:
                tap.rows(rows.keys)
            return out

    RlkQwen3.__name__ = RlkQwen3.__qualname__ = ARCH
    return RlkQwen3


def __getattr__(name: str) -> Any:  # lazy: importing this module never imports vLLM
    if name == ARCH:
        cls = _model_class()
        globals()[ARCH] = cls
        return cls
    raise AttributeError(name)
