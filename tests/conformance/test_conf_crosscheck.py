"""Issue 20: RL-Kernel's run-validator cross-checks, on fixtures written from its writers' facts.

- `installed_hooks` (RL-Kernel's `FrameworkOperatorIntegration`, upstream20.md section 2): every
  (side, module) a readback records carries a hook, production modules included; native Megatron
  logp (training logp P) has no hook and no record, only vime's log marker. RL-Kernel's run
  validator fails `{label} {module} hook was not installed` and `{label} production logp
  unexpectedly installed an RL-Kernel hook`.
- Exposure (section 5): vime's `step N` records carry per-sample means;
  `train/train_current_rollout_logprob_numel` x `batching.global_batch_size`, summed over the
  steps, must equal the sidecars' active tokens (`sidecar tokens {n} != runtime exposure {x}`).

The sidecars are upstream_layout.py's tp 2 x cp 2 design: 2 calls (steps) x 2 samples, 55 active
tokens: step 0 holds 10 + 13 = 23 (per-sample mean 11.5), step 1 14 + 18 = 32 (mean 16.0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cellkit import MODULES, CellKit
from upstream_layout import upstream_cell

NUMEL = "train/train_current_rollout_logprob_numel"
NATIVE = ("linear_logp native active: backend_id=vime.utils.ppo_utils."
          "calculate_log_probs_and_entropy contract_id=vime.native.linear_logp.v1 "
          "route=unconfigured device=cuda")
# vime's hook ids are comma-joined import paths (upstream20.md section 2)
HOOKS = {m: f"rl_engine.integrations.orchestrators.vime.patches.{m},rl_engine.{m}"
         for m in MODULES}


def step_line(step: int, numel: float) -> str:
    """vime's `step N` record (per-sample means), behind a Ray actor prefix."""
    return (f"(MegatronTrainRayActor pid=91) [2026-12-01 10:00:0{step}] train.py:412 - step "
            f"{step}: {{'train/train_rollout_logprob_abs_diff': 0.0, "
            f"'train/train_current_rollout_logprob_mismatch_count': 0.0, "
            f"'train/train_current_rollout_logprob_max_abs_diff': 0.0, '{NUMEL}': {numel!r}}}")


def exposure_cell(tmp_path: Path, *, numels: tuple[float, ...] = (11.5, 16.0),
                  batching: Any = "default", rounds: int = 2) -> CellKit:
    """The clean tp2 x cp2 R/R cell with RL-Kernel's manifest fields and vime's step records
    (`batching` None: the manifest has none)."""
    batching = {"global_batch_size": 2} if batching == "default" else batching
    k = upstream_cell(tmp_path, clean=True)
    manifest: dict[str, Any] = {"arm": {"attention_case": "R/R", "ffn_case": "R/R",
                                        "logp_case": "R/R"}, "num_rollout": rounds,
                                "topology": {"tp": 2, "cp": 2}}
    if batching is not None:
        manifest["batching"] = batching
    k.write_json("manifest.json", manifest)
    k.log(*(step_line(s, n) for s, n in enumerate(numels)))
    return k


# ---------------------------------------------------------------------------------------------
# Runtime exposure.


def test_per_sample_means_times_batch_equal_the_sidecar_tokens(tmp_path: Path) -> None:
    rec = exposure_cell(tmp_path).analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    ex = rec["runtime_exposure"]
    assert (ex["checked"], ex["exposure"], ex["sidecar_tokens"], ex["global_batch_size"],
            ex["steps"]) == (True, 55, 55, 2, [0, 1])
    assert ex["reasons"] == [] and ex["notes"] == []
    assert rec["active_token_count"] == 55


def test_totals_printed_as_means_are_a_reason_naming_both_numbers(tmp_path: Path) -> None:
    rec = exposure_cell(tmp_path, numels=(23, 32)).analyze()  # per-step totals, not means
    assert rec["verdict"] == "incomparable"
    assert rec["reasons"] == [
        "sidecar tokens 55 != runtime exposure 110: the mismatch sidecars hold 55 active tokens, "
        f"the step records' per-sample {NUMEL} x global_batch_size 2 over steps [0, 1] sum to "
        "110"]


