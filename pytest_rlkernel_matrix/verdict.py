"""Deprecated: moved to `pytest_rlkernel_matrix.judge.verdict`.

This path keeps working for one release, with a `DeprecationWarning`.
"""

import warnings

from pytest_rlkernel_matrix.judge.verdict import *  # noqa: F403

warnings.warn("pytest_rlkernel_matrix.verdict moved to pytest_rlkernel_matrix.judge.verdict; "
              "the old path goes away in the next release", DeprecationWarning, stacklevel=2)
