"""The engines reference job (vLLM rollout + Megatron-core training forward).

Unit tests of the HF <-> Megatron mapping need only torch. The Megatron-core hook tests need the
``[engines]`` extra (``megatron-core``); the matrix test needs ``vllm`` too and starts one vLLM
engine per cell (minutes on a 2-core box): it runs only with ``RLK_ENGINES_MATRIX=1`` (CI sets it
when it installs the extra). Every skip says why.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pytest_rlkernel_matrix.engines import mapping  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODULES = ("attention", "ffn", "logp")
ROUTES = [dict(zip(MODULES, combo, strict=True))
          for combo in itertools.product(("production", "rl_kernel"), repeat=3)]
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _hf(shape: mapping.Shape, hidden: int = 16, inter: int = 24,
        vocab: int = 40) -> dict[str, torch.Tensor]:
    from pytest_rlkernel_matrix.workload.model import ModelConfig, init_weights, weight_names

    cfg = ModelConfig(hidden, shape.num_layers, shape.num_heads, shape.num_kv_heads,
                      shape.head_dim, inter, vocab)
    w = init_weights(cfg, 7, torch.bfloat16, torch.device("cpu"))
    assert sorted(w) == sorted(weight_names(cfg))
    return w


@pytest.mark.parametrize("impls", ROUTES, ids=lambda r: "-".join(v[0] for v in r.values()))
def test_mapping_round_trips_every_tensor(impls: dict[str, str]) -> None:
    shape = mapping.Shape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    hf = _hf(shape)
    mg = mapping.hf_to_megatron(hf, shape, impls)
    back = mapping.megatron_to_hf(mg, shape, impls)
    assert sorted(back) == sorted(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    # every Megatron tensor is used: nothing silently dropped
    assert sum(t.numel() for t in mg.values()) == sum(t.numel() for t in hf.values())


def test_qkv_layout_is_grouped_per_query_group() -> None:
    shape = mapping.Shape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=3)
    h = 5
    q = torch.arange(4 * 3 * h).reshape(12, h).float()
    k = 1000 + torch.arange(2 * 3 * h).reshape(6, h).float()
    v = 2000 + torch.arange(2 * 3 * h).reshape(6, h).float()
    fused = mapping.fuse_qkv(q, k, v, shape)
    # group 0: q heads 0,1 then k head 0 then v head 0; group 1 likewise
    want = torch.cat([q[0:6], k[0:3], v[0:3], q[6:12], k[3:6], v[3:6]])
    assert torch.equal(fused, want)
    assert all(torch.equal(a, b) for a, b in
               zip(mapping.split_qkv(fused, shape), (q, k, v), strict=True))


def test_probe_operator_names_map_onto_both_engines_modules() -> None:
    """Every probe operator (HF Qwen3 path) has a vLLM and a Megatron-core module; the fused
    QKV output un-interleaves to HF's q/k/v outputs exactly, and back."""
    from pytest_rlkernel_matrix.workload.evidence.probe import operator_names

    for op in operator_names(2):
        for engine in ("vllm", "megatron"):
            path, how = mapping.engine_module(op, engine)
            assert how in ("out", "input") or how.split(":")[1] in "012", (op, how)
            assert path.split(".")[0] in ("model", "decoder", "embedding", "logits_processor",
                                          "output_layer"), path
    assert mapping.engine_module("model.layers.1.self_attn.k_proj", "megatron") == (
        "decoder.layers.1.self_attention.linear_qkv", "qkv:1")
    assert mapping.engine_module("model.layers.0.mlp.act_fn", "megatron") == (
        "decoder.layers.0.mlp.linear_fc2", "input")
    assert mapping.engine_module("model.layers.0.mlp.up_proj", "vllm") == (
        "model.layers.0.mlp.gate_up_proj", "half:1")
    assert mapping.engine_module("lm_head", "vllm") == ("logits_processor", "out")
    with pytest.raises(KeyError):
        mapping.engine_module("model.layers.x.mlp.act_fn", "vllm")
    shape = mapping.Shape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=3)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 5, generator=gen) for n in (12, 6, 6))
    out = mapping.fuse_qkv(q, k, v, shape).t()[None]  # [1, h, fused]: rows of an activation
    got = mapping.split_qkv_out(out, shape)
    assert all(torch.equal(a, b.t()[None]) for a, b in zip(got, (q, k, v), strict=True))
    assert torch.equal(mapping.fuse_qkv_out(*got, shape), out)


