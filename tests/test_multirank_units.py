"""Units of the multi-rank pieces: device sets per xdist worker, topology checks, comm as a
module, CP slice merging, TP sharding and the zigzag split."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_rlkernel_matrix.run.devices import (
    auto_workers,
    device_env,
    devices_for_worker,
    mark_overlaps,
    visible_devices,
)
from pytest_rlkernel_matrix.spec.cells import expand
from pytest_rlkernel_matrix.spec.matrix import (
    MatrixFile,
    MatrixFileError,
    MatrixSection,
    load_matrix,
)

RUNNER = '[runner]\ncommand = "true"\n'


def _load(tmp_path: Path, text: str) -> MatrixFile:
    path = tmp_path / "m.toml"
    path.write_text(text)
    return load_matrix(path)


@pytest.mark.parametrize(("visible", "per_cell", "workers"),
                         [(2, 1, 2), (2, 2, 1), (8, 4, 2), (8, 3, 2), (4, 2, 2), (1, 2, 1)])
def test_auto_workers_is_floor_of_visible_over_per_cell(visible: int, per_cell: int,
                                                        workers: int) -> None:
    assert auto_workers(visible, per_cell) == workers


@pytest.mark.parametrize(("count", "per_cell"), [(8, 1), (8, 2), (8, 4), (6, 3), (7, 2)])
def test_workers_never_share_a_device(count: int, per_cell: int) -> None:
    devices = visible_devices("cuda", {}, count)
    sets = [devices_for_worker(devices, per_cell, i) for i in range(auto_workers(count, per_cell))]
    flat = [d for s in sets for d in s]
    assert all(len(s) == per_cell for s in sets)
    assert len(flat) == len(set(flat))


def test_visibility_variable_is_respected_and_too_few_devices_is_an_error() -> None:
    devices = visible_devices("cuda", {"CUDA_VISIBLE_DEVICES": "4,5,6"}, 8)
    assert devices == ["4", "5", "6"]
    assert devices_for_worker(devices, 2, 0) == ["4", "5"]
    with pytest.raises(pytest.UsageError, match="gw1 needs 2 GPU"):
        devices_for_worker(devices, 2, 1)
    assert device_env("cuda", ["1"]) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert device_env("rocm", ["2", "3"]) == {"HIP_VISIBLE_DEVICES": "2,3"}
    assert visible_devices("rocm", {"ROCR_VISIBLE_DEVICES": "0,1"}, 4) == ["0", "1"]
    assert device_env("cpu", ["0"]) == {}


def test_overlap_on_a_shared_device_contaminates_performance() -> None:
    def rec(key: str, devices: list[str], start: float, end: float) -> dict:
        return {"run_key": key, "devices": devices, "window": [start, end],
                "performance_usable": True, "validity": {"performance": {"valid": True,
                                                                         "reasons": []}}}

    records = {"a": rec("a", ["0"], 0, 10), "b": rec("b", ["0"], 5, 15),
               "c": rec("c", ["1"], 0, 10), "d": rec("d", ["0"], 20, 30)}
    mark_overlaps(records)
    assert not records["a"]["performance_usable"] and not records["b"]["performance_usable"]
    assert "overlapped cell b on device(s) ['0']" in records["a"]["validity"]["performance"][
        "reasons"][0]
    assert records["c"]["performance_usable"] and records["d"]["performance_usable"]


def test_comm_module_expands_and_needs_tp(tmp_path: Path) -> None:
    section = MatrixSection(modules=("attention", "ffn", "logp", "comm"))
    cells = expand(section, ["cpu"])
    assert len(cells) == 16
    assert {c.run_key for c in cells if c.case == "R/R"} == {"cpu/A-RR_F-RR_L-RR_C-RR"}
    comm_pr = next(c for c in cells if c.module == "comm" and c.case == "P/R")
    assert comm_pr.cases.env()["RL_KERNEL_COMM_CASE"] == "P/R"
    plain = expand(MatrixSection(), ["cpu"])
    assert "RL_KERNEL_COMM_CASE" not in plain[0].cases.env()
    with pytest.raises(MatrixFileError, match=r"hardware\.cpu\.topology\.tp = 1"):
        _load(tmp_path, '[matrix]\nmodules = ["attention", "comm"]\n' + RUNNER
              + '[hardware.cpu]\nbackend = "cpu"\n')


def test_gpus_per_cell_below_world_size_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(MatrixFileError, match=r"hardware\.h\.topology.*gpus_per_cell=1"):
        _load(tmp_path, RUNNER + '[hardware.h]\nbackend = "cuda"\n'
              'topology = { tp = 2, gpus_per_cell = 1 }\n')
    m = _load(tmp_path, RUNNER + '[hardware.h]\nbackend = "cuda"\ntopology = { tp = 2, cp = 2 }\n')
    assert m.hardware["h"].topology.devices_per_cell == 4


def test_topology_needing_more_gpus_than_seen_is_a_usage_error(tmp_path: Path) -> None:
    from pytest_rlkernel_matrix.hardware import check_topology

    m = _load(tmp_path, RUNNER + '[hardware.h]\nbackend = "cuda"\ntopology = { tp = 2 }\n'
              '[hardware.cpu]\nbackend = "cpu"\ntopology = { tp = 2 }\n')
    with pytest.raises(pytest.UsageError, match=r"2 GPU.*sees 1"):
        check_topology(tmp_path / "m.toml", m, ["h"], {"gpu": {"count": 1}})
    check_topology(tmp_path / "m.toml", m, ["h"], {"gpu": {"count": 2}})
    check_topology(tmp_path / "m.toml", m, ["cpu"], {"gpu": {"count": 0}})  # CPU ranks


def test_missing_collective_backend_blocks_a_multi_rank_cell(tmp_path: Path) -> None:
    from pytest_rlkernel_matrix.session import MatrixSession

    m = _load(tmp_path, RUNNER + '[hardware.h]\nbackend = "cuda"\ntopology = { tp = 2 }\n'
              '[hardware.cpu]\nbackend = "cpu"\ntopology = { tp = 2 }\n')
    pre = {"capabilities": {"capabilities": {"collectives": {
        "status": "unavailable", "name": "NCCL", "reason": "torch is built without NCCL"}}},
           "probe": {"capabilities_raw": {"nccl": {"gloo_available": False}}}}
    ms = MatrixSession(matrix=m, matrix_path=tmp_path / "m.toml", root=tmp_path / "r",
                       hardware=["h"], mode="strict", layout="pairwise", preflight=pre)
    cells = expand(m.matrix, ["h", "cpu"])
    gpu_cell = next(c for c in cells if c.hardware == "h")
    cpu_cell = next(c for c in cells if c.hardware == "cpu")
    (blocker,) = ms.collective_blockers(gpu_cell)
    assert blocker[0] == "communication_path_unsupported" and "NCCL" in blocker[1]
    assert ms.collective_blockers(cpu_cell)[0][0] == "communication_path_unsupported"
    assert ["communication_path_unsupported", blocker[1]] in ms.blockers(gpu_cell, "off")


def test_cp_slices_merge_to_one_sample_and_a_missing_slice_is_a_problem() -> None:
    import torch

    from pytest_rlkernel_matrix.judge.read.sidecars import SIDECAR_SCHEMA, merge, read_sidecar
    from pytest_rlkernel_matrix.workload.parallel import zigzag_response_offsets

    total, response = 11, 7
    full = torch.arange(response, dtype=torch.float32)
    shards = []
    for rank in (0, 1):
        held = zigzag_response_offsets(total, response, 2, rank)
        data = {"schema_version": SIDECAR_SCHEMA, "rank": rank, "call_index": 0,
                "tensor_parallel_size": 1, "context_parallel_size": 2,
                "train_log_probs": [full[held]], "rollout_log_probs": [full[held]],
                "loss_masks": [torch.ones(response)], "total_lengths": [total],
                "response_lengths": [response]}
        shards += read_sidecar(data, f"r{rank}")[1]
    merged = merge(shards)
    (sample,) = merged.samples
    assert sample.train.tolist() == full.tolist() and sample.mask.sum() == response
    assert not merged.problems
    half = merge(shards[:1])
    assert int(half.samples[0].mask.sum()) == shards[0].train.size  # present shard counts
    assert half.problems == ["call 0, sample 0 (DP rank 0): missing CP shard(s) from cp "
                             "rank(s) [1] (got [0] of 0..1)"]


def test_tp_shards_and_zigzag_split() -> None:
    import torch

    from pytest_rlkernel_matrix.workload.model import PRESETS, init_weights, shard_weights
    from pytest_rlkernel_matrix.workload.parallel import zigzag_index

    cfg = PRESETS["tiny"]
    w = init_weights(cfg, 0, torch.float32, torch.device("cpu"))
    a, b = (shard_weights(cfg, w, 2, r) for r in (0, 1))
    q = "model.layers.0.self_attn.q_proj.weight"
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([a[q], b[q]]), w[q])
    assert torch.equal(torch.cat([a[o], b[o]], dim=1), w[o])
    assert a["lm_head.weight"].shape[0] == cfg.vocab_size // 2
    assert a["model.embed_tokens.weight"] is w["model.embed_tokens.weight"]
    assert zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="tp=3 does not divide"):
        shard_weights(cfg, w, 3, 0)


def test_merge_places_cp_spans_as_fancy_indexing_places_the_writers_offsets() -> None:
    """`read_sidecar` holds each CP rank's values as runs of consecutive offsets
    (`response_spans`), and `merge` copies each run as one slice: for every total and response
    length up to 13 and cp 1 to 4, the spans are the writer's zigzag offsets
    (`workload.parallel.zigzag_response_offsets`), and the merged sample is
    `out[offsets] = values` over the CP ranks; a missing rank leaves its positions inactive."""
    import numpy as np

    from pytest_rlkernel_matrix.judge.read.sidecars import (
        SIDECAR_SCHEMA,
        merge,
        read_sidecar,
        response_offsets,
    )
    from pytest_rlkernel_matrix.workload.parallel import zigzag_response_offsets

    rng = np.random.default_rng(11)
    for cp in (1, 2, 3, 4):
        for total in range(1, 14):
            for response in range(1, total + 1):
                train = rng.standard_normal(response).astype(np.float32)
                roll = train * 2
                full = (rng.random(response) < 0.8).astype(np.float32)
                want_t, want_r = np.zeros(response, np.float32), np.zeros(response, np.float32)
                want_m = np.zeros(response, bool)
                shards = []
                for rank in range(cp):
                    off = zigzag_response_offsets(total, response, cp, rank).numpy()
                    assert response_offsets(total, response, cp, rank).tolist() == off.tolist()
                    data = {"schema_version": SIDECAR_SCHEMA, "rank": rank, "call_index": 0,
                            "tensor_parallel_size": 1, "context_parallel_size": cp,
                            "train_log_probs": [train[off]], "rollout_log_probs": [roll[off]],
                            "loss_masks": [full], "total_lengths": [total],
                            "response_lengths": [response]}
                    (shard,) = read_sidecar(data, f"r{rank}")[1]
                    assert shard.mask.tolist() == (full[off] != 0).tolist()
                    if rank == 1:  # a lost shard: its positions stay zero and inactive
                        continue
                    shards.append(shard)
                    want_t[off], want_r[off], want_m[off] = train[off], roll[off], full[off] != 0
                merged = merge(shards)
                (sample,) = merged.samples
                assert sample.train.tobytes() == want_t.tobytes(), (cp, total, response)
                assert sample.rollout.tobytes() == want_r.tobytes()
                assert sample.mask.tolist() == want_m.tolist()
                assert bool(merged.problems) == (cp > 1), merged.problems
