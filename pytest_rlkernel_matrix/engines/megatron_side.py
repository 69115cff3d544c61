"""Training forward in Megatron-core: ``GPTModel`` on the local layer spec, R via ``ModuleSpec``.

P = Megatron-core's own modules (``SelfAttention`` with ``DotProductAttention``, ``MLP``,
``WrappedTorchNorm`` RMSNorm, its RoPE, and ``GPTModel``'s output layer + cross-entropy for the
selected logprobs). R = the project's R kernels (``workload/kernels/side.py``) plugged in as the
layer spec's ``self_attention`` / ``mlp`` submodules (with ``IdentityOp`` for the norm before
them, since the R modules include their norm), and, for logp, a head after a ``GPTModel`` built
with ``post_process=False``. Each hook counts its own calls into the readback.

Megatron-core 0.16 assumes CUDA in three places that a forward on CPU reaches; each is replaced
narrowly, through the object Megatron itself exposes, and listed in ``CPU_SHIMS`` (recorded in
the manifest): the RoPE table (``RotaryEmbedding.get_emb`` moves ``inv_freq`` to
``torch.cuda.current_device()``), the global memory buffer used by ``DotProductAttention``
(allocates on the current CUDA device), and the default causal mask (built with
``device="cuda"``; we pass an explicit mask). The RNG tracker is Megatron's own inference tracker
(``initialize_rng_tracker(inference_rng_tracker=True)``: no dropout in a forward-only recompute).
On a CUDA machine none of the shims is applied.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

from pytest_rlkernel_matrix.workload.kernels.side import SideKernels
from pytest_rlkernel_matrix.workload.weights import AttnInputs, LayerWeights

from .mapping import ATTN_LEAVES, FFN_LEAVES, Shape, hf_to_megatron, megatron_to_hf
from .probe import training_rows

CPU_SHIMS = ("RotaryEmbedding.get_emb: keep inv_freq on CPU",
             "parallel_state global memory buffer: CPU allocation",
             "explicit causal attention_mask (Megatron's default mask is built on CUDA)")


def rope_tables(head_dim: int, theta: float, max_seq: int) -> tuple[Tensor, Tensor]:
    """RoPE cos/sin ``[max_seq, head_dim]`` exactly as the built-in workload builds them."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.arange(max_seq, dtype=torch.float64)[:, None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def init_parallel_state(port: int | None = None) -> None:
    """Single-rank gloo process group + Megatron model-parallel state (idempotent)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port or 29500 + os.getpid() % 20000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if not torch.cuda.is_available():
        from megatron.core.utils import GlobalMemoryBuffer

        class CpuMemoryBuffer(GlobalMemoryBuffer):
            def get_tensor(self, tensor_shape: Any, dtype: torch.dtype, name: str,
                           mem_alloc_context: Any = None) -> Tensor:
                n = 1
                for s in tensor_shape:
                    n *= int(s)
                buf = self.buffer.get((name, dtype))
                if buf is None or buf.numel() < n:
                    buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
                return buf[:n].view(*tensor_shape)

        parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()


class _RBase(nn.Module):
    """An R module holding its weights in HF layout (leaf names as in the checkpoint)."""

    leaves: tuple[str, ...] = ()

    def __init__(self, config: Any, layer_number: int = 1, **_: Any) -> None:
        super().__init__()
        self.layer_index = layer_number - 1
        shapes = _leaf_shapes(config)
        for leaf in self.leaves:
            self.add_module(leaf, _Holder(torch.empty(shapes[leaf], dtype=config.params_dtype)))

    def layer_weights(self) -> LayerWeights:
        empty = torch.empty(0)
        g = {leaf: getattr(self, leaf).weight for leaf in self.leaves}
        return LayerWeights(
            self.layer_index, g.get("input_layernorm", empty), g.get("q_proj", empty),
            g.get("k_proj", empty), g.get("v_proj", empty), g.get("o_proj", empty),
            g.get("q_norm", empty), g.get("k_norm", empty),
            g.get("post_attention_layernorm", empty), g.get("gate_proj", empty),
            g.get("up_proj", empty), g.get("down_proj", empty))


class _Holder(nn.Module):
    def __init__(self, w: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(w, requires_grad=False)


def _leaf_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    h, d = config.hidden_size, config.kv_channels
    hq, hkv, f = config.num_attention_heads, config.num_query_groups, config.ffn_hidden_size
    return {"input_layernorm": (h,), "q_proj": (hq * d, h), "k_proj": (hkv * d, h),
            "v_proj": (hkv * d, h), "o_proj": (h, hq * d), "q_norm": (d,), "k_norm": (d,),
            "post_attention_layernorm": (h,), "gate_proj": (f, h), "up_proj": (f, h),
            "down_proj": (h, f)}


# The kernels and RoPE tables the R modules use; set by build_model before construction.
_CTX: dict[str, Any] = {}


class RAttention(_RBase):
    """``self_attention`` submodule: the R attention kernel (norm..output projection)."""

    leaves = ATTN_LEAVES

    def forward(self, hidden_states: Tensor, attention_mask: Any = None,
                **_: Any) -> tuple[Tensor, None]:
        kernels: SideKernels = _CTX["kernels"]
        x = hidden_states.transpose(0, 1)  # Megatron is [s, b, h]
        b, t, _h = x.shape
        pos = torch.arange(t)[None].expand(b, t)
        cos, sin = _CTX["cos"][pos], _CTX["sin"][pos]
        out = kernels.attention(x.contiguous(), self.layer_weights(),
                                AttnInputs(pos, cos, sin, None))
        return out.transpose(0, 1).contiguous(), None


class RMlp(_RBase):
    """``mlp`` submodule: the R FFN kernel (post-attention norm, gate/up, SwiGLU, down)."""

    leaves = FFN_LEAVES

    def forward(self, hidden_states: Tensor, **_: Any) -> tuple[Tensor, None]:
        kernels: SideKernels = _CTX["kernels"]
        x = hidden_states.transpose(0, 1).contiguous()
        return kernels.ffn(x, self.layer_weights()).transpose(0, 1).contiguous(), None


class RLogpHead(nn.Module):
    """After ``GPTModel(post_process=False)``: final norm + LM head + log-softmax (R logp)."""

    def __init__(self, hidden: int, vocab: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = _Holder(torch.empty(hidden, dtype=dtype))
        self.lm_head = _Holder(torch.empty(vocab, hidden, dtype=dtype))

    def forward(self, kernels: SideKernels, hidden: Tensor, targets: Tensor) -> Tensor:
        return kernels.logp.selected(hidden, self.norm.weight, self.lm_head.weight, targets, 1.0)


class MegatronTrainer:
    """GPTModel + optional R logp head for one route; ``selected_logprobs`` per sequence."""

    def __init__(self, hf_cfg: dict, hf_weights: dict[str, Tensor], impls: dict[str, str],
                 kernels: SideKernels, max_seq: int) -> None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.identity_op import IdentityOp
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.transformer_config import TransformerConfig

        init_parallel_state()
        self.impls, self.kernels = impls, kernels
        self.shape = Shape.from_hf(hf_cfg)
        dtype = torch.bfloat16
        self.config = TransformerConfig(
            num_layers=hf_cfg["num_hidden_layers"], hidden_size=hf_cfg["hidden_size"],
            num_attention_heads=hf_cfg["num_attention_heads"],
            num_query_groups=hf_cfg["num_key_value_heads"], kv_channels=self.shape.head_dim,
            ffn_hidden_size=hf_cfg["intermediate_size"], normalization="RMSNorm",
            layernorm_epsilon=hf_cfg["rms_norm_eps"], gated_linear_unit=True,
            activation_func=torch.nn.functional.silu, add_bias_linear=False,
            qk_layernorm=True, bf16=True, params_dtype=dtype,
            use_cpu_initialization=not torch.cuda.is_available(), hidden_dropout=0.0,
            attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
            apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            gradient_accumulation_fusion=False)
        spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
        sub = spec.submodules
        if impls["attention"] == "rl_kernel":
            sub.input_layernorm = IdentityOp
            sub.self_attention = ModuleSpec(module=RAttention)
        if impls["ffn"] == "rl_kernel":
            sub.pre_mlp_layernorm = IdentityOp
            sub.mlp = ModuleSpec(module=RMlp)
        post = impls["logp"] != "rl_kernel"
        cos, sin = rope_tables(self.shape.head_dim, hf_cfg["rope_theta"], max_seq)
        _CTX.update(kernels=kernels, cos=cos, sin=sin)
        self.model = GPTModel(config=self.config, transformer_layer_spec=spec,
                              vocab_size=hf_cfg["vocab_size"], max_sequence_length=max_seq,
                              position_embedding_type="rope", rotary_base=int(hf_cfg["rope_theta"]),
                              share_embeddings_and_output_weights=False, post_process=post)
        self.head = None if post else RLogpHead(hf_cfg["hidden_size"], hf_cfg["vocab_size"], dtype)
        if not torch.cuda.is_available():
            from megatron.core.models.common.embeddings.rotary_pos_embedding import (
                RotaryEmbedding,
            )

            class CpuRotaryEmbedding(RotaryEmbedding):
                def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
                    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
                    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

            self.model.rotary_pos_emb.__class__ = CpuRotaryEmbedding
        for layer in self.model.decoder.layers:  # Megatron builds `mlp` without layer_number
            for sub in (layer.self_attention, layer.mlp):
                if isinstance(sub, _RBase):
                    sub.layer_index = layer.layer_number - 1
        self.model.eval()
        self.load(hf_weights)
        self._hooks()

    def state(self) -> dict[str, Tensor]:
        """Megatron-named tensors as loaded (model + R logp head)."""
        sd = {k: v for k, v in self.model.state_dict().items()
              if isinstance(v, Tensor) and not k.endswith("_extra_state")}
        if self.head is not None:
            sd.update({f"logp_head.{k}": v for k, v in self.head.state_dict().items()})
        return sd

    def load(self, hf: dict[str, Tensor]) -> None:
        mg = hf_to_megatron(hf, self.shape, self.impls)
        head = {k[len("logp_head."):]: v for k, v in mg.items() if k.startswith("logp_head.")}
        body = {k: v for k, v in mg.items() if not k.startswith("logp_head.")}
        missing, unexpected = self.model.load_state_dict(body, strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"HF->Megatron mapping: missing {missing}, unexpected {unexpected}")
        if self.head is not None:
            self.head.load_state_dict(head, strict=True)

    def hf_weights(self) -> dict[str, Tensor]:
        """The loaded weights mapped back to HF names (training-side weight audit)."""
        return megatron_to_hf(self.state(), self.shape, self.impls)

    def _hooks(self) -> None:
        """Count P module calls where Megatron runs them (R kernels count themselves)."""
        def counter(module: str) -> Any:
            def hook(*_: Any) -> None:
                self.kernels.module(module).call_count += 1
            return hook

        for layer in self.model.decoder.layers:
            if self.impls["attention"] != "rl_kernel":
                layer.self_attention.register_forward_pre_hook(counter("attention"))
            if self.impls["ffn"] != "rl_kernel":
                layer.mlp.register_forward_pre_hook(counter("ffn"))
        if self.head is None:
            self.model.output_layer.register_forward_pre_hook(counter("logp"))

    @torch.inference_mode()
    def selected_logprobs(self, tokens: list[Tensor], prompt_lens: list[int],
                          micro_batch: int, order: list[int]) -> list[Tensor]:
        """fp32 logprob of every response token, recomputed over padded micro-batches."""
        out: list[Tensor] = [torch.empty(0)] * len(tokens)
        for s in range(0, len(order), micro_batch):
            mb = order[s:s + micro_batch]
            t = max(tokens[i].numel() for i in mb)
            ids = torch.zeros(len(mb), t, dtype=torch.long)
            for r, i in enumerate(mb):
                ids[r, :tokens[i].numel()] = tokens[i]
            pos = torch.arange(t)[None].expand(len(mb), t)
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)[None, None]
            targets = torch.cat([ids[:, 1:], ids[:, :1] * 0], dim=1)
            tap = self.kernels.tap
            if tap is not None and tap.recording:  # probe: rows batch-first, like the kernels'
                tap.rows(training_rows(tokens, mb, t))
            if self.head is None:  # Megatron's output layer + cross-entropy: loss = -logp
                lp = -self.model(ids, pos, mask, labels=targets).float()
            else:
                hid = self.model(ids, pos, mask)  # [s, b, h] before the final norm
                h = hid.transpose(0, 1).reshape(-1, hid.shape[-1])
                lp = self.head(self.kernels, h, targets.reshape(-1)).reshape(len(mb), t)
            for r, i in enumerate(mb):
                p, n = prompt_lens[i], tokens[i].numel()
                out[i] = lp[r, p - 1:n - 1].float().contiguous()
        return out
