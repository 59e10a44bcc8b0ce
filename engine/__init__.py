"""One-device inference engine: `from splitserve.engine import LLM, SamplingParams`."""

from splitserve.common.beam_search import BeamSearchParams
from splitserve.common.config import EngineConfig
from splitserve.common.errors import InvalidRequestError, UnsupportedModelError
from splitserve.common.lora import LoRARequest
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.stats import EngineStats
from splitserve.common.structured_output import GuidedDecodingParams, StructuredOutputsParams
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.llm import LLM, TextPrompt, TokensPrompt
from splitserve.engine.outputs import (BeamSearchOutput, BeamSearchSequence, CompletionDelta, CompletionOutput,
                                       RequestOutput)
from splitserve.common.token_logprobs import Logprob, TokenLogprobs

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionDelta",
           "CompletionOutput", "EngineConfig", "EngineCore", "EngineStats", "GuidedDecodingParams",
           "InvalidRequestError", "Logprob", "LoRARequest", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "TextPrompt", "TokenLogprobs", "TokensPrompt", "UnsupportedModelError"]
