"""The `splitserve` command line: generate streams text; bad input exits 2, a failed gRPC call 1, clearly."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
from contextlib import closing

import pytest

from splitserve.deploy.cli import main as cli_main
from splitserve.deploy.client import LOCAL_SAMPLING_FIELDS, build_generate_request, sampling_to_proto
from splitserve.engine import LLM, InvalidRequestError, SamplingParams
from splitserve.proto.splitserve.v1 import generation_pb2


def test_generate_streams_the_engine_output(tiny_llama_dir, capsys):
    code = cli_main(["generate", "--model", str(tiny_llama_dir), "--max-tokens", "12", "--ignore-eos",
                     "the old mill"])
    captured = capsys.readouterr()
    expected = LLM(tiny_llama_dir).generate("the old mill", SamplingParams(temperature=0.0, max_tokens=12,
                                                                          ignore_eos=True))[0].text
    assert code == 0
    assert captured.out == expected + "\n"
    assert "[finish_reason=length]" in captured.err


def test_bad_sampling_flag_is_a_clear_error(tiny_llama_dir, capsys):
    assert cli_main(["generate", "--model", str(tiny_llama_dir), "--top-p", "0", "x"]) == 2
    assert "top_p: must be in (0, 1]" in capsys.readouterr().err


def test_generate_takes_gpu_memory_utilization_checked_and_without_effect_on_cpu(tiny_llama_dir, capsys):
    argv = ["generate", "--model", str(tiny_llama_dir), "--device", "cpu", "--max-tokens", "4", "--ignore-eos", "x"]
    assert cli_main(argv) == 0
    plain = capsys.readouterr().out
    assert cli_main([*argv, "--gpu-memory-utilization", "0.5"]) == 0
    assert capsys.readouterr().out == plain
    assert cli_main([*argv, "--gpu-memory-utilization", "1.5"]) == 2
    assert capsys.readouterr().err == "splitserve: error: gpu_memory_utilization must be in (0, 1], got 1.5\n"


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    assert cli_main(["generate", "--model", str(tmp_path), "x"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_console_script_is_installed():
    done = subprocess.run([sys.executable, "-m", "splitserve.deploy.cli", "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    assert "make-tiny-model" in done.stdout and "generate" in done.stdout


# ---- generate --target: the gRPC client (end-to-end runs against a server live with the server tests) ----
def _unused_port() -> int:
    with closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_target_is_a_clear_error(capsys):
    code = cli_main(["generate", "--target", f"127.0.0.1:{_unused_port()}", "--timeout", "5", "hello"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("splitserve: error: UNAVAILABLE: ") and "Traceback" not in err


def test_silent_target_hits_the_deadline(capsys):
    # A listening socket that never speaks HTTP/2: only the deadline ends the call.
    with closing(socket.socket()) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = cli_main(["generate", "--target", f"127.0.0.1:{port}", "--timeout", "0.5", "hello"])
    assert code == 1
    assert capsys.readouterr().err.startswith("splitserve: error: DEADLINE_EXCEEDED: ")


def test_target_validates_sampling_flags_before_connecting(capsys):
    assert cli_main(["generate", "--target", f"127.0.0.1:{_unused_port()}", "--top-p", "0", "x"]) == 2
    assert "top_p: must be in (0, 1]" in capsys.readouterr().err


def test_negative_seed_cannot_be_sent(capsys):
    assert cli_main(["generate", "--target", f"127.0.0.1:{_unused_port()}", "--seed", "-1", "x"]) == 2
    assert "seed: must be >= 0 to be sent to a server, got -1" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["localhost", "localhost:", ":50051", "host:port", "host:0", "host:70000"])
def test_malformed_target_is_a_usage_error(target, capsys):
    with pytest.raises(SystemExit) as raised:
        cli_main(["generate", "--target", target, "x"])
    assert raised.value.code == 2
    assert f"expected HOST:PORT, got {target!r}" in capsys.readouterr().err


def test_request_carries_the_prompt_non_default_fields_and_those_a_server_would_default():
    """Fields a server's --generation-config fills when unset are always sent, at their default
    values too (top_p 1.0 is the client's choice, not "unset"); other default fields are not."""
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=("\n",), seed=7)
    request = build_generate_request(text="héllo 🌍", params=params)
    assert request.WhichOneof("prompt") == "text" and request.text == "héllo 🌍".encode()
    assert [field.name for field, _ in request.sampling.ListFields()] == [
        "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
        "seed", "stop"]
    sampling = request.sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.repetition_penalty,
            sampling.frequency_penalty, sampling.presence_penalty, sampling.seed, list(sampling.stop)) == (
        0.0, -1, 1.0, 0.0, 1.0, 0.0, 0.0, 7, ["\n"])


