"""What the reference workload's own R kernels are called, and the contract they declare.

They are this project's kernels, never RL-Kernel's: their backend ids live under a prefix of
their own (`rlk-ref.`), not `rlkernel.*` (records with RL-Kernel's ids are judged by RL-Kernel's
rules, on CUDA: no Triton), and every readback declares them in a runtime policy of its own
(`upstream.runtime_policy`; judge/upstream_rules.py), so they are judged by what they declare.
"""

R_BACKEND_PREFIX = "rlk-ref."
R_BACKEND_IDS = {
    "attention": "rlk-ref.attention.deterministic.v1",
    "ffn": "rlk-ref.ffn.qwen3.deterministic.v1",
    "logp": "rlk-ref.linear_logp.bitwise.v1",
    "comm": "rlk-ref.comm.allgather_fixed_order_sum.v1",
}
R_CONTRACT_VERSION = "rlk-ref.bitwise.v1"
