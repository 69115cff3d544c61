"""``python -m pytest_rlkernel_matrix.engines``: one matrix cell on vLLM + Megatron-core."""

import sys

from .job import main

if __name__ == "__main__":
    sys.exit(main())