def test_chat_and_token_id_requests():
    chat = build_generate_request(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False,
                                  request_id="r1", model="m")
    assert chat.WhichOneof("prompt") == "chat" and not chat.HasField("sampling")
    assert [(m.role, m.content) for m in chat.chat.messages] == [("user", "hi")]
    assert chat.chat.HasField("add_generation_prompt") and not chat.chat.add_generation_prompt
    assert (chat.request_id, chat.model) == ("r1", "m")
    ids = build_generate_request(token_ids=[5, 6, 7])
    assert ids.WhichOneof("prompt") == "token_ids" and list(ids.token_ids.ids) == [5, 6, 7]
    assert not ids.HasField("cache_salt") and not chat.HasField("cache_salt")
    assert build_generate_request(text="a", cache_salt="tenant-a").cache_salt == "tenant-a"
    with pytest.raises(ValueError, match="exactly one of text, token_ids or messages"):
        build_generate_request(text="a", token_ids=[1])


def test_generate_sends_its_cache_salt_priority_and_chat_flags():
    from splitserve.deploy.cli import _remote_request, build_parser

    args = build_parser().parse_args(["generate", "--target", "127.0.0.1:1", "--cache-salt", "tenant-a", "--chat",
                                      "--priority", "-2", "hi"])
    request = _remote_request(args)
    assert (request.cache_salt, request.priority, request.WhichOneof("prompt")) == ("tenant-a", -2, "chat")
    unsalted = _remote_request(build_parser().parse_args(["generate", "--target", "127.0.0.1:1", "hi"]))
    assert not unsalted.HasField("cache_salt") and (unsalted.text, unsalted.priority) == (b"hi", 0)


def test_wire_sampling_fields_match_the_engine_sampling_params():
    # sampling_to_proto copies fields by name and relies on equal defaults on both sides.
    assert [spec.name for spec in dataclasses.fields(SamplingParams) if spec.name not in LOCAL_SAMPLING_FIELDS] == [
        field.name for field in generation_pb2.SamplingParams.DESCRIPTOR.fields]


def test_n_above_one_is_refused_before_the_wire():
    with pytest.raises(InvalidRequestError) as error:
        sampling_to_proto(SamplingParams(n=2))
    assert error.value.field == "n" and "one sequence, got n=2" in str(error.value)


@pytest.mark.parametrize("params, field, message", [
    (SamplingParams(max_tokens=None), "max_tokens", "None (to the end of the context) is resolved by the offline LLM"),
    (SamplingParams(truncate_prompt_tokens=4), "truncate_prompt_tokens", "is the offline LLM's: set the "
                                                                          "GenerateRequest's truncate_prompt_tokens"),
    (SamplingParams(detokenize=False), "detokenize", "is the offline LLM's: a server always returns text"),
])
def test_what_only_the_offline_llm_resolves_is_refused_before_the_wire(params, field, message):
    with pytest.raises(InvalidRequestError) as error:
        sampling_to_proto(params)
    assert error.value.field == field and message in str(error.value)


def test_logit_controls_and_prompt_logprobs_reach_the_wire():
    params = SamplingParams(logit_bias={"7": 5.0, 3: -100.0}, allowed_token_ids=[3, 7], bad_words=["no"],
                            bad_words_token_ids=[[9, 10]], include_stop_str_in_output=True, prompt_logprobs=2)
    message = sampling_to_proto(params)
    assert dict(message.logit_bias) == {3: -100.0, 7: 5.0} and list(message.allowed_token_ids) == [3, 7]
    assert list(message.bad_words) == ["no"] and message.include_stop_str_in_output
    assert message.prompt_logprobs == 2


