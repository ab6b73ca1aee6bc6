"""vLLM in-process, no HTTP: the `inprocess` baseline, the floor every server adds to.

    python -m cluster.bench.inprocess LLM_CONFIG_JSON RESULTS_JSONL

Starts vLLM's `AsyncLLM` with a pool's engine settings, prints the ready marker, then reads one
job per stdin line (`{"prompts": [...], "max_tokens": [...], "concurrency": c, "ignore_eos":
bool}`), replays it closed loop (chat template applied, greedy, streamed) and appends one JSON
line to RESULTS_JSONL with the per-request arrays `vllm.benchmarks.serve` returns (`ttfts`,
`latencies`, `output_lens`, `input_lens`, `errors`, `itls`, `duration`).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from typing import Any


async def _one(engine, tokenizer, prompt: str, max_tokens: int, ignore_eos: bool) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        output_kind=RequestOutputKind.DELTA,
    )
    started = time.perf_counter()
    first = last = None
    tokens, gaps, prompt_tokens = 0, [], 0
    async for output in engine.generate(text, params, request_id=uuid.uuid4().hex):
        new = len(output.outputs[0].token_ids)
        if not new:
            continue
        now = time.perf_counter()
        if first is None:
            first, prompt_tokens = now, len(output.prompt_token_ids or [])
        else:
            gaps.append(now - last)
        last, tokens = now, tokens + new
    end = time.perf_counter()
    return {
        "ttft": (first or end) - started,
        "latency": end - started,
        "output_len": tokens,
        "input_len": prompt_tokens,
        "itl": gaps,
    }


async def replay(engine, tokenizer, job: dict[str, Any]) -> dict[str, Any]:
    """Closed loop: `concurrency` requests in flight until every prompt is answered."""
    gate = asyncio.Semaphore(job["concurrency"])

    async def bounded(prompt: str, max_tokens: int) -> dict:
        async with gate:
            try:
                return await _one(engine, tokenizer, prompt, max_tokens, job["ignore_eos"])
            except Exception as error:  # recorded like the HTTP client records a failure
                return {"error": repr(error)}

    started = time.perf_counter()
    results = await asyncio.gather(
        *(bounded(p, n) for p, n in zip(job["prompts"], job["max_tokens"], strict=True))
    )
    return {
        "duration": time.perf_counter() - started,
        "ttfts": [r.get("ttft", 0.0) for r in results],
        "latencies": [r.get("latency", 0.0) for r in results],
        "output_lens": [r.get("output_len", 0) for r in results],
        "input_lens": [r.get("input_len", 0) for r in results],
        "itls": [r.get("itl", []) for r in results],
        "errors": [r.get("error", "") for r in results],
    }


async def main(llm_config: dict[str, Any], results_path: str) -> None:
    from transformers import AutoTokenizer
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from cluster.launcher import READY_MARKER

    source = llm_config["model_loading_config"]["model_source"]
    kwargs = {k: v for k, v in llm_config["engine_kwargs"].items() if k != "disable_log_stats"}
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=source, **kwargs))
    tokenizer = AutoTokenizer.from_pretrained(kwargs.get("tokenizer") or source)
    print(f"{READY_MARKER}in-process engine", flush=True)
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            result = await replay(engine, tokenizer, json.loads(line))
            with open(results_path, "a") as out:
                out.write(json.dumps(result) + "\n")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    try:
        asyncio.run(main(json.loads(sys.argv[1]), sys.argv[2]))
    except KeyboardInterrupt:
        pass
