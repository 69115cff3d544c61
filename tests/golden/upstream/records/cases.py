"""The generated inputs of the record-rules golden differential (issue 50): readback operator
records (`readbacks/{framework}-{target}-{pid}.json`, `operators[module]`) under RL-Kernel's
backend ids on CUDA, with fallbacks in each place upstream looks (`fallback`, `fallback_used`,
`used_fallback`, `split_kv_fallback`, any case and padding, at any depth, in lists, with every
kind of value: true, "false", 0, 0.0, -0.0, "", None, [], {}, "no"), Triton in any string or
flag, the runtime platform found first or later, padded or upper-case backend ids, the logp
backend that is not the strict one, and seeded random records nested up to 400 levels.

Pure Python, deterministic: `records()` gives `[(name, module, record)]` (every record JSON).
"""

from __future__ import annotations

import random
from typing import Any

STRICT = {"attention": "rlkernel.attention.deterministic.v1",
          "ffn": "rlkernel.ffn.qwen3.deterministic.v1",
          "logp": "rlkernel.linear_logp.bitwise.v1"}
CUDA = {"execution": {"runtime_platform": "cuda", "triton_used": False}}


def clean(module: str) -> dict[str, Any]:
    """A record upstream passes: the strict backend, CUDA, no Triton, no fallback."""
    return {"module": module, "backend_id": STRICT[module], "implementation": "rl_kernel",
            "case_id": "R/R", "call_count": 1, "execution_mode": "eager",
            "provenance": {"interface": module, "fallback": False,
                           "execution": dict(CUDA["execution"])}}


FALLBACK_KEYS = ("fallback", "Fallback", " FALLBACK ", "fallback_used", "used_fallback",
                 "split_kv_fallback", "Used_Fallback", "attention_fallback", "fallbacks",
                 "fallback_reason", "usedFallback", "fall_back")
FALLBACK_VALUES: tuple[Any, ...] = (True, False, None, "", 0, 0.0, -0.0, 1, -1, 2.5, "true",
                                    "false", "0", "no", [], {}, [False], {"x": 1})


def _systematic() -> list[tuple[str, str, dict[str, Any]]]:
    out: list[tuple[str, str, dict[str, Any]]] = []
    for module in STRICT:
        out.append((f"clean_{module}", module, clean(module)))
    for i, key in enumerate(FALLBACK_KEYS):
        for j, value in enumerate(FALLBACK_VALUES):
            for where in ("record", "provenance", "execution", "nested_list"):
                rec = clean("attention")
                del rec["provenance"]["fallback"]
                if where == "record":
                    rec[key] = value
                elif where == "provenance":
                    rec["provenance"][key] = value
                elif where == "execution":
                    rec["provenance"]["execution"][key] = value
                else:
                    rec["provenance"]["result"] = [{"kernels": [{key: value}]}]
                out.append((f"fallback_{i}_{j}_{where}", "attention", rec))
    for name, module, edit in (
        ("triton_in_a_string", "ffn", lambda r: r["provenance"].update(kernel="my_Triton_gemm")),
        ("triton_used_true", "ffn", lambda r: r["provenance"]["execution"].update(
            triton_used=True)),
        ("uses_triton_true", "attention", lambda r: r["provenance"].update(uses_triton=True)),
        ("triton_used_one", "attention", lambda r: r["provenance"].update(triton_used=1)),
        ("triton_used_string", "attention", lambda r: r["provenance"].update(
            triton_used="yes")),
        ("triton_in_backend_key_value", "logp", lambda r: r.update(note="TRITON")),
        ("platform_rocm", "attention", lambda r: r["provenance"]["execution"].update(
            runtime_platform="rocm")),
        ("platform_upper", "attention", lambda r: r["provenance"]["execution"].update(
            runtime_platform="CUDA")),
        ("platform_padded", "attention", lambda r: r["provenance"]["execution"].update(
            runtime_platform=" cuda")),
        ("platform_missing", "ffn", lambda r: r["provenance"]["execution"].pop(
            "runtime_platform")),
        ("platform_first_wins", "ffn", lambda r: r["provenance"].update(
            runtime_platform="cpu")),
        ("platform_not_a_string", "ffn", lambda r: r["provenance"]["execution"].update(
            runtime_platform=1)),
        ("platform_in_record_only", "ffn", lambda r: (
            r["provenance"]["execution"].pop("runtime_platform"),
            r.update(runtime_platform="cuda"))),
        ("logp_not_strict", "logp", lambda r: r.update(
            backend_id="rlkernel.linear_logp.other.v1")),
        ("backend_padded", "logp", lambda r: r.update(
            backend_id=" rlkernel.linear_logp.bitwise.v1")),
        ("backend_upper", "attention", lambda r: r.update(
            backend_id="RLKERNEL.attention.deterministic.v1")),
        ("provenance_a_list", "attention", lambda r: r.update(
            provenance=[{"runtime_platform": "cuda"}])),
        ("provenance_missing", "attention", lambda r: r.pop("provenance")),
    ):
        rec = clean(module)
        edit(rec)
        out.append((name, module, rec))
    return out


