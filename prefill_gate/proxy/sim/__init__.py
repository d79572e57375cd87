"""The engine simulator: a vLLM-like OpenAI server whose step time follows a cost model."""

from __future__ import annotations

import dataclasses

from .engine import CostModel, Engine, EngineConfig
from .presets import DEFAULT_PRESET, PRESETS, Preset, get_preset

__all__ = ["CostModel", "Engine", "EngineConfig", "Preset", "PRESETS", "build_engine", "get_preset"]


def build_engine(preset: str | None = None, *, engine: dict | None = None, cost: dict | None = None,
                 time_scale: float = 1.0, seed: int = 0) -> tuple[Engine, Preset]:
    """An engine from a preset, with single fields overridden; raises ValueError on bad input."""
    p = get_preset(preset or DEFAULT_PRESET)
    if time_scale <= 0:
        raise ValueError("time_scale must be positive")
    try:
        config = dataclasses.replace(p.engine, **(engine or {}))
        model = dataclasses.replace(p.cost, **(cost or {})).scaled(time_scale)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1 or config.block_size < 1:
        raise ValueError("max_num_batched_tokens, max_num_seqs and block_size must be positive")
    return Engine(config, model, seed=seed), p
