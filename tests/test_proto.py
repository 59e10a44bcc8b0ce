"""Generated protobuf/gRPC code: checked in, current, and importable from the installed package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pool

from splitserve.proto.inference import grpc_service_pb2, grpc_service_pb2_grpc
from splitserve.proto.splitserve.v1 import generation_pb2, generation_pb2_grpc

PROTO_ROOT = Path(__file__).resolve().parents[1] / "proto"
REGENERATE = PROTO_ROOT / "regenerate.py"
GENERATED_GLOBS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")
SOURCE_DIRS = ("splitserve", "inference")


def _generated(root: Path) -> dict[str, bytes]:
    """Generated files under root's source folders by path relative to root."""
    paths = (path for folder in SOURCE_DIRS for pattern in GENERATED_GLOBS for path in (root / folder).rglob(pattern))
    return {str(path.relative_to(root)): path.read_bytes() for path in paths}


def test_checked_in_generated_code_is_current(tmp_path):
    done = subprocess.run([sys.executable, str(REGENERATE), "--out", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    fresh, checked_in = _generated(tmp_path), _generated(PROTO_ROOT)
    stale = sorted(name for name in fresh.keys() | checked_in.keys() if fresh.get(name) != checked_in.get(name))
    assert not stale, f"generated code is stale ({', '.join(stale)}): run `.venv/bin/python proto/regenerate.py`"
    assert sorted(fresh) == ["inference/grpc_service_pb2.py", "inference/grpc_service_pb2.pyi",
                             "inference/grpc_service_pb2_grpc.py", "splitserve/v1/generation_pb2.py",
                             "splitserve/v1/generation_pb2.pyi", "splitserve/v1/generation_pb2_grpc.py"]


def test_generated_grpc_code_imports_the_installed_package():
    source = (PROTO_ROOT / "splitserve/v1/generation_pb2_grpc.py").read_text()
    assert "from splitserve.proto.splitserve.v1 import generation_pb2 as" in source
    assert "from splitserve.v1 import" not in source
    assert generation_pb2_grpc.splitserve_dot_v1_dot_generation__pb2 is generation_pb2
    triton_source = (PROTO_ROOT / "inference/grpc_service_pb2_grpc.py").read_text()
    assert "from splitserve.proto.inference import grpc_service_pb2 as" in triton_source
    assert grpc_service_pb2_grpc.inference_dot_grpc__service__pb2 is grpc_service_pb2


def test_the_triton_protocol_lives_in_a_private_descriptor_pool():
    # tritonclient registers the full `inference` package in the default pool; ours must not collide.
    assert grpc_service_pb2.DESCRIPTOR.pool is not descriptor_pool.Default()
    assert generation_pb2.DESCRIPTOR.pool is descriptor_pool.Default()
    service = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert (grpc_service_pb2.DESCRIPTOR.name, service.full_name) == ("inference/grpc_service.proto",
                                                                     "inference.GRPCInferenceService")


def test_descriptor_names_match_the_proto_package():
    # Reflection and clients in other languages see these names.
    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert generation_pb2.DESCRIPTOR.name == "splitserve/v1/generation.proto"
    assert service.full_name == "splitserve.v1.Generation"
    assert service.methods_by_name["Generate"].output_type.full_name == "splitserve.v1.GenerateResponse"


def test_generate_request_round_trips():
    request = generation_pb2.GenerateRequest(
        request_id="r-1",
        chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="héllo 🌍")],
                                         add_generation_prompt=False),
        sampling=generation_pb2.SamplingParams(temperature=0.0, max_tokens=7, stop=["\n\n"], stop_token_ids=[2],
                                               seed=2**64 - 1),
        cache_salt="user-a")
    parsed = generation_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert parsed == request
    assert parsed.WhichOneof("prompt") == "chat"
    assert parsed.chat.messages[0].content == "héllo 🌍"
    assert parsed.chat.HasField("add_generation_prompt") and parsed.chat.add_generation_prompt is False
    # Explicit presence: a zero temperature is set (greedy), an absent top_p is not.
    assert parsed.sampling.HasField("temperature") and parsed.sampling.temperature == 0.0
    assert not parsed.sampling.HasField("top_p")
    assert parsed.HasField("cache_salt") and parsed.cache_salt == "user-a"
    assert not generation_pb2.GenerateRequest.FromString(b"").HasField("cache_salt")  # unset: unsalted
    assert (parsed.sampling.max_tokens, list(parsed.sampling.stop), list(parsed.sampling.stop_token_ids),
            parsed.sampling.seed) == (7, ["\n\n"], [2], 2**64 - 1)


def test_text_prompt_is_carried_as_bytes():
    text = "naïve ☕".encode()
    parsed = generation_pb2.GenerateRequest.FromString(generation_pb2.GenerateRequest(text=text).SerializeToString())
    assert parsed.WhichOneof("prompt") == "text"
    assert parsed.text == text
