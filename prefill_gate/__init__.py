"""prefill-gate: keep vLLM's streams smooth while long prompts prefill.

One import namespace for the three parts, so that installing prefill-gate into vLLM's own
environment (or running Python in this repository) shadows no name there: a top-level
``kernels`` was Hugging Face's, which transformers imports, and ``proxy`` is anyone's.

    prefill_gate.proxy           the OpenAI-compatible proxy (the ``prefill-gate`` command)
    prefill_gate.engine_patches  the vLLM 0.26.0 plugin (``--scheduler-cls
                                 prefill_gate.engine_patches.pacing.PacedAsyncScheduler``)
    prefill_gate.kernels         the Triton paged-attention kernel
"""

__version__ = "0.1.0"
