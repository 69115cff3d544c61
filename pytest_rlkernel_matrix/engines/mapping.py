"""Hugging Face Qwen3 <-> Megatron-core ``GPTModel`` (local layer spec) weight mapping.

Pure torch, no Megatron import, so it is unit-tested without the ``[engines]`` extra.

Per layer ``i`` (``L = decoder.layers.i.``), for a module on the **P** path (Megatron's own):

=====================================  ===============================================
Hugging Face                           Megatron-core
=====================================  ===============================================
``model.embed_tokens.weight``          ``embedding.word_embeddings.weight``
``...input_layernorm.weight``          ``L input_layernorm.weight``
``...self_attn.{q,k,v}_proj.weight``   ``L self_attention.linear_qkv.weight``: per query
                                       group ``j``: ``[q heads of j; k head j; v head j]``
``...self_attn.o_proj.weight``         ``L self_attention.linear_proj.weight``
``...self_attn.{q,k}_norm.weight``     ``L self_attention.{q,k}_layernorm.weight``
``...post_attention_layernorm.weight`` ``L pre_mlp_layernorm.weight``
``...mlp.{gate,up}_proj.weight``       ``L mlp.linear_fc1.weight`` = ``[gate; up]``
``...mlp.down_proj.weight``            ``L mlp.linear_fc2.weight``
``model.norm.weight``                  ``decoder.final_layernorm.weight``
``lm_head.weight``                     ``output_layer.weight``
=====================================  ===============================================

A module on the **R** path is an RL-Kernel module plugged in through ``ModuleSpec`` that owns
its weights in Hugging Face layout (the R kernels fuse them themselves), so its tensors keep the
Hugging Face leaf names under the Megatron submodule: attention R -> ``L self_attention.<leaf>``
for the seven attention tensors including ``input_layernorm`` (the spec's own input norm is
``IdentityOp``); FFN R -> ``L mlp.<leaf>`` including ``post_attention_layernorm``; logp R ->
``logp_head.{norm,lm_head}.weight`` (the model is built with ``post_process=False`` and the head
does final norm + LM head + log-softmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ATTN_LEAVES = ("input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
FFN_LEAVES = ("post_attention_layernorm", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shape:
    """What the mapping needs of the architecture."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf(cls, cfg: dict) -> Shape:
        return cls(cfg["num_hidden_layers"], cfg["num_attention_heads"],
                   cfg["num_key_value_heads"],
                   cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _hf_attn(i: int, leaf: str) -> str:
    if leaf in ("input_layernorm",):
        return f"model.layers.{i}.input_layernorm.weight"
    return f"model.layers.{i}.self_attn.{leaf}.weight"


def _hf_ffn(i: int, leaf: str) -> str:
    if leaf == "post_attention_layernorm":
        return f"model.layers.{i}.post_attention_layernorm.weight"
    return f"model.layers.{i}.mlp.{leaf}.weight"


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, s: Shape) -> Tensor:
    """Megatron's grouped QKV layout from HF's separate q/k/v projections."""
    d, ng = s.head_dim, s.num_kv_heads
    g = s.num_heads // ng
    h = q.shape[-1]
    qg = q.reshape(ng, g * d, h)
    return torch.cat([qg, k.reshape(ng, d, h), v.reshape(ng, d, h)], dim=1).reshape(-1, h)