def test_a_step_short_of_the_sidecars_is_a_reason(tmp_path: Path) -> None:
    rec = exposure_cell(tmp_path, numels=(11.5, 15.5)).analyze()
    assert rec["verdict"] == "incomparable"
    assert rec["reasons"][0].startswith("sidecar tokens 55 != runtime exposure 54: ")
    assert len(rec["reasons"]) == 1


def test_without_global_batch_size_it_is_a_note_not_a_pass(tmp_path: Path) -> None:
    rec = exposure_cell(tmp_path, numels=(23, 32), batching=None).analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    ex = rec["runtime_exposure"]
    assert ex["checked"] is False and ex["exposure"] is None
    assert ex["notes"] == [
        "manifest.json has no batching.global_batch_size: the step records' per-sample means "
        "cannot be turned into token totals; sidecar tokens not cross-checked against the "
        "runtime exposure"]


@pytest.mark.parametrize(("kw", "reason"), [
    ({"batching": {"global_batch_size": "2"}},
     "manifest.json batching.global_batch_size is '2', not a positive integer: sidecar tokens "
     "not cross-checked against the runtime exposure"),
    ({"batching": {"global_batch_size": 0}},
     "manifest.json batching.global_batch_size is 0, not a positive integer: sidecar tokens "
     "not cross-checked against the runtime exposure"),
    ({"numels": (11.5,)},
     "step records cover steps [0], but manifest.json num_rollout = 2 expects 0..1"),
    ({"numels": (11.5, 0.0)}, f"step 1 has no active tokens ({NUMEL} = 0.0)"),
    ({"numels": (11.25, 16.0)},
     f"step 0: {NUMEL} 11.25 x global_batch_size 2 = 22.5 is not a whole number of tokens"),
])
def test_unusable_exposure_evidence_is_a_reason(tmp_path: Path, kw: dict[str, Any],
                                                reason: str) -> None:
    rec = exposure_cell(tmp_path, **kw).analyze()
    assert rec["verdict"] == "incomparable"
    assert rec["reasons"] == [reason]


def test_a_step_record_without_a_token_count_is_a_reason(tmp_path: Path) -> None:
    k = exposure_cell(tmp_path, numels=(11.5,), rounds=2)
    k.log("step 1: {'train/pg_loss': 0.25}")
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert rec["reasons"] == [f"step 1: {NUMEL} is missing or not a finite number (None): "
                              "sidecar tokens not cross-checked against the runtime exposure"]


def test_last_record_of_a_step_wins(tmp_path: Path) -> None:
    k = exposure_cell(tmp_path, numels=(99.0, 16.0))
    k.log(step_line(0, 11.5))  # RL-Kernel's parser keeps the last record per step
    rec = k.analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    assert rec["runtime_exposure"]["exposure"] == 55


# ---------------------------------------------------------------------------------------------
# installed_hooks.


def hooked_cell(tmp_path: Path, module: str = "attention", case: str = "R/R",
                drop: tuple[str, str] | None = None) -> CellKit:
    """A cell whose readbacks carry vime's hook ids for every recorded module; `drop` =
    (side, module) removes one."""
    k = CellKit(tmp_path, module=module, case=case).write()
    for side in ("training", "rollout"):
        def edit(d: dict[str, Any], side: str = side) -> None:
            d["installed_hooks"] = {m: HOOKS[m] for m in d["installed_hooks"]
                                    if (side, m) != drop}
        k.edit_readback(side, edit)
    return k


def test_every_recorded_module_hooked_is_valid(tmp_path: Path) -> None:
    rec = hooked_cell(tmp_path, case="P/R").analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    assert rec["installed_hooks"]["training"] == HOOKS  # production attention hooked too


@pytest.mark.parametrize(("case", "drop", "reason"), [
    ("R/R", ("rollout", "ffn"),
     "ffn rollout: ffn hook was not installed (the readback records the module as rl_kernel, "
     "but installed_hooks of vllm-rollout-107.json has no entry for it): R route unproven"),
    ("P/R", ("training", "attention"),
     "attention training: attention hook was not installed (the readback records the module as "
     "production, but installed_hooks of megatron-training-108.json has no entry for it): P "
     "route unproven"),
])
def test_a_recorded_module_without_a_hook_is_an_error(tmp_path: Path, case: str,
                                                      drop: tuple[str, str], reason: str) -> None:
    rec = hooked_cell(tmp_path, case=case, drop=drop).analyze()
    assert rec["verdict"] == "error"
    assert rec["reasons"] == [reason]


