"""One vLLM engine of the end-to-end test, run as its own process (vLLM keeps process-wide state):
``baseline`` (no connector), ``prefill`` (kv_producer) or ``decode`` (kv_consumer), the tiny random
Llama on CPU, kvxfer's connector over NIXL on 127.0.0.1. Prompts and steps come as JSON lines on
stdin, results go out as JSON lines on stdout (a line starting with ``{``).

    python vllm_engine.py ROLE MODEL_DIR PORT [MODE]

MODE: ``pull`` (default), ``push``, or ``layerwise`` (push, written layer by layer during the prefill's
forward pass: the decode's request comes first).

Between steps the prefill keeps its engine stepping, as ``vllm serve`` does while finished requests
hold blocks: that hands the holds to the connector's workers, serves pushes and frees blocks.
"""

from __future__ import annotations

import json
import os
import select
import sys
from typing import Any

MAX_TOKENS = 8
#: Tokens per block of each engine: the decode's blocks are twice the prefill's (kvxfer pairs them).
BLOCK_SIZE = {"baseline": 32, "prefill": 32, "decode": 64}


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    role, model, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else "pull"
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = {}
    if role != "baseline":
        kw["kv_transfer_config"] = {
            "kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.integrations.vllm.connector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"backend": "nixl", "host": "127.0.0.1", "port": port, "timeout": 10.0,
                                          "mode": "push" if mode == "layerwise" else mode,
                                          "layerwise": mode == "layerwise", "secret": os.environ["KVXFER_SECRET"]}}
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
              enforce_eager=True, seed=0, block_size=BLOCK_SIZE[role], enable_prefix_caching=True, **kw)

    def connector() -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        return get_kv_transfer_group()

    def lines() -> Any:
        while True:
            if role == "prefill" and not select.select([sys.stdin], [], [], 0.02)[0]:
                llm.llm_engine.step()   # idle: let the held requests' steps run
                continue
            line = sys.stdin.readline()
            if not line:
                return
            yield line

    emit({"ready": True})
    for line in lines():
        step = json.loads(line)
        if step.get("exit"):
            break
        prompts = step["prompts"]
        params = step.get("params") or [None] * len(prompts)
        sps = []
        for p in params:
            extra = {"kv_transfer_params": p} if p is not None else None
            max_tokens = 1 if role == "prefill" else MAX_TOKENS
            sps.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, extra_args=extra))
        if role == "prefill":   # the step's params add to the prefill's own (layer-wise: the transfer ids)
            sps = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                  extra_args={"kv_transfer_params": {**(p or {}), "do_remote_decode": True}})
                   for p in params]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        result: dict[str, Any] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                  "params": [o.kv_transfer_params for o in outs]}
        if role != "baseline":
            eng = connector().engine
            result["stats"] = {"bytes_read": eng.stats.bytes_read, "requests_read": eng.stats.requests_read,
                               "tokens_skipped": eng.stats.tokens_skipped, "failures": eng.stats.failures,
                               "bytes_written": eng.stats.bytes_written,
                               "bytes_written_layerwise": eng.stats.bytes_written_layerwise}
        emit(result)


if __name__ == "__main__":
    main()
