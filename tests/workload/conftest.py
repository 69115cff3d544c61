"""Workload test configuration: the ``gpu`` marker and a CUDA skip helper."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA/ROCm device; skipped without one")
