"""Codes shared by the one-sided kernels (``epcomm.kernels.shmem``) and the host (``epcomm.shmem``); importing
them needs no Triton."""

# Error record: int64[ERROR_WORDS] in device memory, written once by the first wait that times out:
# [code, rank, peer, slot, expected, seen, cmp, 0]
ERROR_WORDS = 8
ERR_NONE = 0
ERR_WAIT_TIMEOUT = 1  # wait(): a signal slot did not satisfy the comparison in time
ERR_BARRIER_TIMEOUT = 2  # barrier(): a peer did not arrive in time (peer = first missing rank)
ERR_READY_TIMEOUT = 3  # all-gather: a peer did not say it may be written to (previous result consumed)
ERR_DONE_TIMEOUT = 4  # a peer's data (all-gather shard, dispatch or combine rows) did not arrive in time
ERR_GATE_TIMEOUT = 5  # a gated dispatch: a chunk of its input rows (written by another stream) did not come in time
ERROR_NAMES = {ERR_WAIT_TIMEOUT: "wait timeout", ERR_BARRIER_TIMEOUT: "barrier timeout",
               ERR_READY_TIMEOUT: "all-gather ready timeout", ERR_DONE_TIMEOUT: "data arrival timeout",
               ERR_GATE_TIMEOUT: "input rows timeout"}

# Comparisons of wait (runtime values, so one compiled kernel serves all of them)
CMP_EQ, CMP_NE, CMP_GT, CMP_GE, CMP_LT, CMP_LE = range(6)
CMP_CODES = {"eq": CMP_EQ, "ne": CMP_NE, "gt": CMP_GT, "ge": CMP_GE, "lt": CMP_LT, "le": CMP_LE}
CMP_SYMBOLS = {"eq": "==", "ne": "!=", "gt": ">", "ge": ">=", "lt": "<", "le": "<="}
# Internal (not a user comparison): the flag is at or after ``value`` in wrap-around order, ``(v - value) >= 0`` as a
# signed difference of the flag's width. Epochs and epoch-tagged words compare this way, so that counters that wrap
# (the 32-bit epochs of tagged words after 2**31 calls, or 64-bit ones after 2**63) still compare correctly as long
# as the two values are less than half the range apart.
CMP_AFTER = 6

SIGNAL_SET = 0
SIGNAL_ADD = 1
SIGNAL_OPS = {"set": SIGNAL_SET, "add": SIGNAL_ADD}