def test_probe_request_rows_name_each_vllm_row_by_sample_and_position() -> None:
    """A prefill of two prompts, then decode steps: each request is known by its first KV
    block, tied to its sample at its prefill; the logit rows are each request's last row."""
    from pytest_rlkernel_matrix.engines.probe import ProbeError, RequestRows

    rows = RequestRows([[5, 6, 7], [8, 9]])
    keys = rows.assign([8, 9, 5, 6, 7], [0, 1, 0, 1, 2], [0, 2, 5], [2, 3], [4, 0])
    assert keys == [(1, 0), (1, 1), (0, 0), (0, 1), (0, 2)]
    assert rows.logit_keys == [(1, 1), (0, 2)]
    keys = rows.assign([11, 12], [3, 2], [0, 1, 2], [4, 3], [0, 4])  # decode, order swapped
    assert keys == [(0, 3), (1, 2)] and rows.logit_keys == keys
    with pytest.raises(ProbeError, match="not seen at its prefill"):
        rows.assign([1], [4], [0, 1], [5], [9])
    with pytest.raises(ProbeError, match="metadata says"):
        rows.assign([1], [7], [0, 1], [5], [0])
    with pytest.raises(ProbeError, match="match 0 prompts"):
        rows.assign([1, 2], [0, 1], [0, 2], [2], [3])


def test_audit_cast_refuses_lossy_values() -> None:
    ok = mapping.as_checkpoint_dtype({"w": torch.tensor([1.5, 2.0])}, torch.bfloat16)
    assert ok["w"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"w: torch\.float32 value not representable"):
        mapping.as_checkpoint_dtype({"w": torch.tensor([1.0 + 2 ** -20])}, torch.bfloat16)


def test_checkpoint_writer_is_deterministic_and_never_overwrites(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    from pytest_rlkernel_matrix.engines.checkpoint import write_checkpoint
    from pytest_rlkernel_matrix.machine.preflight import fingerprint_model_dir

    a, b = write_checkpoint(tmp_path / "a"), write_checkpoint(tmp_path / "b")
    assert fingerprint_model_dir(a)["sha256"] == fingerprint_model_dir(b)["sha256"]
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and (a / "tokenizer.json").is_file()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "other.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not touching it"):
        write_checkpoint(tmp_path / "c")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tokenizers")
    from pytest_rlkernel_matrix.engines.checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ck") / "tiny-qwen3")


