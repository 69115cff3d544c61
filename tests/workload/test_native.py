"""P's rollout decode as vLLM runs it (``workload/kernels/p/native.py``): the compiled functions
compute
the eager P path's math, the decode span only cuts keys the mask hides, and on a GPU Inductor
compiles them and the decode graphs replay them."""

from __future__ import annotations

import pytest
import torch

from pytest_rlkernel_matrix.workload.job import run_rollout
from pytest_rlkernel_matrix.workload.kernels.p import native
from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling
from pytest_rlkernel_matrix.workload.model import PRESETS, Qwen3, init_weights

ALL_P = dict.fromkeys(("attention", "ffn", "logp"), "production")
CUDA = torch.cuda.is_available()


def _setup(dev: torch.device, dtype: torch.dtype, span: int = 64):
    cfg = PRESETS["tiny"] if dev.type == "cpu" else PRESETS["small"]
    w = init_weights(cfg, 3, dtype, dev)
    k = SideKernels.build("rollout", ALL_P, dtype, Tiling.for_device(dev, span),
                          cfg.rms_norm_eps)
    model = Qwen3(cfg, w, span)
    gen = torch.Generator().manual_seed(5)
    b, t = 6, 20
    tokens = torch.randint(2, cfg.vocab_size, (b, t), generator=gen).to(dev)
    caches = model.new_cache(b)
    model.hidden(k, tokens, torch.arange(t, device=dev)[None].expand(b, t), caches)
    lengths = torch.tensor([20, 11, 17, 20, 3, 9], device=dev)
    nxt = torch.randint(2, cfg.vocab_size, (b,), generator=gen).to(dev)
    return model, k, caches, nxt, lengths