def split_qkv(w: Tensor, s: Shape) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    d, ng = s.head_dim, s.num_kv_heads
    g = s.num_heads // ng
    h = w.shape[-1]
    grouped = w.reshape(ng, (g + 2) * d, h)
    q, k, v = grouped.split([g * d, d, d], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def hf_to_megatron(hf: dict[str, Tensor], s: Shape, impls: dict[str, str]) -> dict[str, Tensor]:
    """HF state dict -> Megatron state dict for the route ``impls`` (module -> implementation)."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for i in range(s.num_layers):
        p = f"decoder.layers.{i}."
        if impls["attention"] == "rl_kernel":
            for leaf in ATTN_LEAVES:
                out[f"{p}self_attention.{leaf}.weight"] = hf[_hf_attn(i, leaf)]
        else:
            out[p + "input_layernorm.weight"] = hf[_hf_attn(i, "input_layernorm")]
            out[p + "self_attention.linear_qkv.weight"] = fuse_qkv(
                hf[_hf_attn(i, "q_proj")], hf[_hf_attn(i, "k_proj")], hf[_hf_attn(i, "v_proj")], s)
            out[p + "self_attention.linear_proj.weight"] = hf[_hf_attn(i, "o_proj")]
            out[p + "self_attention.q_layernorm.weight"] = hf[_hf_attn(i, "q_norm")]
            out[p + "self_attention.k_layernorm.weight"] = hf[_hf_attn(i, "k_norm")]
        if impls["ffn"] == "rl_kernel":
            for leaf in FFN_LEAVES:
                out[f"{p}mlp.{leaf}.weight"] = hf[_hf_ffn(i, leaf)]
        else:
            out[p + "pre_mlp_layernorm.weight"] = hf[_hf_ffn(i, "post_attention_layernorm")]
            out[p + "mlp.linear_fc1.weight"] = torch.cat(
                [hf[_hf_ffn(i, "gate_proj")], hf[_hf_ffn(i, "up_proj")]])
            out[p + "mlp.linear_fc2.weight"] = hf[_hf_ffn(i, "down_proj")]
    if impls["logp"] == "rl_kernel":
        out["logp_head.norm.weight"] = hf["model.norm.weight"]
        out["logp_head.lm_head.weight"] = hf["lm_head.weight"]
    else:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def megatron_to_hf(mg: dict[str, Tensor], s: Shape, impls: dict[str, str]) -> dict[str, Tensor]:
    """Inverse of :func:`hf_to_megatron` (used for the training side's weight audit)."""
    out = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"]}
    for i in range(s.num_layers):
        p = f"decoder.layers.{i}."
        if impls["attention"] == "rl_kernel":
            for leaf in ATTN_LEAVES:
                out[_hf_attn(i, leaf)] = mg[f"{p}self_attention.{leaf}.weight"]
        else:
            out[_hf_attn(i, "input_layernorm")] = mg[p + "input_layernorm.weight"]
            q, k, v = split_qkv(mg[p + "self_attention.linear_qkv.weight"], s)
            out[_hf_attn(i, "q_proj")], out[_hf_attn(i, "k_proj")] = q, k
            out[_hf_attn(i, "v_proj")] = v
            out[_hf_attn(i, "o_proj")] = mg[p + "self_attention.linear_proj.weight"]
            out[_hf_attn(i, "q_norm")] = mg[p + "self_attention.q_layernorm.weight"]
            out[_hf_attn(i, "k_norm")] = mg[p + "self_attention.k_layernorm.weight"]
        if impls["ffn"] == "rl_kernel":
            for leaf in FFN_LEAVES:
                out[_hf_ffn(i, leaf)] = mg[f"{p}mlp.{leaf}.weight"]
        else:
            out[_hf_ffn(i, "post_attention_layernorm")] = mg[p + "pre_mlp_layernorm.weight"]
            gate, up = mg[p + "mlp.linear_fc1.weight"].chunk(2)
            out[_hf_ffn(i, "gate_proj")], out[_hf_ffn(i, "up_proj")] = gate, up
            out[_hf_ffn(i, "down_proj")] = mg[p + "mlp.linear_fc2.weight"]
    if impls["logp"] == "rl_kernel":
        out["model.norm.weight"] = mg["logp_head.norm.weight"]
        out["lm_head.weight"] = mg["logp_head.lm_head.weight"]
    else:
        out["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
        out["lm_head.weight"] = mg["output_layer.weight"]
    return out


def as_checkpoint_dtype(weights: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """Cast to the checkpoint dtype for the audit, refusing any cast that loses bits.

    Megatron keeps some norm weights in fp32; they were loaded from bf16, so the cast back is
    exact. A value that does not survive the round trip is reported, never rounded away.
    """
    out = {}
    for name, t in weights.items():
        c = t.detach().to(dtype)
        if not torch.equal(c.to(t.dtype), t.detach()):
            raise ValueError(f"weight {name}: {t.dtype} value not representable in {dtype}")
        out[name] = c
    return out


# -- probe operators (issue 21): Hugging Face Qwen3 module paths <-> the engines' modules ------
#
# Each probe operator is named by its HF module path (``workload/evidence/probe.py``,
# ``LAYER_OPS``). On a
# P path it is read from the engine's own module, at the path below (per layer, relative to
# ``model.layers.{i}.`` in vLLM and ``decoder.layers.{i}.`` in Megatron-core), as:
#   "out": the module's output (``[0]`` of an ``(output, bias)`` or ``(normed, residual)`` pair);
#   "qkv:<n>": the fused QKV output, piece n (0 q, 1 k, 2 v): vLLM ``[q | k | v]``, Megatron
#   interleaved per query group (:func:`split_qkv_out`); "half:<n>": ``[gate | up]``, piece n;
#   "input": the first argument of the module (a forward pre-hook: Megatron's activation is a
#   function inside ``MLP``, read as ``linear_fc2``'s input).

VLLM_OPS = {
    "input_layernorm": ("input_layernorm", "out"),
    "self_attn.q_proj": ("self_attn.qkv_proj", "qkv:0"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "qkv:1"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "qkv:2"),
    "self_attn.q_norm": ("self_attn.q_norm", "out"),
    "self_attn.k_norm": ("self_attn.k_norm", "out"),
    "self_attn.attn": ("self_attn.attn", "out"),
    "self_attn.o_proj": ("self_attn.o_proj", "out"),
    "post_attention_layernorm": ("post_attention_layernorm", "out"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "half:0"),
    "mlp.up_proj": ("mlp.gate_up_proj", "half:1"),
    "mlp.act_fn": ("mlp.act_fn", "out"),
    "mlp.down_proj": ("mlp.down_proj", "out"),
}
MEGATRON_OPS = {
    "input_layernorm": ("input_layernorm", "out"),
    "self_attn.q_proj": ("self_attention.linear_qkv", "qkv:0"),
    "self_attn.k_proj": ("self_attention.linear_qkv", "qkv:1"),
    "self_attn.v_proj": ("self_attention.linear_qkv", "qkv:2"),
    "self_attn.q_norm": ("self_attention.q_layernorm", "out"),
    "self_attn.k_norm": ("self_attention.k_layernorm", "out"),
    "self_attn.attn": ("self_attention.core_attention", "out"),
    "self_attn.o_proj": ("self_attention.linear_proj", "out"),
    "post_attention_layernorm": ("pre_mlp_layernorm", "out"),
    "mlp.gate_proj": ("mlp.linear_fc1", "half:0"),
    "mlp.up_proj": ("mlp.linear_fc1", "half:1"),
    "mlp.act_fn": ("mlp.linear_fc2", "input"),
    "mlp.down_proj": ("mlp.linear_fc2", "out"),
}
# outside the layers: HF name -> (vLLM module, Megatron module); lm_head in vLLM is read from
# ``logits_processor`` (``ParallelLMHead.forward`` is never called)
VLLM_TOP = {"model.embed_tokens": "model.embed_tokens", "model.norm": "model.norm",
            "lm_head": "logits_processor"}
MEGATRON_TOP = {"model.embed_tokens": "embedding.word_embeddings",
                "model.norm": "decoder.final_layernorm", "lm_head": "output_layer"}


def engine_module(op: str, engine: str) -> tuple[str, str]:
    """HF probe operator name -> (the engine's module path, how to read it): ``engine`` is
    ``vllm`` or ``megatron``. KeyError for a name that is not a probe operator."""
    top = VLLM_TOP if engine == "vllm" else MEGATRON_TOP
    if op in top:
        return top[op], "out"
    parts = op.split(".", 3)
    if len(parts) != 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        raise KeyError(op)
    path, how = (VLLM_OPS if engine == "vllm" else MEGATRON_OPS)[parts[3]]
    prefix = "model.layers." if engine == "vllm" else "decoder.layers."
    return f"{prefix}{parts[2]}.{path}", how


def split_qkv_out(a: Tensor, s: Shape) -> tuple[Tensor, Tensor, Tensor]:
    """Megatron ``linear_qkv``'s output (last dim grouped per query group, as
    :func:`fuse_qkv` lays the weight out) -> HF ``q_proj``, ``k_proj``, ``v_proj`` outputs."""
    d, ng = s.head_dim, s.num_kv_heads
    g = s.num_heads // ng
    lead = a.shape[:-1]
    q, k, v = a.reshape(*lead, ng, (g + 2) * d).split([g * d, d, d], dim=-1)
    return q.reshape(*lead, -1), k.reshape(*lead, -1), v.reshape(*lead, -1)


def fuse_qkv_out(q: Tensor, k: Tensor, v: Tensor, s: Shape) -> Tensor:
    """Inverse of :func:`split_qkv_out`."""
    lead, ng = q.shape[:-1], s.num_kv_heads
    return torch.cat([t.reshape(*lead, ng, -1) for t in (q, k, v)], dim=-1).reshape(*lead, -1)
