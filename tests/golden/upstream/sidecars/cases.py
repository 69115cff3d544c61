"""The generated inputs of the sidecar golden differential (issue 50): RL-Kernel's mismatch
sidecars (`mismatch-sidecars/rank{rank:05d}.call{call:08d}.pt`), each payload the dict
`tis_metrics._write_sidecar` saves at a5a92ec (`run_upstream.py` checks that upstream's writer
gives the same dicts for every case the writer can produce), over systematic inputs: equal with
differing inactive tokens, one ulp active / inactive, signed zero, NaN / Inf active or inactive,
bf16 and fp16 on both sides, a dtype mix, float masks, no active token, a missing field, the
legacy `schema` key, a foreign schema, list lengths that differ, bad rank / call index / lengths,
a mask of the wrong length, a shape mismatch, TP replicas that agree / disagree (on an inactive
token), CP shards complete, one ulp off, missing, with lengths that differ, and a tp2 x cp2 x dp2
run over two calls.

Pure torch, deterministic, written without the plugin's code: `write(name, folder)` makes the
sidecar folder; `CASES` names them; `plan(name)` gives the writer calls and `MUTATE` the edits
that take a payload where upstream's writer cannot go (malformed files).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SCHEMA = "rlkernel.vime_rocm_attention_mismatch_sidecar.v1"
TOTAL, RESPONSE = 14, 9  # prompt 5: logprobs at logit positions [4, 13)
MASK = [1, 1, 0, 1, 1, 1, 0, 1, 1]  # 7 active of 9; offsets 2 and 6 inactive
INACTIVE, ACTIVE = 2, 3


def _base(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (-torch.rand(RESPONSE, generator=g, dtype=torch.float64) * 4).to(dtype)


def _ulp(x: torch.Tensor, i: int) -> torch.Tensor:
    y = x.clone()
    y[i] = torch.nextafter(y[i:i + 1], torch.tensor([0.0], dtype=y.dtype))[0]
    return y


def _set(x: torch.Tensor, i: int, v: float) -> torch.Tensor:
    y = x.clone()
    y[i] = v
    return y


Sample = dict[str, Any]  # train, rollout (full response length), mask, total, response


def sample(train: torch.Tensor, rollout: torch.Tensor, mask: Any = None,
           total: int = TOTAL, response: int = RESPONSE) -> Sample:
    if mask is None:
        mask = torch.tensor(MASK, dtype=torch.int64)  # vime's loss masks: int tensors
    elif not isinstance(mask, torch.Tensor):  # a float list stays float32
        mask = torch.tensor(mask)
    return {"train": train, "rollout": rollout, "mask": mask, "total": total,
            "response": response}


def response_offsets(total: int, response: int, cp: int, cp_rank: int) -> list[int]:
    """The response offsets a CP rank holds, in stored order (the zigzag at logit positions:
    chunks r and 2cp-1-r of ceil(total / 2cp), clipped to [prompt-1, total-1))."""
    if cp == 1:
        return list(range(response))
    base, chunk = total - response - 1, -(-total // (2 * cp))
    out: list[int] = []
    for c in (cp_rank, 2 * cp - cp_rank - 1):
        out += [p - base for p in range(max(c * chunk, base), min((c + 1) * chunk, total - 1))]
    return out


# A writer call: (rank, call_index, tp, cp, samples as the hook hands them: CP-sliced logprobs)
Call = tuple[int, int, int, int, list[Sample]]


def _calls(tp: int, cp: int, dp: int, calls: int,
           samples: Callable[[int, int, int], list[Sample]]) -> list[Call]:
    """Every rank of a tp x cp x dp run writes one sidecar per call (Megatron's order:
    cp_rank = (rank // tp) % cp, dp_rank = rank // (tp * cp)); `samples(dp_rank, call,
    tp_rank)` gives the full-length samples, sliced here to the rank's CP offsets."""
    out = []
    for rank in range(tp * cp * dp):
        cp_rank, dp_rank, tp_rank = (rank // tp) % cp, rank // (tp * cp), rank % tp
        for call in range(calls):
            held = []
            for s in samples(dp_rank, call, tp_rank):
                idx = torch.tensor(response_offsets(s["total"], s["response"], cp, cp_rank),
                                   dtype=torch.int64)
                held.append({**s, "train": s["train"][idx], "rollout": s["rollout"][idx]})
            out.append((rank, call, tp, cp, held))
    return out


def _one(*samples: Sample) -> list[Call]:
    return [(0, 0, 1, 1, list(samples))]


T = _base(1)
T2 = _base(2)
INACT = _set(T, INACTIVE, -99.0)  # differs on an inactive token only


def _plans() -> dict[str, list[Call]]:
    bf, hf = _base(1, torch.bfloat16), _base(1, torch.float16)
    p: dict[str, list[Call]] = {
        "equal": _one(sample(T, INACT), sample(T2, T2.clone())),
        "one_ulp_active": _one(sample(T, _ulp(T, ACTIVE)), sample(T2, T2.clone())),
        "one_ulp_inactive": _one(sample(T, _ulp(T, INACTIVE)), sample(T2, T2.clone())),
        "signed_zero_active": _one(sample(_set(T, ACTIVE, 0.0), _set(T, ACTIVE, -0.0))),
        "signed_zero_inactive": _one(sample(_set(T, INACTIVE, 0.0), _set(T, INACTIVE, -0.0))),
        "nan_active": _one(sample(_set(T, ACTIVE, float("nan")), T.clone())),
        "nan_both_active": _one(sample(_set(T, ACTIVE, float("nan")),
                                       _set(T, ACTIVE, float("nan")))),
        "nan_inactive": _one(sample(T, _set(T, INACTIVE, float("nan")))),
        "neg_inf_both_active": _one(sample(_set(T, ACTIVE, -float("inf")),
                                           _set(T, ACTIVE, -float("inf")))),
        "inf_inactive": _one(sample(_set(T, INACTIVE, -float("inf")), T.clone())),
        "drift": _one(sample(T, T + 0.125), sample(T2, T2 - 2.0 ** -10)),
        "bf16_equal": _one(sample(bf, bf.clone())),
        "bf16_one_ulp": _one(sample(bf, _ulp(bf, ACTIVE))),
        "fp16_equal": _one(sample(hf, hf.clone())),
        "bf16_vs_fp32_same_values": _one(sample(bf.float(), bf.clone())),
        "fp64_vs_fp32_same_values": _one(sample(T.double(), T.clone())),
        "float_mask": _one(sample(T, INACT, [float(v) for v in MASK])),
        "fractional_mask": _one(sample(T, _ulp(T, INACTIVE),
                                       [0.5 if v else 0.0 for v in MASK])),
        "bool_mask": _one(sample(T, INACT, torch.tensor(MASK, dtype=torch.bool))),
        "no_active_token": _one(sample(T, _ulp(T, ACTIVE), [0] * RESPONSE)),
        "one_sample_without_active": _one(sample(T, INACT), sample(T2, T2 + 1.0,
                                                                   [0] * RESPONSE)),
        "mask_length_mismatch": _one(sample(T, T.clone(), [*MASK, 1])),
        "train_rollout_shape_mismatch": _one(sample(T, T[:-1].clone())),
        "response_longer_than_total": _one(sample(T, T.clone(), total=RESPONSE - 1)),
        "tp2_replicas_agree": _calls(2, 1, 1, 1, lambda d, c, t: [sample(T, INACT)]),
        "tp2_replica_disagrees_inactive": _calls(
            2, 1, 1, 1, lambda d, c, t: [sample(T, INACT if t else T.clone())]),
        "tp2_replica_disagrees_mask": _calls(
            2, 1, 1, 1, lambda d, c, t: [sample(T, T.clone(), MASK if t else [1] * RESPONSE)]),
        "cp2_complete": _calls(1, 2, 1, 1, lambda d, c, t: [sample(T, INACT)]),
        "cp2_one_ulp": _calls(1, 2, 1, 1, lambda d, c, t: [sample(T, _ulp(T, RESPONSE - 1))]),
        "cp2_missing_shard": _calls(1, 2, 1, 1, lambda d, c, t: [sample(T, T.clone())])[:1],
        "cp2_lengths_differ": [
            *_calls(1, 2, 1, 1, lambda d, c, t: [sample(T, T.clone())])[:1],
            *_calls(1, 2, 1, 1, lambda d, c, t: [sample(
                torch.cat([T, T[:1]]), torch.cat([T, T[:1]]), [*MASK, 1], TOTAL + 1,
                RESPONSE + 1)])[1:]],
        "tp2_cp2_dp2_two_calls": _calls(
            2, 2, 2, 2, lambda d, c, t: [sample(_base(10 + 4 * d + c), _base(10 + 4 * d + c)),
                                         sample(T2, T2.clone())]),
        "tp2_cp2_dp2_one_ulp": _calls(
            2, 2, 2, 2, lambda d, c, t: [sample(_base(10 + 4 * d + c),
                                                _ulp(_base(10 + 4 * d + c), 1 + d + c))]),
    }
    return p


def _pop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda d: d.pop(key)


def _put(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda d: d.__setitem__(key, value(d) if callable(value) else value)


def _legacy(d: dict[str, Any]) -> None:
    d["schema"] = d.pop("schema_version")


def _2d(d: dict[str, Any]) -> None:
    d["train_log_probs"] = [t.reshape(1, -1) for t in d["train_log_probs"]]
    d["rollout_log_probs"] = [t.reshape(1, -1) for t in d["rollout_log_probs"]]


# Files upstream's writer cannot produce: a writer payload of `base`, edited.
MUTATE: dict[str, tuple[str, Callable[[dict[str, Any]], None]]] = {
    "missing_loss_masks": ("equal", _pop("loss_masks")),
    "missing_response_lengths": ("equal", _pop("response_lengths")),
    "missing_rank": ("equal", _pop("rank")),
    "missing_schema": ("equal", _pop("schema_version")),
    "legacy_schema_key": ("equal", _legacy),
    "foreign_schema": ("equal", _put("schema_version", "rlkernel.mismatch_sidecar.v2")),
    "sample_lists_differ": ("equal", _put("total_lengths", lambda d: d["total_lengths"][:1])),
    "negative_rank": ("equal", _put("rank", -1)),
    "bool_call_index": ("equal", _put("call_index", True)),
    "tensor_scalar_rank": ("equal", _put("rank", torch.tensor(0))),
    "tensor_scalar_lengths": ("equal", _put(
        "total_lengths", lambda d: [torch.tensor(v) for v in d["total_lengths"]])),
    "float_total_length": ("equal", _put(
        "total_lengths", lambda d: [float(v) for v in d["total_lengths"]])),
    "zero_response_length": ("no_active_token", _put("response_lengths", [0])),
    "list_logprobs": ("equal", _put(
        "train_log_probs", lambda d: [t.tolist() for t in d["train_log_probs"]])),
    "two_d_logprobs": ("equal", _2d),
    "loss_masks_not_a_list": ("equal", _put("loss_masks", lambda d: d["loss_masks"][0])),
}

PLANS = _plans()
CASES = (*PLANS, *MUTATE, "no_sidecars")


def plan(name: str) -> list[Call]:
    return PLANS[name]


def topology(name: str) -> tuple[int, int]:
    """(tp, cp) the run was launched with (what upstream's validator is told)."""
    calls = PLANS.get(MUTATE[name][0] if name in MUTATE else name, [(0, 0, 1, 1, [])])
    return calls[0][2], calls[0][3]


def payload(rank: int, call: int, tp: int, cp: int, samples: list[Sample]) -> dict[str, Any]:
    """The dict `_write_sidecar` saves for one call of the hook."""
    return {"schema_version": SCHEMA, "rank": rank, "call_index": call,
            "tensor_parallel_size": tp, "context_parallel_size": cp,
            "train_log_probs": [s["train"].reshape(-1).contiguous() for s in samples],
            "rollout_log_probs": [s["rollout"].reshape(-1).contiguous() for s in samples],
            "loss_masks": [s["mask"].reshape(-1).contiguous() for s in samples],
            "total_lengths": [int(s["total"]) for s in samples],
            "response_lengths": [int(s["response"]) for s in samples]}


def write(name: str, folder: Path) -> Path:
    """The sidecar folder of case `name` under `folder` (`folder/mismatch-sidecars`)."""
    out = folder / "mismatch-sidecars"
    out.mkdir(parents=True)
    if name == "no_sidecars":
        return out
    base, edit = MUTATE.get(name, (name, None))
    for rank, call, tp, cp, samples in PLANS[base]:
        data = payload(rank, call, tp, cp, samples)
        if edit is not None:
            edit(data)
        torch.save(data, out / f"rank{rank:05d}.call{call:08d}.pt")
    return out
