"""store/atomic.py: `dumps_indented` writes the text `json.dumps(..., indent=...)` writes."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from pytest_rlkernel_matrix.store.atomic import dumps_indented, json_safe, write_json_atomic

REPO = Path(__file__).resolve().parents[1]


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(10 if depth < 5 else 6)
    if kind == 0:
        return rng.choice(["", "a", "zürich ✓", "\x00\n\"\\", "\ud83d", "x" * 300])
    if kind == 1:
        return rng.choice([0, -1, 2**70, -(2**63), True, False, None])
    if kind in (2, 3):
        return rng.choice([0.0, -0.0, 1e-300, 1.5, -2.5e300, 1 / 3, 5e-324, 1e16])
    if kind in (4, 5):
        return rng.randrange(-1000, 1000)
    if kind in (6, 7):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["a", "b", "é", "", "k" * 5, str(i)]): _value(rng, depth + 1)
            for i in range(rng.randrange(4))}


def test_the_same_text_as_json_dumps_with_an_indent() -> None:
    rng = random.Random(2)
    values = [_value(rng) for _ in range(3000)]
    values += [[], {}, [[]], {"a": {}}, "s", 1, 1.5, None, True]
    for report in (REPO / "docs" / "examples").rglob("matrix-report.json"):
        values.append(json.loads(report.read_text()))
    for indent in (2, 1, 4):
        for v in values:
            assert dumps_indented(v, indent) == json.dumps(v, indent=indent, allow_nan=False)


def test_other_types_and_non_finite_floats_are_json_s_own_outcome(tmp_path: Path) -> None:
    class Number(int):
        pass

    for v in ({"t": (1, 2)}, [Number(3)], {1: "int key"}, {"x": {2.5: 1}}):
        assert dumps_indented(v) == json.dumps(v, indent=2, allow_nan=False)
    for v in ([math.nan], {"a": math.inf}):
        with pytest.raises(ValueError, match="Out of range float"):
            dumps_indented(v)
    write_json_atomic(tmp_path / "r.json", {"a": [math.nan, (1, 2)], 3: {"b": -math.inf}})
    assert (tmp_path / "r.json").read_text() == json.dumps(
        json_safe({"a": [None, [1, 2]], "3": {"b": None}}), indent=2) + "\n"