def _trainer(checkpoint: Path, impls: dict[str, str]) -> tuple[object, object, dict]:
    from pytest_rlkernel_matrix.engines.megatron_side import MegatronTrainer
    from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling
    from pytest_rlkernel_matrix.workload.model import load_checkpoint

    cfg = json.loads((checkpoint / "config.json").read_text())
    _, w = load_checkpoint(checkpoint, torch.bfloat16, torch.device("cpu"))
    k = SideKernels.build("training", impls, torch.bfloat16,
                          Tiling.for_device(torch.device("cpu"), 64), cfg["rms_norm_eps"])
    return MegatronTrainer(cfg, w, impls, k, 64), k, w


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core not installed (the [engines] extra)")
def test_megatron_hooks_count_calls_and_r_matches_the_builtin_r_path(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_rlkernel_matrix.workload.env import Env, resolve_route
    from pytest_rlkernel_matrix.workload.job import Rollout, readback, run_training
    from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling
    from pytest_rlkernel_matrix.workload.model import Qwen3, load_checkpoint, weights_sha256

    gen = torch.Generator().manual_seed(3)
    toks = [torch.randint(2, 512, (n,), generator=gen) for n in (14, 20, 9)]
    plens, order, mb = [5, 8, 4], [2, 0, 1], 2
    impls = {"attention": "rl_kernel", "ffn": "production", "logp": "rl_kernel"}
    trainer, k, w = _trainer(checkpoint, impls)
    lp = trainer.selected_logprobs(toks, plens, mb, order)
    # 2 layers x 2 micro-batches for attention (R kernel) and FFN (Megatron MLP, pre-hook)
    assert {m: k.module(m).call_count for m in MODULES} == {"attention": 4, "ffn": 4, "logp": 2}
    hf_back = mapping.as_checkpoint_dtype(trainer.hf_weights(), torch.bfloat16)
    assert weights_sha256(hf_back) == weights_sha256(w)  # audit hashes what Megatron loaded

    # R everywhere: Megatron with the R modules equals the built-in workload's R path bitwise
    r_all = dict.fromkeys(MODULES, "rl_kernel")
    trainer_r, _, _ = _trainer(checkpoint, r_all)
    got = trainer_r.selected_logprobs(toks, plens, mb, order)
    cfg, w2 = load_checkpoint(checkpoint, torch.bfloat16, torch.device("cpu"))
    ref_k = SideKernels.build("training", r_all, torch.bfloat16,
                              Tiling.for_device(torch.device("cpu"), 64), cfg.rms_norm_eps)
    ro = Rollout(toks, plens, [torch.zeros(t.numel() - p) for t, p in zip(toks, plens,
                                                                          strict=True)])
    ref = run_training(Qwen3(cfg, w2, 64), ref_k, ro, mb, 1.0, order)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(lp, ref, strict=True))  # P FFN drifts

    monkeypatch.setenv("RL_KERNEL_ARTIFACT_DIR", str(checkpoint.parent / "art"))
    env = Env.from_environ()
    env.cases.update(attention="R/R", ffn="P/P", logp="R/R")
    rb = readback(env, resolve_route(env, "training", None, "cpu"), k, "cpu")
    assert rb["operators"]["ffn"]["backend_id"] == "megatron.production.ffn"
    assert rb["operators"]["ffn"]["call_count"] == 4
    assert rb["operators"]["attention"]["backend_id"] == "rlk-ref.attention.deterministic.v1"


@pytest.mark.skipif(not (HAVE_VLLM and HAVE_MEGATRON),
                    reason="vllm / megatron-core not installed (pip install -e '.[engines]')")
@pytest.mark.skipif(os.environ.get("RLK_ENGINES_MATRIX") != "1",
                    reason="starts one vLLM engine per cell (minutes each on 2 cores): "
                    "set RLK_ENGINES_MATRIX=1 to run it (CI does when it installs [engines])")
def test_engines_matrix_rr_bitwise_and_pp_drifts(pytester: pytest.Pytester,
                                                 tmp_path: Path) -> None:
    from pytest_rlkernel_matrix.engines.checkpoint import write_checkpoint

    write_checkpoint(REPO / "examples" / ".rlk-engines" / "tiny-qwen3")  # engines.toml's
    root = tmp_path / "root"
    result = pytester.runpytest_subprocess(
        f"--rlk-matrix={REPO / 'examples' / 'engines.toml'}", f"--rlk-matrix-root={root}",
        "-p", "no:cacheprovider", "-k", "attention and (R/R or P/P)")
    report = json.loads((root / "matrix-report.json").read_text())
    cells = {(c["module"], c["case"]): c for c in report["cells"]}
    rr, pp = cells[("attention", "R/R")], cells[("attention", "P/P")]
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert rr["verdict"] == "valid" and rr["contract"]["kind"] == "bitwise"
    assert rr["mismatch_count"] == 0 and rr["active_token_count"] > 0
    assert pp["verdict"] == "valid" and pp["mismatch_count"] > 0
    assert json.loads((root / "preflight.json").read_text())["checkpoint"]["exists"] is True
    for cell in (rr, pp):  # readbacks written from inside both engines, counted by the hooks
        for m in MODULES:
            for side in ("training", "rollout"):
                assert cell["routes"][m][side]["call_count"] > 0, (cell["case"], m, side)
        # RL-Kernel's per-version audits, hashed from what each engine loaded
        assert list(cell["weight_versions"]) == ["0"], cell["weight_versions"]
        audit = cell["weight_versions"]["0"]
        assert audit["training"] == audit["rollout"]
        assert cell["weight_audit"]["format"] == "upstream"
        assert cell["weight_audit"]["problems"] == []
    assert rr["routes"]["attention"]["rollout"]["backend_ids"] == [
        "rlk-ref.attention.deterministic.v1"]
    assert pp["routes"]["attention"]["rollout"]["backend_ids"] == ["vllm.production.attention"]
    assert pp["routes"]["attention"]["training"]["backend_ids"] == [
        "megatron.production.attention"]
    assert any("attention" in a["conclusion"] and "drift" in a["conclusion"]
               for a in report["attribution"])


