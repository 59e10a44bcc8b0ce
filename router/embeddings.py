"""The OpenAI /v1/embeddings response, as vLLM's server (`--runner pooling`) writes it (the request is
openai_protocol.parse_embedding_request's). A request's inputs run as one pooling request each
(GenerationInput.pooling_params), fanned out like a completion's batched prompts; the response lists their
embeddings in input order."""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.router.api_types import StreamChunk, Usage

def embedding_response(request_id: str, created: int, model: str, embeddings: Sequence[tuple[float, ...]],
                       num_prompt_tokens: int, encoding_format: str) -> dict:
    """vLLM's EmbeddingResponse: one `embedding` object per input, in input order, and the prompts' tokens."""
    data = [{"index": index, "object": "embedding", "embedding": encoded(vector, encoding_format)}
            for index, vector in enumerate(embeddings)]
    return {"id": f"embd-{request_id}", "object": "list", "created": created, "model": model, "data": data,
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}}


def encoded(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    """A vector as a response carries it (`encoding_format`: float or base64)."""
    if encoding_format == "float":
        return list(vector)
    # little-endian float32, what the OpenAI client's base64 decoding (numpy.frombuffer, float32) reads
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@dataclass(frozen=True)
class EmbeddingRenderer:
    """An embedding request's response from its inputs' final chunks (OpenAIServing's _Job renderer)."""

    request_id: str
    created: int
    model: str
    encoding_format: str

    def response(self, choices: Sequence[Sequence[StreamChunk]], usage: Usage) -> dict:
        """choices[i]: input i's chunks, the last carrying its embedding; usage: every input's prompt once."""
        return embedding_response(self.request_id, self.created, self.model,
                                  [chunks[-1].embedding for chunks in choices], usage.prompt_tokens,
                                  self.encoding_format)
