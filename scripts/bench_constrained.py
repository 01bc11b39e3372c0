"""What constrained decoding costs, and whether its outputs hold: the bundled SmolLM2-135M on the
default path (4-bit weights, bfloat16), in-process, side by side in one run.

1. Decode tok/s with a JSON schema against the same requests unconstrained, on 1 and on 8
   concurrent sessions. Both run to ``--tokens`` (the schema asks for a long array, so the grammar
   never completes first), greedy, from the same chat prompts; the repeats alternate the two.
2. Validity: ``--samples`` generations at temperature 1 under a JSON schema, under
   ``tool_choice: required`` and under a named function (the server's generic tool format, the
   bundled model's), each parsed and validated with ``jsonschema``: how many finished (``stop``)
   and how many of those validated.

    python scripts/bench_constrained.py [--tokens 96] [--repeats 3] [--samples 200] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import time

from muxworker.worker import passive_openmp

passive_openmp()  # as the worker process does, before torch loads libgomp

import jsonschema  # noqa: E402
import torch  # noqa: E402

from muxworker.client.serve.tools import GENERIC, Tool, ToolRequest  # noqa: E402
from muxworker.worker.build import load_engine  # noqa: E402
from muxworker.worker.engine.config import EngineConfig  # noqa: E402
from muxworker.worker.engine.sampling import SamplingParams  # noqa: E402

LONG = {  # never complete within the token budget: 40 items at least
    "type": "array",
    "minItems": 40,
    "items": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
        "tags": {"type": "array", "items": {"enum": ["friend", "work", "family"]}, "maxItems": 3},
    },
    "required": ["name", "age", "email", "tags"],
    "additionalProperties": False,
}


def _drain(engine) -> tuple[dict[int, str], dict[int, dict]]:
    texts: dict[int, str] = {}
    results: dict[int, dict] = {}
    while engine.has_work():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            if out.result is not None:
                results[out.request_id] = out.result
    return texts, results


def _chat(engine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return engine.tokenizer.encode(rendered, parse_special=True)


def decode_rate(engine, sessions: int, tokens: int, constraint: dict | None, rid0: int) -> float:
    """Aggregate decode tok/s of ``sessions`` requests of ``tokens`` tokens each (after the prefill)."""
    sids = [f"d{rid0}-{i}" for i in range(sessions)]
    prompts = [_chat(engine, f"List {40 + i} cities with their populations as JSON.") for i in range(sessions)]
    for sid in sids:
        engine.open_session(sid)
    for i, (sid, ids) in enumerate(zip(sids, prompts)):  # prefill outside the timing: one token each
        engine.submit(rid0 + i, sid, ids, SamplingParams(max_new_tokens=1, temperature=0, stop_token_ids=[]))
    _drain(engine)
    params = SamplingParams(max_new_tokens=tokens, temperature=0, stop_token_ids=[], constraint=constraint)
    t0 = time.perf_counter()
    for i, sid in enumerate(sids):
        engine.submit(rid0 + 100 + i, sid, prompts[i], params)  # reuses the prompt's rows: decode only
    _, results = _drain(engine)
    dt = time.perf_counter() - t0
    for sid in sids:
        engine.close_session(sid)
    made = sum(r["completion_tokens"] for r in results.values())
    assert all(r["finish_reason"] == "length" for r in results.values()), results
    return made / dt


WEATHER = Tool(
    "get_weather",
    "The current weather in a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
ADD = Tool(
    "add",
    "Add two integers",
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
)


def _schema_check(text: str) -> bool:
    jsonschema.validate(json.loads(text), PERSON)
    return True


def _calls_check(request: ToolRequest):
    def check(text: str) -> bool:
        parser = GENERIC.parser(request)
        parser.feed(text)
        _, calls = parser.finish()
        names = {t.name: t.parameters for t in request.callable}
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), names[call.name])
        return bool(calls)

    return check


def validity(
    engine, samples: int, max_tokens: int, prompt: list[int], constraint: dict, check
) -> tuple[int, int, float]:
    """(finished, valid, seconds) over ``samples`` generations at temperature 1, 8 at a time."""
    finished = valid = 0
    t0 = time.perf_counter()
    for start in range(0, samples, 8):
        batch = range(start, min(samples, start + 8))
        for k in batch:
            engine.open_session(f"v{k}")
            params = SamplingParams(max_new_tokens=max_tokens, temperature=1.0, seed=k, constraint=constraint)
            engine.submit(10_000 + k, f"v{k}", prompt, params)
        texts, results = _drain(engine)
        for k in batch:
            engine.close_session(f"v{k}")
            if results[10_000 + k]["finish_reason"] != "stop":
                continue
            finished += 1
            try:
                valid += check(texts[10_000 + k])
            except (ValueError, KeyError, jsonschema.ValidationError):
                pass
    return finished, valid, time.perf_counter() - t0


def _tool_prompt(engine, request: ToolRequest) -> list[int]:
    messages = GENERIC.messages([{"role": "user", "content": "What is the weather in Paris, and 2 plus 3?"}], request)
    rendered = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return engine.tokenizer.encode(rendered, parse_special=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=256, help="per validity sample")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = load_engine(
        None, EngineConfig(max_sessions=8, max_session_tokens=1024), device=args.device, dtype="bfloat16", progress=None
    )
    constraint = {"json_schema": LONG}
    rid = 1
    decode_rate(engine, 1, 8, constraint, rid)  # warm-up: the tokenizer's grammar tables, first steps
    rid += 1000
    print(f"decode tok/s, {args.tokens} tokens per request, greedy, best of {args.repeats} (alternating)")
    print("| sessions | free | JSON schema | ratio |")
    print("|---:|---:|---:|---:|")
    for sessions in (1, 8):
        free, guided = [], []
        for _ in range(args.repeats):
            free.append(decode_rate(engine, sessions, args.tokens, None, rid))
            guided.append(decode_rate(engine, sessions, args.tokens, constraint, rid + 500))
            rid += 1000
        print(f"| {sessions} | {max(free):.1f} | {max(guided):.1f} | {max(guided) / max(free):.2f} |")
    if args.samples:
        print(f"\nvalidity: {args.samples} generations each at temperature 1, at most {args.max_tokens} tokens")
        print("| constraint | finished (stop) | parse and validate | seconds |")
        print("|---|---:|---:|---:|")
        person = _chat(engine, "Invent a person and describe them as JSON with name, age, email and tags.")
        cases = [("json_schema (person)", person, {"json_schema": PERSON}, _schema_check)]
        for label, request in (
            ("tool_choice required", ToolRequest((WEATHER, ADD), "required", parallel=False)),
            ("tool_choice named (add)", ToolRequest((WEATHER, ADD), "function", "add")),
        ):
            cases.append((label, _tool_prompt(engine, request), GENERIC.constraint(request), _calls_check(request)))
        for label, prompt, constraint, check in cases:
            finished, valid, seconds = validity(engine, args.samples, args.max_tokens, prompt, constraint, check)
            print(f"| {label} | {finished} | {valid} | {seconds:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