def test_engines_writers_leave_rl_kernels_forms_and_a_valid_cell(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The engines job's writers (no engine needed): readback hooks for every recorded module
    (production included, none for native Megatron logp), route lines with the native marker,
    the per-version weight audit, a sidecar and per-sample-mean records every step, RL-Kernel's
    manifest fields. The plugin judges the cell they leave `valid` in RL-Kernel's forms."""
    from cellkit import RUN_ID, CellKit

    from pytest_rlkernel_matrix.engines import job as ej
    from pytest_rlkernel_matrix.report.record import analyze_run
    from pytest_rlkernel_matrix.workload.env import Env, resolve_route
    from pytest_rlkernel_matrix.workload.evidence.artifacts import Rollout, emit_step
    from pytest_rlkernel_matrix.workload.evidence.upstream import (
        manifest_fields,
        readback,
        route_lines,
        write_json,
        write_readbacks,
        write_weight_audits,
    )
    from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling

    sides = ("training", "rollout")
    kit = CellKit(tmp_path, module="logp", case="P/R")  # training logp: native Megatron
    kit.write_meta()
    (kit.dir / "exit-code").write_text("0\n")
    monkeypatch.setenv("RL_KERNEL_ARTIFACT_DIR", str(kit.dir))
    monkeypatch.setenv("RL_KERNEL_RUN_ID", RUN_ID)
    for m in MODULES:
        monkeypatch.setenv(f"RL_KERNEL_{m.upper()}_CASE", kit.cell.cases.of(m))
    env = Env.from_environ()
    for d in (env.readback_dir, env.sidecar_dir, env.weight_audit_dir):  # as run_cell does
        d.mkdir(parents=True, exist_ok=True)
    routes = {s: resolve_route(env, s, None, "cpu") for s in sides}
    tiling = Tiling.for_device(torch.device("cpu"), 64)
    kernels = {s: SideKernels.build(s, routes[s].actual, torch.bfloat16, tiling, 1e-6)
               for s in sides}
    for s in sides:
        for m in MODULES:
            kernels[s].module(m).call_count = 3
    gen = torch.Generator().manual_seed(5)
    w = {n: torch.randn(8, 4, generator=gen).bfloat16()
         for n in ("model.embed_tokens.weight", "lm_head.weight")}
    write_weight_audits(env.weight_audit_dir, ej.WEIGHT_VERSION, w, dict(w))
    write_json(kit.dir / "manifest.json", {"cases": env.cases, **manifest_fields(
        env.cases, steps=2, global_batch_size=3, tp=1, cp=1, world=1)})
    print("\n".join(route_lines(env, routes, ej.FRAMEWORKS, "cpu")))
    for step in range(2):
        plens, resp = [5, 6, 4], [4, 7, 5]
        toks = [torch.randint(2, 100, (p + r,), generator=gen) for p, r in zip(plens, resp,
                                                                             strict=True)]
        roll = [-torch.rand(r, generator=gen) for r in resp]
        train = [x.clone() for x in roll]
        train[1][0] += 2 ** -10  # P on the training side: a drift, reported not judged
        emit_step(env, step, Rollout(toks, plens, roll), train, None, resp, t_roll=0.5,
                  t_train=0.25, t_step=1.0, t_sync=0.0, peak=1)
    write_readbacks(env, routes, kernels, "cpu", patch=ej.patch_readback)
    log = capsys.readouterr().out
    (kit.dir / "run.log").write_text(log)

    assert "linear_logp native active: " in log and "module=logp requested" in log
    assert "target=training module=logp" not in log  # the marker, not a route line
    assert "requested=rl_kernel actual=rlk-ref.attention.deterministic.v1 fallback=false" in log
    assert sorted(p.name for p in env.sidecar_dir.iterdir()) == [
        "rank00000.call00000000.pt", "rank00000.call00000001.pt"]
    train_rb = json.loads(next(env.readback_dir.glob("megatron-training-*.json")).read_text())
    assert train_rb["installed_hooks"] == {m: ej.HOOKS["rl_kernel"]["training"][m]
                                           for m in ("attention", "ffn")}
    assert sorted(train_rb["operators"]) == ["attention", "ffn"]
    rec = analyze_run(kit.dir, cell=kit.cell, mode="strict", artifact_dir=f"cpu/{kit.cell.slug}")
    assert rec["verdict"] == "valid", rec["reasons"]
    assert rec["route_line_form"] == "upstream"
    wa = rec["weight_audit"]
    assert (wa["format"], wa["versions"], wa["rollout_audited"], wa["problems"]) == (
        "upstream", ["0"], True, [])
    ex = rec["runtime_exposure"]
    assert (ex["checked"], ex["exposure"], ex["sidecar_tokens"], ex["reasons"]) == (
        True, 32, 32, [])
    assert rec["active_token_count"] == 32 and rec["mismatch_count"] == 2
    assert rec["training_backend_id"] == "vime.utils.ppo_utils.calculate_log_probs_and_entropy"

    # production modules are hooked too (P/P everywhere): named after the engine's pre-hooks
    env.cases.update(dict.fromkeys(MODULES, "P/P"))
    for s in sides:
        route = resolve_route(env, s, None, "cpu")
        rb = ej.patch_readback(readback(env, route, kernels[s], "cpu"), s)
        want = [m for m in MODULES if (s, m) != ("training", "logp")]
        assert rb["installed_hooks"] == {m: ej.HOOKS["production"][s][m] for m in want}
        assert sorted(rb["operators"]) == want


# -- framework factors through vLLM's own settings (engines/factors.py) -----------------------

@pytest.mark.parametrize(("env", "logp_r", "want"), [
    ({}, False, {"max_num_seqs": 4, "logprobs_mode": "raw_logprobs"}),
    ({}, True, {"max_num_seqs": 4, "logprobs_mode": "raw_logits"}),
    ({"RLK_REF_ROLLOUT_BATCH": "1"}, False, {"max_num_seqs": 1, "logprobs_mode": "raw_logprobs"}),
    ({"RLK_REF_ROLLOUT_BATCH": "9"}, False, {"max_num_seqs": 4, "logprobs_mode": "raw_logprobs"}),
    ({"RLK_REF_SAMPLING": "processed"}, False,
     {"max_num_seqs": 4, "logprobs_mode": "processed_logprobs"}),
    ({"RLK_REF_SAMPLING": "processed"}, True,
     {"max_num_seqs": 4, "logprobs_mode": "processed_logprobs"}),
])
def test_engine_factors_map_onto_vllm_settings(env: dict[str, str], logp_r: bool,
                                               want: dict[str, object]) -> None:
    from pytest_rlkernel_matrix.engines.factors import EngineFactors

    f = EngineFactors.from_env(env)
    assert f.engine_settings(4, logp_r) == want
    assert f.effect["rollout_batch"]["applied"] is (want["max_num_seqs"] < 4)
    assert f.effect["sampling"]["applied"] is ("RLK_REF_SAMPLING" in env)
    assert f"logprobs_mode={want['logprobs_mode']}" in f.effect["sampling"]["note"]
    assert any(f"max_num_seqs={want['max_num_seqs']}" in ln for ln in f.lines())


@pytest.mark.parametrize("sync", ["bf16", "stale"])
def test_engine_weight_sync_is_recorded_as_not_acting(sync: str) -> None:
    from pytest_rlkernel_matrix.engines.factors import EngineFactors

    f = EngineFactors.from_env({"RLK_REF_WEIGHT_SYNC": sync})
    assert f.effect["weight_sync"]["applied"] is False
    assert "could not act" in f.effect["weight_sync"]["note"]


@pytest.mark.parametrize(("env", "needle"), [
    ({"RLK_REF_ROLLOUT_BATCH": "0"}, "RLK_REF_ROLLOUT_BATCH='0': expected 'all' or an int >= 1"),
    ({"RLK_REF_SAMPLING": "logits"}, "RLK_REF_SAMPLING='logits'"),
    ({"RLK_REF_WEIGHT_SYNC": "fast"}, "RLK_REF_WEIGHT_SYNC='fast'"),
])
def test_engine_factor_usage_errors(env: dict[str, str], needle: str) -> None:
    from pytest_rlkernel_matrix.engines.factors import EngineFactors
    from pytest_rlkernel_matrix.workload.env import UsageError

    with pytest.raises(UsageError, match=needle.replace("(", r"\(")):
        EngineFactors.from_env(env)


def test_engine_factor_usage_error_exits_before_any_engine(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RL_KERNEL_", "RLK_REF_"))}
    env.update(RL_KERNEL_MODE="audit", RL_KERNEL_ATTENTION_CASE="R/R", RL_KERNEL_FFN_CASE="R/R",
               RL_KERNEL_LOGP_CASE="R/R", RL_KERNEL_RUN_ID="x",
               RL_KERNEL_ARTIFACT_DIR=str(tmp_path), RLK_REF_SAMPLING="logits",
               PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "pytest_rlkernel_matrix.engines"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "[rlk-engines] error: RLK_REF_SAMPLING='logits'" in done.stderr
    assert not any(tmp_path.iterdir())  # no manifest: no engine was started
    env.pop("RLK_REF_SAMPLING")
    env["RLK_REF_PERTURB"] = "rollout:model.layers.2.mlp.down_proj"  # the tiny model has 2
    done = subprocess.run([sys.executable, "-m", "pytest_rlkernel_matrix.engines",
                           "--checkpoint", str(tmp_path / "absent")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "[rlk-engines] error: RLK_REF_PERTURB='rollout:model.layers.2.mlp.down_proj'" in (
        done.stderr)
    assert not any(tmp_path.iterdir())  # neither a checkpoint nor a manifest


ENGINE_FACTORS = '''
[factors.rollout_batch]
baseline = "all"
variants = { one = { env = { RLK_REF_ROLLOUT_BATCH = "1" } } }

[factors.sampling]
baseline = "raw"
variants = { processed = { env = { RLK_REF_SAMPLING = "processed" } } }
expect = "logprob_drift"
'''


@pytest.mark.slow
@pytest.mark.skipif(not (HAVE_VLLM and HAVE_MEGATRON),
                    reason="vllm / megatron-core not installed (pip install -e '.[engines]')")
def test_engines_factor_cells_through_vllm_settings(pytester: pytest.Pytester,
                                                    tmp_path: Path) -> None:
    """R/R in real vLLM: max_num_seqs=1 changes no logprob; processed_logprobs drifts."""
    from pytest_rlkernel_matrix.engines.checkpoint import write_checkpoint

    ck = REPO / "examples" / ".rlk-engines" / "tiny-qwen3"
    write_checkpoint(ck)
    text = (REPO / "examples" / "engines.toml").read_text().replace(
        ".rlk-engines/tiny-qwen3", str(ck))
    path = pytester.makefile(".toml", matrix=text + ENGINE_FACTORS)
    root = tmp_path / "root"
    result = pytester.runpytest_subprocess(f"--rlk-matrix={path}", f"--rlk-matrix-root={root}",
                                           "-p", "no:cacheprovider", "-m", "rlk_factor")
    report = json.loads((root / "matrix-report.json").read_text())
    assert result.ret == 0, result.stdout.str()[-3000:]
    cells = {c["artifact_dir"].split("/")[-1]: c for c in report["cells"]}
    words = {(a["factor"], a["variant"]): a["conclusion"] for a in report["factor_attribution"]}
    one = cells["factor-rollout_batch-one-rr"]
    manifest = json.loads((root / one["artifact_dir"] / "manifest.json").read_text())
    assert manifest["engine_settings"] == {"max_num_seqs": 1, "logprobs_mode": "raw_logits"}
    assert manifest["factors"]["rollout_batch"]["applied"] is True
    c = one["factor"]["comparison"]
    assert c["compared_logprobs"] > 0 and c["rollout_logprobs_differ"] == 0
    assert words[("rollout_batch", "one")].startswith(
        "rollout_batch one: R/R is invariant to rollout_batch (one vs all: 0 of")
    processed = cells["factor-sampling-processed-rr"]
    manifest = json.loads((root / processed["artifact_dir"] / "manifest.json").read_text())
    assert manifest["engine_settings"]["logprobs_mode"] == "processed_logprobs"
    assert processed["verdict"] == "valid" and processed["mismatch_count"] > 0
    assert words[("sampling", "processed")].endswith("the factor, not a kernel")


# -- probes (issue 21): the engines job writes them when the cell's env asks -------------------

ENGINES_RUN = pytest.mark.skipif(
    not (HAVE_VLLM and HAVE_MEGATRON and os.environ.get("RLK_ENGINES_MATRIX") == "1"),
    reason="starts a vLLM engine (a minute or more on 2 cores): needs vllm + megatron-core and "
    "RLK_ENGINES_MATRIX=1")
PROBE_AT = "0:0,0:2,1:1,2:3"


def _engines_probe_run(tmp: Path, checkpoint: Path, cases: dict[str, str],
                       extra: dict[str, str] | None = None) -> Path:
    import subprocess
    import sys

    art = tmp / "run"
    art.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RL_KERNEL", "RLK_REF"))}
    env.update({"RL_KERNEL_ARTIFACT_DIR": str(art), "RL_KERNEL_MODE": "audit",
                "RL_KERNEL_RUN_ID": "probe", "RL_KERNEL_PROBE": "1",
                "RL_KERNEL_PROBE_POSITIONS": PROBE_AT, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)})
    env.update({f"RL_KERNEL_{m.upper()}_CASE": c for m, c in cases.items()})
    env.update(extra or {})
    done = subprocess.run([sys.executable, "-m", "pytest_rlkernel_matrix.engines",
                           "--checkpoint", str(checkpoint)], env=env, capture_output=True,
                          text=True, timeout=1500)
    (tmp / "run.log").write_text(done.stdout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return art


@ENGINES_RUN
def test_engines_rr_probe_every_operator_bitwise_and_vocab_kl_zero(
        checkpoint: Path, tmp_path: Path) -> None:
    """R/R in real vLLM (decode-step taps) against Megatron-core's recompute: every operator
    of both layers bitwise at every probed token, vocabulary KL exactly 0, and the probed
    tokens' logprobs are the ones the run reported."""
    from pytest_rlkernel_matrix.judge.localise.probe import localise, read_probes

    art = _engines_probe_run(tmp_path, checkpoint, dict.fromkeys(MODULES, "R/R"))
    loc = localise(art / "probes", root=art)
    assert loc["status"] == "no_divergence" and loc["reasons"] == [], loc["reasons"]
    compared = [e for e in loc["operators"] if e["status"] == "compared"]
    assert len(compared) == len(loc["operators"]) == 1 + 2 * 13 + 2
    assert all(e["bitwise"] and e["max_abs"] == 0.0 for e in compared)
    v = loc["vocab"]
    assert v["tokens"] == 4 and v["kl_rollout_train_mean"] == v["kl_train_rollout_mean"] == 0.0
    assert v["top1_agreement"] == 1.0 and loc["first_divergent"] is None
    sides, _ = read_probes(art / "probes", art)
    for t in loc["tokens"]:
        assert t["probe_train_logprob"] == t["probe_rollout_logprob"]
        meta = sides["rollout"]["tokens"][(t["sample"], t["position"])]
        assert meta["rollout_logprob"] == t["probe_rollout_logprob"]  # the sampled token's
    assert sides["rollout"]["meta"]["engine"] == "vllm"
    assert sides["rollout"]["meta"]["tap"].startswith("decode step")
    assert sides["training"]["meta"]["engine"] == "megatron-core"
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["probe"]["enabled"] is True and manifest["probe"]["taps"]["rollout"]


@ENGINES_RUN
def test_engines_perturb_drill_names_exactly_that_operator_on_the_rollout(
        checkpoint: Path, tmp_path: Path) -> None:
    from pytest_rlkernel_matrix.judge.localise.probe import localise

    op = "model.layers.1.mlp.down_proj"
    art = _engines_probe_run(tmp_path, checkpoint, dict.fromkeys(MODULES, "R/R"),
                             {"RLK_REF_PERTURB": f"rollout:{op}"})
    loc = localise(art / "probes", root=art)
    first = loc["first_divergent"]
    assert loc["status"] == "localised", loc["reasons"]
    assert first["operator"] == op and first["sides"] == ["rollout"] and first["layer"] == 1
    names = [e["name"] for e in loc["operators"]]
    before = loc["operators"][:names.index(op)]
    assert before and all(e["status"] == "compared" and e["bitwise"] for e in before)
    assert loc["vocab"]["kl_rollout_train_mean"] > 0
    assert f"[rlk-engines][perturb] side=rollout module={op} factor=1+2^-7" in (
        tmp_path / "run.log").read_text()
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["probe"]["perturb"] == {"side": "rollout", "module_path": op,
                                            "factor": 1 + 2 ** -7}


@ENGINES_RUN
def test_engines_rlk_probe_localises_attention_pr_in_layer0_training(
        pytester: pytest.Pytester, tmp_path: Path) -> None:
    """`--rlk-probe` on the engines matrix: the drifting attention P/R cell gets a probe run
    whose localisation names layer 0's attention on the training side (Megatron P), not
    `incomparable`; the probe run is marked out of performance."""
    from pytest_rlkernel_matrix.engines.checkpoint import write_checkpoint

    write_checkpoint(REPO / "examples" / ".rlk-engines" / "tiny-qwen3")  # engines.toml's
    root = tmp_path / "root"
    result = pytester.runpytest_subprocess(
        f"--rlk-matrix={REPO / 'examples' / 'engines.toml'}", f"--rlk-matrix-root={root}",
        "-p", "no:cacheprovider", "--rlk-probe", "-k", "attention and P/R")
    out = result.stdout.str()
    assert result.ret == 0, out[-3000:]
    report = json.loads((root / "matrix-report.json").read_text())
    cell = next(c for c in report["cells"] if (c["module"], c["case"]) == ("attention", "P/R"))
    loc = cell["localisation"]
    assert cell["mismatch_count"] > 0 and loc["status"] == "localised", loc["reasons"]
    first = loc["first_divergent"]
    assert (first["layer"], first["module"], first["sides"]) == (0, "attention", ["training"])
    assert "training P" in first["label"]
    assert loc["operators"][0]["name"] == "model.embed_tokens" and loc["operators"][0]["bitwise"]
    assert f"attention P/R: first divergent {first['operator']} (training P)" in out
    run = json.loads((root / cell["artifact_dir"] / "probe" / "cell-run.json").read_text())
    assert run["probe"] is True and run["excluded_from_performance"] is True


def test_engines_operator_module_is_the_judges() -> None:
    from pytest_rlkernel_matrix.engines.probe import operator_module
    from pytest_rlkernel_matrix.judge.localise.probe import operator_module as judged
    from pytest_rlkernel_matrix.workload.evidence.probe import operator_names

    for op in [*operator_names(3), "log_softmax"]:
        assert operator_module(op) == judged(op), op