KEYS = ["runtime_platform", "execution", "fallback", " Fallback_Used ", "used_fallback",
        "split_kv_fallback", "triton_used", "uses_triton", " Triton_Used", "kernels",
        "platform", "result", "Runtime_Platform", "x"]
LEAVES: list[Any] = ["cuda", "CUDA", " cuda", "cuda ", "rocm", "cpu", "my_triton_kernel",
                     "TRITON", "", "flash", "rlkernel.attention.deterministic.v1", True, False,
                     None, -2, -1, 0, 1, 2, 0.0, -0.0, 1.5]
BACKENDS = ["rlkernel.attention.deterministic.v1", "rlkernel.ffn.qwen3.deterministic.v1",
            "rlkernel.linear_logp.bitwise.v1", " rlkernel.linear_logp.bitwise.v1",
            "RLKERNEL.attention.deterministic.v1", "rlkernel.linear_logp.other.v1"]


def _value(rng: random.Random, budget: list[int]) -> Any:
    budget[0] -= 1
    kind = rng.randrange(4) if budget[0] > 0 else 0
    if kind <= 1:
        return rng.choice(LEAVES)
    if kind == 2:
        return [_value(rng, budget) for _ in range(rng.randrange(5))]
    return {rng.choice(KEYS): _value(rng, budget) for _ in range(rng.randrange(5))}


def _random(n: int = 300, seed: int = 50) -> list[tuple[str, str, dict[str, Any]]]:
    rng = random.Random(seed)
    out: list[tuple[str, str, dict[str, Any]]] = []
    for i in range(n):
        module = rng.choice(sorted(STRICT))
        prov = {rng.choice(KEYS): _value(rng, [24]) for _ in range(rng.randrange(6))}
        if rng.random() < 0.5:
            prov.setdefault("execution", {})
            if isinstance(prov["execution"], dict):
                prov["execution"]["runtime_platform"] = rng.choice(["cuda", "cuda", "rocm"])
        rec: dict[str, Any] = {"backend_id": rng.choice(BACKENDS), "call_count": 1,
                               "provenance": prov}
        for _ in range(rng.randrange(3)):
            key = rng.choice(KEYS)
            if key not in ("backend_id", "call_count"):
                rec[key] = _value(rng, [24])
        depth = rng.choice([0, 0, 0, 50, 150, 400])
        for d in range(depth):
            rec["provenance"] = {"nested": rec["provenance"]} if d % 2 else [rec["provenance"]]
        if depth:
            rec["provenance"] = {"runtime_platform": "cuda", "deep": rec["provenance"]}
        out.append((f"random_{i:03d}", module, rec))
    return out


def records() -> list[tuple[str, str, dict[str, Any]]]:
    return [*_systematic(), *_random()]
