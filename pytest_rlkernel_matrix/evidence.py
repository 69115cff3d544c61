"""Deprecated: moved to `pytest_rlkernel_matrix.judge.evidence`.

This path keeps working for one release, with a `DeprecationWarning`.
"""

import warnings

from pytest_rlkernel_matrix.judge.evidence import *  # noqa: F403

warnings.warn("pytest_rlkernel_matrix.evidence moved to pytest_rlkernel_matrix.judge.evidence; "
              "the old path goes away in the next release", DeprecationWarning, stacklevel=2)
