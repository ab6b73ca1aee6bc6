"""Ray Serve LLM's own OpenAI app for one `LLMConfig`, as its documentation builds it: the
`rayllm` layer of the benchmark's breakdown (what Ray Serve LLM costs before our ingress).

    python -m cluster.bench.rayllm_app LLM_CONFIG_JSON PORT
"""

from __future__ import annotations

import json
import sys
import time


def main(llm_config_json: str, port: int) -> None:
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    from cluster.launcher import READY_MARKER

    # Logical CPUs are scheduling tokens: the engine replica and the ingress must both fit.
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = LLMConfig(**json.loads(llm_config_json))
    serve.run(build_openai_app({"llm_configs": [config]}), name="rayllm", route_prefix="/")
    print(f"{READY_MARKER}http://127.0.0.1:{port}/v1", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