def test_simulate_writes_the_runs_it_prints(tmp_path, capsys):
    import json

    from splitserve.planner.sim.scenario import run_simulation

    args = ["simulate", "--trace", "poisson", "--devices", "4", "--duration", "60", "--policy", "planner",
            "--seed", "3", "--out", str(tmp_path)]
    assert cli_main(args) == 0
    [run] = json.loads((tmp_path / "poisson-4.json").read_text())["runs"]
    expected = run_simulation("poisson", 4, "planner", 3, 60.0)  # seeded: the same run again
    assert (run["policy"], run["trace"], run["requests"], run["good"]) == (
        "planner", "poisson", expected.requests, expected.good)
    assert (tmp_path / "poisson-4.png").stat().st_size > 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:2] == ["planner", f"{expected.attainment:.3f}"]


def test_simulate_refuses_a_cluster_of_one_device(tmp_path, capsys):
    assert cli_main(["simulate", "--devices", "1", "--out", str(tmp_path)]) == 2
    assert "need --devices >= 2 and --duration > 0, got 1 and 3600.0" in capsys.readouterr().err


def test_simulate_refuses_more_devices_than_it_can_simulate(tmp_path, capsys):
    """--devices 100000000 ran silently for hours (the trace's arrivals grow with the devices)."""
    assert cli_main(["simulate", "--devices", "100000001", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "splitserve: error: --devices must be at most 100,000, got 100,000,001\n"


def test_simulate_refuses_an_out_path_that_is_a_file_before_simulating(tmp_path, capsys):
    """It simulated every policy, then ended in a FileExistsError traceback."""
    taken = tmp_path / "results"
    taken.write_text("mine")
    assert cli_main(["simulate", "--devices", "4", "--duration", "60", "--out", str(taken)]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"splitserve: error: --out {str(taken)!r} exists and is not a folder\n")
    assert taken.read_text() == "mine"


def test_an_os_error_of_a_subcommand_is_one_line(tmp_path, capsys):
    """An OSError other than FileNotFoundError (here: a folder where a file is to be written) was a traceback."""
    (tmp_path / "bursty-4.json").mkdir()
    assert cli_main(["simulate", "--devices", "4", "--duration", "60", "--policy", "static",
                     "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve: error: [Errno 21] Is a directory: ") and err.count("\n") == 1


# ---- vLLM flags splitserve refuses, saying why --------------------------------------------------

@pytest.mark.parametrize(("flags", "reason"), [
    (["--long-prefill-token-threshold", "512"], "argument --long-prefill-token-threshold: not supported, got '512': "
                                                "the scheduler has no cap on a long prompt's chunk besides "
                                                "--max-num-batched-tokens"),
    (["--max-num-partial-prefills", "2"], "argument --max-num-partial-prefills: not supported, got '2': vLLM 0.32 "
                                          "dropped it with its V0 scheduler, and splitserve's scheduler has no limit "
                                          "on prompts prefilled in chunks at once besides --max-num-batched-tokens"),
])
def test_flags_that_cannot_be_honoured_are_refused_saying_why(flags, reason, capsys):
    from splitserve.deploy.cli import build_parser

    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["serve", "m", *flags])
    assert (caught.value.code, capsys.readouterr().err.splitlines()[-1]) == (
        2, f"splitserve serve: error: {reason} (see splitserve serve --help)")


def test_long_prefill_threshold_0_is_accepted(tmp_path):
    from splitserve.deploy.cli import build_parser, serve_config

    model = str(tmp_path)
    plain = serve_config(build_parser().parse_args(["serve", model]))
    assert serve_config(build_parser().parse_args(["serve", model, "--long-prefill-token-threshold", "0"])) == plain


def test_tokenizer_flag_sets_the_clusters_tokenizer_dir(tmp_path):
    from splitserve.deploy.cli import build_parser, serve_config

    model, tokenizer = str(tmp_path / "model"), str(tmp_path / "tok")
    assert (serve_config(build_parser().parse_args(["serve", model])).tokenizer,
            serve_config(build_parser().parse_args(["serve", model, "--tokenizer", tokenizer])).tokenizer) == (
        None, tokenizer)
