"""``python -m pytest_rlkernel_matrix.workload``: run one matrix cell of the reference job."""

import sys

from pytest_rlkernel_matrix.workload.job import main

sys.exit(main())
