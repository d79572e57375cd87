"""prefill-gate's own paged-attention kernel (Triton) and its torch specification."""