def _decode(model, k, caches, nxt, lengths, span=0):
    caches = [type(c)(c.k.clone(), c.v.clone()) for c in caches]
    return model.decode_step(k, nxt, lengths, caches, 1.0, span), caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_functions_are_the_eager_p_path_bit_for_bit(monkeypatch: pytest.MonkeyPatch,
                                                           dtype: torch.dtype) -> None:
    """On the CPU the kernels take the route a GPU compiles (native.py's functions), run
    eagerly here, and give the eager P path's bits: log-probs and the KV-cache writes."""
    dev = torch.device("cpu")
    model, k, caches, nxt, lengths = _setup(dev, dtype)
    eager, ec = _decode(model, k, caches, nxt, lengths)
    monkeypatch.setattr(native, "use_compiled", lambda x: True)
    monkeypatch.setattr(native, "compiled", lambda fn, batch_args=(0,): fn)
    routed, rc = _decode(model, k, caches, nxt, lengths)
    assert torch.equal(eager, routed)
    for a, b in zip(ec, rc, strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_decode_span_only_cuts_masked_keys() -> None:
    """A span that covers every live position gives the whole cache's log-probs (CPU, fp32:
    only the masked keys are left out)."""
    model, k, caches, nxt, lengths = _setup(torch.device("cpu"), torch.float32)
    full, _ = _decode(model, k, caches, nxt, lengths)
    cut, _ = _decode(model, k, caches, nxt, lengths, span=32)
    assert torch.allclose(full, cut, atol=1e-5, rtol=0)


def test_cpu_rollout_reports_the_decode_as_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compile on the CPU: the manifest's line says the native functions were not used;
    with the compile off it says eager (and no flash attention on the CPU)."""
    model, k, caches, nxt, lengths = _setup(torch.device("cpu"), torch.float32)
    native.STATUS.clear()
    monkeypatch.setattr(native, "COMPILE", True)
    _decode(model, k, caches, nxt, lengths)
    assert native.decode_mode() == "not used"
    monkeypatch.setattr(native, "COMPILE", False)
    assert native.decode_mode() == "eager"


def test_cpu_span_buckets_rollout_matches_whole_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A P rollout with span buckets (the runner's eager steps on the CPU) samples the tokens
    the whole-cache rollout samples, with log-probs equal to fp32 rounding."""
    from pytest_rlkernel_matrix.workload.rollout import graphs

    model, k, _, _, _ = _setup(torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, model.cfg.vocab_size, (int(n),), generator=gen)
               for n in torch.randint(4, 12, (12,), generator=gen)]
    max_new = torch.randint(10, 40, (12,), generator=gen).tolist()

    def roll():
        return run_rollout(model, k, prompts, max_new, 1.0, 0.95,
                           torch.Generator().manual_seed(2), True, ignore_eos=True)
    whole = roll()
    monkeypatch.setattr(graphs, "SPAN_UNIT", 8)
    cut = roll()
    for a, b in zip(whole.tokens, cut.tokens, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(whole.logprobs, cut.logprobs, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_gpu_compiled_decode_close_to_eager_and_graphed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor compiles the three functions; compiled log-probs are close to eager P's (bf16
    fusion changes roundings, as in production); a graphed P rollout runs them, span buckets
    included, and reports graph mode."""
    from pytest_rlkernel_matrix.workload.rollout import graphs

    dev = torch.device("cuda")
    model, k, caches, nxt, lengths = _setup(dev, torch.bfloat16, span=96)
    native.STATUS.clear()
    monkeypatch.setattr(native, "COMPILE", True)
    with torch.inference_mode():
        comp, _ = _decode(model, k, caches, nxt, lengths)
        assert set(native.STATUS) == {"decode_attn_pre", "decode_ffn", "decode_logp",
                                      "decode_attention"}
        assert native.STATUS.pop("decode_attention").startswith("triton grouped decode")
        assert all(v == "inductor" for v in native.STATUS.values()), native.STATUS
        monkeypatch.setattr(native, "COMPILE", False)
        eager, _ = _decode(model, k, caches, nxt, lengths)
        assert (comp - eager).abs().max().item() < 0.1
        monkeypatch.setattr(native, "COMPILE", True)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(2, model.cfg.vocab_size, (int(n),), generator=gen).to(dev)
                   for n in torch.randint(4, 24, (40,), generator=gen)]
        max_new = torch.randint(20, 60, (40,), generator=gen).tolist()
        monkeypatch.setattr(graphs, "SPAN_UNIT", 32)
        ro = run_rollout(model, k, prompts, max_new, 1.0, 0.95,
                         torch.Generator(device=dev).manual_seed(2), True, ignore_eos=True)
    assert ro.execution_mode == ("compiled_hip_graph" if torch.version.hip
                                 else "compiled_cuda_graph")
    assert [t.numel() - p for t, p in zip(ro.tokens, ro.prompt_lengths, strict=True)] == max_new


def _varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, p, causal, debug, *, seqused_k):
    """Flash varlen's contract in plain SDPA: sequence ``i``'s query rows ``cu_q[i]:cu_q[i+1]``
    attend (not causal) to its first ``seqused_k[i]`` keys from ``cu_k[i]``, KV heads grouped."""
    assert p == 0.0 and not causal and max_q == int((cu_q[1:] - cu_q[:-1]).max())
    out = []
    for i in range(cu_q.numel() - 1):
        qi, kv = q[cu_q[i]:cu_q[i + 1]], slice(int(cu_k[i]), int(cu_k[i] + seqused_k[i]))
        assert int(seqused_k[i]) <= max_k
        out.append(torch.nn.functional.scaled_dot_product_attention(
            qi.transpose(0, 1), k[kv].transpose(0, 1), v[kv].transpose(0, 1),
            enable_gqa=True).transpose(0, 1))
    return torch.cat(out), None, None, None, None


@pytest.mark.parametrize("pack", [True, False], ids=["gqa-packed", "rows"])
def test_flash_decode_layout_is_masked_decode_attention(monkeypatch: pytest.MonkeyPatch,
                                                         pack: bool) -> None:
    """The packing and the cache views around the flash call (on the CPU, the call's varlen
    contract in plain SDPA): each query head meets its own KV head over its row's keys, so the
    result is the masked SDPA decode's, with garbage past every row's position ignored."""
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", _varlen_reference)
    g = torch.Generator().manual_seed(7)
    b, cap, hq, hkv, d = 5, 24, 8, 2, 16
    kc, vc = torch.randn(b, cap, hkv, d, generator=g), torch.randn(b, cap, hkv, d, generator=g)
    q = torch.randn(b, hq, d, generator=g)
    pos = torch.tensor([[0], [23], [7], [12], [3]])
    past = torch.arange(cap)[None, :].expand(b, cap) > pos
    kc[past], vc[past] = 1e4, -1e4  # never read
    got = native.flash_decode(q, kc, vc, pos, pack=pack)
    mask = torch.arange(cap)[None, :] <= pos
    want = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(b, hkv, hq // hkv, d), kc.transpose(1, 2), vc.transpose(1, 2),
        attn_mask=mask[:, None, None, :]).reshape(b, hq, d)
    assert got.shape == (b, hq, d)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_gpu_flash_decode_is_masked_attention_over_each_rows_keys() -> None:
    """Flash varlen over ``positions + 1`` keys of the token-major cache: the masked SDPA's
    output to bf16 rounding, for rows at the first key, mid-cache and the last slot; keys past
    a row's position (garbage here) never count."""
    g = torch.Generator(device="cuda").manual_seed(4)
    b, cap, hq, hkv, d = 37, 192, 16, 8, 128
    kc = torch.randn(b, cap, hkv, d, device="cuda", generator=g).bfloat16()
    vc = torch.randn(b, cap, hkv, d, device="cuda", generator=g).bfloat16()
    q = torch.randn(b, hq, d, device="cuda", generator=g).bfloat16()
    pos = torch.randint(0, cap, (b, 1), device="cuda", generator=g)
    pos[0, 0], pos[1, 0] = 0, cap - 1
    got = native.flash_decode(q, kc, vc, pos)  # RLK_REF_P_DECODE_ATTN=flash's route
    packed = native.flash_decode(q, kc, vc, pos, pack=True)  # query heads as rows per KV head
    print(f"GQA-packed vs one row per head: bitwise {torch.equal(got, packed)}, max diff "
          f"{(got.float() - packed.float()).abs().max().item():.3g}")
    assert (got.float() - packed.float()).abs().max().item() < 2e-2
    mask = torch.arange(cap, device="cuda")[None, :] <= pos
    want = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(b, hkv, hq // hkv, d), kc.transpose(1, 2), vc.transpose(1, 2),
        attn_mask=mask[:, None, None, :]).reshape(b, hq, d)
    assert got.shape == (b, hq, d) and got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max().item() < 2e-2
    kc2 = kc.clone()
    kc2[torch.arange(cap, device="cuda")[None, :].expand(b, cap) > pos] = 1e4  # after the keys
    assert torch.equal(native.flash_decode(q, kc2, vc, pos), got)