def test_native_logp_with_a_hook_is_incomparable(tmp_path: Path) -> None:
    k = hooked_cell(tmp_path, module="logp", case="P/R")

    def native(d: dict[str, Any]) -> None:  # RL-Kernel's form, plus the hook it must not have
        d["operators"].pop("logp")
        d["installed_hooks"] = dict(HOOKS)
    k.edit_readback("training", native)
    k.log(f"[time] ppo_utils.py:88 - {NATIVE}")
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert rec["reasons"] == [
        f"route: logp training: native (production) Megatron logp installed an RL-Kernel hook "
        f"({HOOKS['logp']}): production logp unexpectedly installed an RL-Kernel hook"]
    k.edit_readback("training", lambda d: (d["operators"].pop("logp"), d["installed_hooks"].pop(
        "logp", None)))  # no hook, no record, the marker: RL-Kernel's native form
    rec = k.analyze()
    assert rec["verdict"] == "valid", rec["reasons"]


def test_mode_off_does_not_ask_for_hooks(tmp_path: Path) -> None:
    k = hooked_cell(tmp_path, case="P/P", drop=("rollout", "attention"))
    k.mode = "off"
    k.write_meta()
    rec = k.analyze()
    assert "attention hook was not installed" not in " ".join(rec["reasons"])


# ---------------------------------------------------------------------------------------------
# The gaps closed after issue 20: samples, P modules without a record, native logp's record.


def test_sidecar_samples_equal_num_rollout_times_batch(tmp_path: Path) -> None:
    ex = exposure_cell(tmp_path).analyze()["runtime_exposure"]
    assert (ex["sidecar_samples"], ex["expected_samples"]) == (4, 4)


def test_sidecar_samples_short_of_the_manifest_is_a_reason(tmp_path: Path) -> None:
    """RL-Kernel's `sidecar samples {n} != expected {m}` (upstream20.md section 5)."""
    rec = exposure_cell(tmp_path, numels=(11.5, 16.0, 0.5), rounds=3).analyze()
    assert rec["verdict"] == "incomparable"
    assert ("sidecar samples 4 != expected 6: the mismatch sidecars hold 4 samples, "
            "manifest.json says num_rollout 3 x batching.global_batch_size 2") in rec["reasons"]


def test_a_p_module_without_a_record_is_an_error(tmp_path: Path) -> None:
    """RL-Kernel's validator asks every production module but native Megatron logp for a hook
    and calls (`{label} {module} had zero calls`): a P module no readback records is unproven."""
    k = hooked_cell(tmp_path, case="P/R")

    def gone(d: dict[str, Any]) -> None:
        d["operators"].pop("attention")
        d["installed_hooks"].pop("attention")
    k.edit_readback("training", gone)
    rec = k.analyze()
    assert rec["verdict"] == "error"
    assert rec["reasons"] == [
        "attention training: P requested but no readback records the module (RL-Kernel: "
        "attention had zero calls): P route unproven"]


def test_native_logp_with_a_readback_record_is_incomparable(tmp_path: Path) -> None:
    """Native Megatron logp runs outside RL-Kernel's provider: a record of it contradicts the
    route (`{label} production logp unexpectedly entered provider readback`)."""
    k = hooked_cell(tmp_path, module="logp", case="P/R")

    def recorded(d: dict[str, Any]) -> None:  # no hook, but a production record
        d["installed_hooks"].pop("logp", None)
        d["operators"]["logp"] = dict(d["operators"]["ffn"], module="logp",
                                      implementation="production",
                                      backend_id="megatron.production.logp")
    k.edit_readback("training", recorded)
    k.log(f"[time] ppo_utils.py:88 - {NATIVE}")
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert any(r.endswith("production logp unexpectedly entered provider readback")
               for r in rec["reasons"]), rec["reasons"]
