"""Model quality measured through the engine: held-out perplexity, and agreement with a reference."""

from splitserve.eval.quality import EngineVariant, QualityResult, evaluate, heldout_windows, random_twin

__all__ = ["EngineVariant", "QualityResult", "evaluate", "heldout_windows", "random_twin"]
