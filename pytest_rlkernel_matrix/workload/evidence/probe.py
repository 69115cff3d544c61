"""Per-operator probes and the perturbation drill of the reference workload.

A ``Tap`` sits on one side's kernels (``SideKernels.tap``); every kernel hands each named
operator output to it (``tap.out(name, tensor)``) in forward order, named by the Hugging Face
Qwen3 module paths (``model.layers.0.self_attn.q_proj``...). With no probe and no drill asked
for, the tap is ``None`` and the kernels pay one attribute test per operator.

Probing (``RL_KERNEL_PROBE=1``): the caller says which rows of the current forward are which
``(sample, logit position)`` (``tap.rows``); the tap copies the probed rows of every operator
output to the CPU in their own dtype, gathers tensor-parallel shards (column-parallel outputs
concatenated in rank order, row-parallel partial sums summed in rank order in fp32), and at the
end writes ``<probe dir>/<side>.rank{r:05d}.pt`` (``docs/artifact-format.md``, "Probes").

The drill (``RLK_REF_PERTURB=<side>:<module path>``) multiplies that one operator's output on
that side by ``1 + 2**-7`` (exact in bf16 and fp32: a deterministic relative perturbation).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from pytest_rlkernel_matrix.workload.env import SIDES, UsageError
from pytest_rlkernel_matrix.workload.parallel import Group, fixed_order_sum

PROBE_SCHEMA = "rlk.operator_probe.v1"
PERTURB_FACTOR = 1.0 + 2.0 ** -7
LAYER_OPS = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.q_norm", "self_attn.k_norm", "self_attn.attn", "self_attn.o_proj",
             "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.act_fn",
             "mlp.down_proj")
DEFAULT_BUDGET = 8


def operator_names(num_layers: int) -> list[str]:
    """Every probed operator in forward order."""
    names = ["model.embed_tokens"]
    for i in range(num_layers):
        names += [f"model.layers.{i}.{op}" for op in LAYER_OPS]
    return [*names, "model.norm", "lm_head"]


def parse_positions(raw: str) -> list[tuple[int, int]]:
    """``RL_KERNEL_PROBE_POSITIONS``: ``sample:token`` pairs (token = index in the response)."""
    out: list[tuple[int, int]] = []
    for part in filter(None, (p.strip() for p in raw.split(","))):
        a, sep, b = part.partition(":")
        if not sep or not a.isdigit() or not b.isdigit():
            raise UsageError(f"RL_KERNEL_PROBE_POSITIONS: {part!r} is not <sample>:<token>")
        out.append((int(a), int(b)))
    return out


@dataclass(frozen=True)
class ProbeRequest:
    """What the environment asks for: probe dir, token budget, tokens; and the drill."""

    enabled: bool = False
    directory: Path | None = None
    budget: int = DEFAULT_BUDGET
    positions: tuple[tuple[int, int], ...] = ()
    perturb: tuple[str, str] | None = None  # (side, module path)

    @classmethod
    def from_env(cls, artifact_dir: Path, num_layers: int) -> ProbeRequest:
        e = os.environ
        enabled = e.get("RL_KERNEL_PROBE", "").strip() == "1"
        raw_budget = e.get("RL_KERNEL_PROBE_TOKENS", "").strip() or str(DEFAULT_BUDGET)
        if not raw_budget.isdigit() or not 1 <= int(raw_budget) <= 4096:
            raise UsageError(f"RL_KERNEL_PROBE_TOKENS={raw_budget!r}: expected 1..4096")
        positions = parse_positions(e.get("RL_KERNEL_PROBE_POSITIONS", ""))
        perturb = None
        raw = e.get("RLK_REF_PERTURB", "").strip()
        if raw:
            side, sep, path = raw.partition(":")
            if not sep or side not in SIDES or path not in operator_names(num_layers):
                raise UsageError(f"RLK_REF_PERTURB={raw!r}: expected <training|rollout>:<module "
                                 f"path>, e.g. rollout:model.layers.0.mlp.down_proj")
            perturb = (side, path)
        directory = Path(e.get("RL_KERNEL_PROBE_DIR", "").strip() or artifact_dir / "probes")
        return cls(enabled, directory, int(raw_budget), tuple(positions[:int(raw_budget)]),
                   perturb)

    def tap(self, side: str, tp: Group) -> Tap | None:
        drill = self.perturb[1] if self.perturb and self.perturb[0] == side else None
        if not self.enabled and drill is None:
            return None
        return Tap(side, self.enabled, drill, tp)


@dataclass
class Tap:
    """One side's operator tap (see the module docstring)."""

    side: str
    recording: bool
    perturb: str | None
    tp: Group
    keys: list[tuple[int, int] | None] = field(default_factory=list)  # rows of this forward
    wanted: set[tuple[int, int]] = field(default_factory=set)  # (sample, logit position)
    records: dict[tuple[int, int], dict[str, Tensor]] = field(default_factory=dict)
    _tiles: dict[str, list[Tensor]] | None = None
    _tile_rows: int = 0

    def rows(self, keys: list[tuple[int, int] | None]) -> None:
        """Name the rows of the next forward (flattened ``[B * T]``): ``(sample, pos)`` or None."""
        self.keys = keys

    def out(self, name: str, t: Tensor, shard: str | None = None,
            at: int | None = None) -> Tensor:
        """Operator ``name`` produced ``t`` (rows first); returns it, perturbed if drilled.

        ``shard``: ``"col"`` (this TP rank's slice of the last dim) or ``"row"`` (a partial sum
        of a row-parallel output) when tensor parallelism splits it; None: replicated.
        ``at``: ``t`` holds the forward's rows ``at, at + 1, ...`` only (a chunk of rows)."""
        if self.perturb == name:
            t = t * PERTURB_FACTOR
        if self.recording:
            if self._tiles is not None:
                self._tiles.setdefault(name, []).append((t, shard))  # type: ignore[arg-type]
            else:
                self._keep(name, t, shard, at)
        return t

    def perturbs(self, name: str) -> float:
        """The drill's factor for operator ``name`` (1.0: not drilled), for fused kernels that
        apply it themselves and hand ``out`` the unperturbed output to record."""
        return PERTURB_FACTOR if self.perturb == name else 1.0

    @contextmanager
    def tiled(self, rows: int) -> Iterator[None]:
        """Outputs inside fixed-shape row tiles: joined (padding cut) when the tiles are done."""
        if not self.recording:
            yield
            return
        outer, self._tiles = self._tiles, {}
        try:
            yield
            pieces = self._tiles
        finally:
            self._tiles = outer
        for name, parts in pieces.items():  # already perturbed: recorded as they went on
            self._keep(name, torch.cat([p for p, _ in parts])[:rows], parts[0][1])

    def _keep(self, name: str, t: Tensor, shard: str | None, at: int | None = None) -> None:
        keys = self.keys if at is None else self.keys[at:at + t.shape[0]]
        if not keys or t.numel() % len(keys):
            raise RuntimeError(f"probe: {name} of shape {tuple(t.shape)} does not split into "
                               f"the forward's {len(keys)} rows")
        flat = t.reshape(len(keys), -1)
        idx = [i for i, k in enumerate(keys) if k is not None and k in self.wanted]
        sel = flat[idx].detach()
        if self.tp.size > 1 and shard is not None:  # every TP rank taps the same rows
            parts = self.tp.gather(sel.float() if shard == "row" else sel)
            sel = fixed_order_sum(parts) if shard == "row" else torch.cat(parts, dim=-1)
        sel = sel.cpu().clone()
        for r, i in enumerate(idx):
            key = keys[i]
            assert key is not None
            self.records.setdefault(key, {})[name] = sel[r]

    def write(self, path: Path, meta: dict, tokens: list[dict], ops: list[str]) -> None:
        """``torch.save`` of the probe dict (atomic); ``tokens`` rows order the tensors."""
        mine = [t for t in tokens if (t["sample"], t["position"]) in self.records]
        outputs: dict[str, Tensor] = {}
        for op in [*ops, "log_softmax"]:
            rows = [self.records[(t["sample"], t["position"])].get(op) for t in mine]
            if rows and all(r is not None for r in rows):
                outputs[op] = torch.stack(rows)  # type: ignore[arg-type]
        data = {**meta, "schema_version": PROBE_SCHEMA, "side": self.side, "operators": ops,
                "tokens": mine, "outputs": outputs,
                "log_softmax": outputs.pop("log_softmax", torch.empty(0))}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save(data, tmp)
        os.replace(tmp, path)


def write_index(directory: Path, meta: dict, tokens: list[dict], ops: list[str],
                world: int) -> None:
    """``index.json``: the files every rank writes, the tokens and the operators (rank 0)."""
    index = {"schema_version": PROBE_SCHEMA, **meta, "operators": ops, "tokens": tokens,
             "files": [f"{s}.rank{r:05d}.pt" for s in SIDES for r in range(world)]}
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".index.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(index, indent=2, sort_keys=True))
    os.replace(tmp, directory / "index.json")
