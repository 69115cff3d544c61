"""Build one finished cell directory in-process, the way RL-Kernel + vime leave it on disk.

`CellKit` writes a clean run (cell-run.json, exit-code, run.log, readbacks with the logp
provider's `arithmetic_contract`/`contract_version` and none on attention/FFN, one masked sidecar,
weight audits from both sides); a test then breaks exactly one thing and calls `analyze()`.
Small: a handful of samples of 16-24 tokens, no subprocess.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pytest_rlkernel_matrix.report.record import analyze_run, cell_to_dict
from pytest_rlkernel_matrix.spec.cells import Cases, Cell

MODULES = ("attention", "ffn", "logp")
SIDES = {"training": "megatron", "rollout": "vllm"}
BACKENDS = {"attention": "rlkernel.attention.deterministic.v1",
            "ffn": "rlkernel.ffn.qwen3.deterministic.v1",
            "logp": "rlkernel.linear_logp.bitwise.v1"}
RUN_ID = "cpu-attention-rr-20260101T000000Z-abcdef01"


def cell_of(module: str = "attention", case: str = "R/R") -> Cell:
    cases = {m: (case if m == module else "R/R") for m in MODULES}
    return Cell("cpu", module, case, Cases(cases["attention"], cases["ffn"], cases["logp"]))


@dataclass
class CellKit:
    root: Path
    module: str = "attention"
    case: str = "R/R"
    mode: str = "strict"
    policy: dict[str, Any] = field(default_factory=lambda: {
        "baseline_contract": None, "min_samples_per_rank": 1, "min_active_tokens": 1,
        "backend": "cpu"})
    samples: int = 4

    @property
    def cell(self) -> Cell:
        return cell_of(self.module, self.case)

    @property
    def dir(self) -> Path:
        return self.root / "cpu" / self.cell.slug

    def write(self) -> CellKit:
        d = self.dir
        for sub in ("readbacks", "mismatch-sidecars", "weight-audit"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        self.write_meta()
        (d / "exit-code").write_text("0\n")
        lines = []
        for side, fw in SIDES.items():
            self.write_readback(side, self.readback(side))
            for m in MODULES:
                impl = self.impl(m, side)
                lines.append(f"[RL-Kernel][route] framework={fw} target={side} module={m} "
                             f"case={self.cell.cases.of(m)} implementation={impl} fallback=false")
            self.write_json(f"weight-audit/v0.{fw}-{side}.json", {
                "weight_version": "v0", "framework": fw, "target": side, "sha256": "ab" * 32})
        lines += [
            "perf 0: {'perf/rollout_time': 1.5, 'perf/tokens_per_gpu_per_sec': 100.0}",
            "perf 0: {'perf/step_time': 3.0, 'perf/train_time': 1.0, "
            "'perf/update_weights_time': 0.5}",
        ]
        (d / "run.log").write_text("\n".join(lines) + "\n")
        self.write_sidecar(self.sidecar())
        return self

    def impl(self, module: str, side: str) -> str:
        return "rl_kernel" if self.cell.cases.side(module, side) == "R" else "production"

    def write_meta(self, **run: Any) -> None:
        meta = {
            "session": "t", "cell": cell_to_dict(self.cell), "mode": self.mode,
            "run_id": RUN_ID, "artifact_dir": f"cpu/{self.cell.slug}",
            "run": {"command": "x", "exit_code": 0, "timed_out": False, "interrupted": False,
                    "wall_time": 1.0, "started": "s", "finished": "f", **run},
            "warmup": 0, "env": {}, "fingerprints": {}, "preflight_blockers": [],
            "policy": self.policy,
        }
        self.write_json("cell-run.json", meta)

    def readback(self, side: str) -> dict[str, Any]:
        fw = SIDES[side]
        operators = {}
        for m in MODULES:
            impl = self.impl(m, side)
            prov: dict[str, Any] = {"interface": "kit", "operator": m, "fallback": False,
                                    "execution": {"runtime_platform": "cpu", "tp_world_size": 1,
                                                  "cp_world_size": 1}}
            if impl == "rl_kernel" and m == "logp":
                prov.update(actual_backend=BACKENDS[m], arithmetic_contract="bitwise",
                            contract_version="linear_logp:tp=1:cp=1:vocab=128")
            operators[m] = {"framework": fw, "target": side, "module": m,
                            "case_id": self.cell.cases.of(m), "implementation": impl,
                            "backend_id": BACKENDS[m] if impl == "rl_kernel"
                            else f"{fw}.production.{m}",
                            "call_count": 5, "execution_mode": "eager", "provenance": prov}
        return {"framework": fw, "target": side, "run_id": RUN_ID,
                "plan": {"schema_version": "rlkernel.debug_matrix.v1", "cases": {}},
                "installed_hooks": {m: f"kit.hooks.{m}" for m in operators if not (
                    side == "training" and m == "logp" and self.impl(m, side) == "production")},
                "fallbacks": [], "profile_calls": {},
                "operators": operators}

    def write_readback(self, side: str, data: Any) -> None:
        self.write_json(f"readbacks/{SIDES[side]}-{side}-{100 + len(side)}.json", data)

    def sidecar(self, *, rank: int = 0, drift: float = 0.0, drift_tokens: int | None = None,
                ) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(7 + rank)
        train, roll, masks = [], [], []
        drifting = self.cell.cases.is_native or any("P" in self.cell.cases.of(m) for m in MODULES)
        for i in range(self.samples):
            n = 16 + i
            t = -torch.rand(n, generator=gen) * 4
            r = t.clone()
            if drifting:
                r = r + 1e-3 * torch.cos(torch.arange(n, dtype=torch.float32) + i)
            if drift and i == 0:
                k = n if drift_tokens is None else drift_tokens
                r[:k] = r[:k] + drift
            train.append(t)
            roll.append(r)
            masks.append(torch.ones(n))
        return {"schema_version": "rlkernel.vime_rocm_attention_mismatch_sidecar.v1", "rank": rank,
                "call_index": 0, "tensor_parallel_size": 1, "context_parallel_size": 1,
                "train_log_probs": train, "rollout_log_probs": roll, "loss_masks": masks,
                "total_lengths": [x.numel() + 8 for x in train],
                "response_lengths": [x.numel() for x in train]}

    def write_sidecar(self, data: Any, name: str = "rank00000.call00000000.pt") -> Path:
        path = self.dir / "mismatch-sidecars" / name
        torch.save(data, path)
        return path

    def write_json(self, rel: str, data: Any) -> Path:
        path = self.dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
        return path

    def edit_readback(self, side: str, fn: Any) -> None:
        data = self.readback(side)
        fn(data)
        self.write_readback(side, data)

    def log(self, *lines: str) -> None:
        with (self.dir / "run.log").open("a") as fh:
            fh.write("\n".join(lines) + "\n")

    def analyze(self) -> dict[str, Any]:
        return analyze_run(self.dir, cell=self.cell, mode=self.mode,
                           artifact_dir=f"cpu/{self.cell.slug}")
