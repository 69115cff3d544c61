"""Shared helpers for the project's own tests."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch  # noqa: F401

# pytester's in-process runs restore sys.modules afterwards; numpy and torch cannot be imported
# twice in one process, so load the plugin's lazily imported modules once, here, up front.
import pytest_rlkernel_matrix.session  # noqa: F401

pytest_plugins = ["pytester"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (long multi-rank matrices)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: pass --run-slow to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)

FAKE = Path(__file__).with_name("fake_framework.py")


def matrix_toml(
    *, mode: str = "audit", layout: str = "pairwise", env: dict[str, str] | None = None,
    timeout: float = 60, extra: str = "", modules: str = '["attention", "ffn", "logp"]',
    hardware: str = '[hardware.cpu]\nbackend = "cpu"\n', r_provider: str = "external",
) -> str:
    env_line = ", ".join(f'{k} = "{v}"' for k, v in (env or {}).items())
    return (
        f'[matrix]\nname = "test"\nmodules = {modules}\nmode = "{mode}"\nlayout = "{layout}"\n'
        f"{extra}\n"
        f'[runner]\ncommand = ["{sys.executable}", "{FAKE}"]\ntimeout = {timeout}\n'
        f'r_provider = "{r_provider}"\n'
        f"env = {{ {env_line} }}\n\n{hardware}"
    )


@pytest.fixture
def make_matrix(pytester: pytest.Pytester) -> Callable[..., Path]:
    """Write `matrix.toml` for the fake framework into the pytester directory."""

    def make(**kwargs: object) -> Path:
        return pytester.makefile(".toml", matrix=matrix_toml(**kwargs))  # type: ignore[arg-type]

    return make
