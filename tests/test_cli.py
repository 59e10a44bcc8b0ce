"""The `splitserve` command line: generate streams text; bad input exits 2 with a clear message."""

from __future__ import annotations

import subprocess
import sys

from splitserve.deploy.cli import main as cli_main
from splitserve.engine import LLM, SamplingParams


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


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    assert cli_main(["generate", "--model", str(tmp_path), "x"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_console_script_is_installed():
    done = subprocess.run([sys.executable, "-m", "splitserve.deploy.cli", "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    assert "make-tiny-model" in done.stdout and "generate" in done.stdout
