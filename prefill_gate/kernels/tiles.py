"""The kernel's tile shapes and routing limits: constants only (no torch, no Triton), so that
code deciding where rows go (prefill_gate.engine_patches.routing, loaded with the plugin in every vLLM
process) can read them without loading the kernel."""

ROWS = 32  # query-tile rows: BLOCK_Q positions x GROUP_PAD heads
MERGE_ROWS = 4  # rows the fused merge combines at a time
SPLIT_MAX_QUERY = 8  # rows with query length <= this take the split-KV path
HEAD_DIMS = (64, 80, 96, 128, 256)
