"""The reference job end to end (tiny preset, subprocess per cell), as the plugin would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pytest_rlkernel_matrix.workload.model import (
    PRESETS,
    checkpoint_fingerprint,
    init_weights,
)

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--num-prompts", "4", "--max-new-tokens", "40", "--micro-batch-size", "3"]


def run_cell(tmp: Path, cases: str = "R/R R/R R/R", mode: str = "strict",
             fault: str | None = None, args: list[str] | None = None,
             artifact: bool = True, extra_env: dict[str, str] | None = None,
             ) -> tuple[subprocess.CompletedProcess[str], Path]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RL_KERNEL_", "RLK_REF_"))}
    env.update(extra_env or {})
    att, ffn, logp = cases.split()
    env.update(RL_KERNEL_MODE=mode, RL_KERNEL_ATTENTION_CASE=att, RL_KERNEL_FFN_CASE=ffn,
               RL_KERNEL_LOGP_CASE=logp, RL_KERNEL_RUN_ID=tmp.name, PYTHONPATH=str(ROOT))
    if artifact:
        env["RL_KERNEL_ARTIFACT_DIR"] = str(tmp)
    if fault:
        env["RLK_REF_FAULT"] = fault
    proc = subprocess.run(
        [sys.executable, "-m", "pytest_rlkernel_matrix.workload", *FAST, *(args or [])],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return proc, tmp


def sidecar(tmp: Path) -> dict:
    return torch.load(tmp / "mismatch-sidecars" / "rank00000.call00000000.pt",
                      weights_only=True)


def mismatches(tmp: Path) -> tuple[int, int]:
    sc = sidecar(tmp)
    n = sum(int(m.sum()) for m in sc["loss_masks"])
    bad = sum(int(torch.ne(a, b).sum())
              for a, b in zip(sc["train_log_probs"], sc["rollout_log_probs"], strict=True))
    return bad, n


def readbacks(tmp: Path) -> dict[str, dict]:
    out = {}
    for f in (tmp / "readbacks").glob("*.json"):
        rb = json.loads(f.read_text())
        out[rb["target"]] = rb
    return out


def test_rr_strict_bitwise(tmp_path: Path) -> None:
    proc, d = run_cell(tmp_path)
    assert proc.returncode == 0, proc.stderr
    bad, n = mismatches(d)
    assert bad == 0 and n > 50
    rbs = readbacks(d)
    assert set(rbs) == {"training", "rollout"}
    for rb in rbs.values():
        for op in rb["operators"].values():
            assert op["implementation"] == "rl_kernel" and op["call_count"] > 0
            assert op["execution_mode"] == "eager"  # CPU: no graphs, no Triton
            assert op["provenance"]["execution"]["triton_used"] is False
            assert op["provenance"]["arithmetic_contract"] == "bitwise"
    assert rbs["rollout"]["framework"] == "vllm"
    # RL-Kernel's per-version audits: training rank 0 exports, the rollout side's copy beside
    audits = [json.loads(f.read_text()) for f in (d / "weight-audit").glob("*.json")]
    loaded = [json.loads(f.read_text()) for f in (d / "weight-audit" / "rollout").glob("*.json")]
    assert audits and [a["version"] for a in audits] == [a["version"] for a in loaded]
    assert all(a["sha256"] == b["sha256"] for a, b in zip(audits, loaded, strict=True))
    sc = sidecar(d)
    assert sc["tensor_parallel_size"] == 1 and len(sc["train_log_probs"]) == 4
    assert sc["response_lengths"] == [t.numel() for t in sc["rollout_log_probs"]]
    out = proc.stdout
    assert "rollout 0: {'rollout/response_lengths'" in out and "'perf/step_time'" in out
    assert out.count("[RL-Kernel][route]") == 6 and "contract_id=linear_logp:" in out
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["cases"]["attention"] == "R/R" and manifest["fault_drill"] is None
    assert manifest["gc"].startswith("manual")  # no collection inside a timed phase


def test_pp_has_mismatches(tmp_path: Path) -> None:
    proc, d = run_cell(tmp_path, "P/P P/P P/P", mode="audit")
    assert proc.returncode == 0, proc.stderr
    bad, _ = mismatches(d)
    assert bad > 0
    assert readbacks(d)["training"]["operators"]["ffn"]["backend_id"] == \
        "megatron.production.ffn"


def test_recorded_fallback_strict_fails_after_readback(tmp_path: Path) -> None:
    proc, d = run_cell(tmp_path, fault="recorded_fallback:ffn:training")
    assert proc.returncode == 3
    rb = readbacks(d)["training"]
    assert rb["operators"]["ffn"]["implementation"] == "production"
    assert rb["operators"]["ffn"]["provenance"]["fallback"] is True
    assert rb["fallbacks"][0]["module"] == "ffn"
    assert "module=ffn requested=rl_kernel actual=" in proc.stdout
    assert "fallback=true" in proc.stdout and "[rlk-reference][fault-drill]" in proc.stdout
    assert json.loads((d / "manifest.json").read_text())["fault_drill"]["kind"] == \
        "recorded_fallback"


def test_recorded_fallback_audit_continues(tmp_path: Path) -> None:
    proc, d = run_cell(tmp_path, mode="audit", fault="recorded_fallback")
    assert proc.returncode == 0, proc.stderr
    assert readbacks(d)["rollout"]["fallbacks"][0]["module"] == "attention"
    assert mismatches(d)[0] > 0


def test_silent_fallback_claims_r_but_drifts(tmp_path: Path) -> None:
    proc, d = run_cell(tmp_path, fault="silent_fallback:logp")
    assert proc.returncode == 0, proc.stderr
    op = readbacks(d)["rollout"]["operators"]["logp"]
    assert op["implementation"] == "rl_kernel" and op["provenance"]["fallback"] is False
    assert mismatches(d)[0] > 0  # only the numeric contract can catch it


def test_corrupt_weight_audit_differs(tmp_path: Path) -> None:
    proc, d = run_cell(tmp_path, fault="corrupt_weight")
    assert proc.returncode == 0, proc.stderr
    training = json.loads((d / "weight-audit" / "0.json").read_text())
    rollout = json.loads((d / "weight-audit" / "rollout" / "0.json").read_text())
    assert training["version"] == rollout["version"] == "0"
    assert training["sha256"] != rollout["sha256"]


def test_unsupported_strict_fails_closed(tmp_path: Path) -> None:
    proc, d = run_cell(tmp_path, fault="unsupported:attention:rollout")
    assert proc.returncode == 4
    assert "[RL-Kernel][unsupported] module=attention side=rollout " \
           "class=platform_unsupported" in proc.stdout
    cap = readbacks(d)["rollout"]["capability"]
    assert cap["status"] == "unsupported"
    assert cap["capability_decisions"][0]["supported"] is False
    assert not (d / "mismatch-sidecars" / "rank00000.call00000000.pt").exists()


def test_unsupported_auto_falls_back(tmp_path: Path) -> None:
    proc, d = run_cell(tmp_path, mode="auto", fault="unsupported")
    assert proc.returncode == 0, proc.stderr
    rb = readbacks(d)["rollout"]
    assert rb["fallbacks"][0]["reason"].startswith("unsupported:")
    assert rb["operators"]["attention"]["implementation"] == "production"


def test_off_mode_native_no_readbacks(tmp_path: Path) -> None:
    proc, d = run_cell(tmp_path, mode="off")
    assert proc.returncode == 0, proc.stderr
    assert "[RL-Kernel] mode=off: native route" in proc.stdout
    assert "[RL-Kernel][route]" not in proc.stdout
    assert not list((d / "readbacks").glob("*.json"))
    assert mismatches(d)[0] > 0 and list((d / "weight-audit").glob("*.json"))
    assert list((d / "weight-audit" / "rollout").glob("*.json"))
    assert "contract_id=vime.native.linear_logp.v1" in proc.stdout


def test_hf_checkpoint_loads_and_is_fingerprinted(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = PRESETS["tiny"]
    w = init_weights(cfg, 7, torch.bfloat16, torch.device("cpu"))
    (ckpt / "config.json").write_text(json.dumps(cfg.to_hf()))
    names = sorted(w)
    save_file({n: w[n] for n in names[:10]}, str(ckpt / "model-00001-of-00002.safetensors"))
    save_file({n: w[n] for n in names[10:]}, str(ckpt / "model-00002-of-00002.safetensors"))
    proc, d = run_cell(tmp_path / "cell", args=["--checkpoint", str(ckpt)])
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["checkpoint"]["fingerprint"] == checkpoint_fingerprint(ckpt)
    assert manifest["checkpoint"]["fingerprint"].startswith("sha256:")
    assert mismatches(d)[0] == 0


def test_missing_artifact_dir_is_a_clear_error(tmp_path: Path) -> None:
    proc, _ = run_cell(tmp_path, artifact=False)
    assert proc.returncode == 2
    assert "RL_KERNEL_ARTIFACT_DIR is not set" in proc.stderr


@pytest.mark.parametrize("bad", ["X/Y", "nonsense"])
def test_bad_case_or_fault_is_usage_error(tmp_path: Path, bad: str) -> None:
    if bad == "X/Y":
        proc, _ = run_cell(tmp_path, cases="X/Y R/R R/R")
    else:
        proc, _ = run_cell(tmp_path, fault=bad)
    assert proc.returncode == 2 and "[rlk-reference] error" in proc.stderr
