"""The prefix cache through a real worker process (--prefix_cache_entries)."""

from __future__ import annotations

import pytest
import trio

from muxworker.client import GenerationParams, InvalidArgument, default_worker_command, spawn_multiplexed_worker

# Real worker processes: the smoke tests of the feature (the prefix cache in-process: tests/worker/engine).
pytestmark = pytest.mark.slow


async def test_second_session_prefills_only_its_own_part(tiny_llama_dir):
    system = list(range(5, 305))  # a 300-token shared "system prompt"
    cmd = default_worker_command(tiny_llama_dir, max_session_tokens=1024, prefix_cache_entries=2)
    results = {}
    with trio.fail_after(120):  # hang guard
        async with spawn_multiplexed_worker(cmd) as client:
            assert client.info.limits["prefix_cache_entries"] == 2
            # The start-up line reports the preallocated KV memory, prefix-cache slots included.
            while not any("prefix-cache entries" in line for line in client.stderr_tail):
                await trio.sleep(0.05)
            line = next(line for line in client.stderr_tail if "KV cache" in line)
            assert "8 sessions + 2 prefix-cache entries x 1024 tokens" in line
            for i, sid in enumerate(("a", "b")):
                await client.open_session(sid)
                params = GenerationParams(session_id=sid, max_new_tokens=6, stop_token_ids=[])
                results[sid] = await client.generate(system + [320 + i, 330 + i], params).wait()
        async with spawn_multiplexed_worker(default_worker_command(tiny_llama_dir, max_session_tokens=1024)) as client:
            await client.open_session("b")
            params = GenerationParams(session_id="b", max_new_tokens=6, stop_token_ids=[])
            cold = await client.generate(system + [321, 331], params).wait()
    assert (results["a"].reused_prompt_tokens, results["a"].prefilled_prompt_tokens) == (0, 302)
    assert (results["b"].reused_prompt_tokens, results["b"].prefilled_prompt_tokens) == (300, 2)
    assert results["b"].generated_token_ids == cold.generated_token_ids


async def test_cache_salt_scopes_reuse_to_its_own_tenant(tiny_llama_dir):
    system = list(range(5, 205))
    cmd = default_worker_command(tiny_llama_dir, max_session_tokens=512, prefix_cache_entries=4)
    reused = {}
    with trio.fail_after(120):  # hang guard
        async with spawn_multiplexed_worker(cmd) as client:
            for i, (sid, salt) in enumerate((("a", "tenant-a"), ("b", "tenant-b"), ("c", None), ("d", "tenant-a"))):
                await client.open_session(sid)
                params = GenerationParams(session_id=sid, max_new_tokens=2, stop_token_ids=[], cache_salt=salt)
                reused[sid] = (await client.generate(system + [300 + i], params).wait()).reused_prompt_tokens
            with pytest.raises(InvalidArgument, match="cache_salt must be a str"):
                client.generate(system, GenerationParams(session_id="a", cache_salt=b"tenant-a"))  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument, match="field cache_salt must be non-empty str of at most 256"):
                await client.generate(system, GenerationParams(session_id="a", cache_salt="x" * 257)).wait()
    assert reused == {"a": 0, "b": 0, "c": 0, "d": 200}  # only tenant-a's second session reuses
