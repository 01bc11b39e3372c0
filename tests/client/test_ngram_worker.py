"""--speculative ngram through a real worker process and the trio client: results report drafted
and accepted tokens, sessions save through the file channel into a store declared for a plain
worker, and resume exactly in a plain worker (n-gram drafting holds no state of its own)."""

from __future__ import annotations

import pytest
import trio
from helpers.params import greedy

from muxworker.client import SessionStore, default_worker_command, spawn_multiplexed_worker
from muxworker.transport.messages import ModelInfo, WorkerInfo

HANG_GUARD_S = 120.0


@pytest.mark.slow  # a real worker process (n-gram drafting in-process: tests/worker/engine)
async def test_an_ngram_worker_reports_its_drafts_and_its_sessions_resume_in_a_plain_worker(tiny_llama_dir, tmp_path):
    flags = dict(dtype="float32", max_sessions=2, max_session_tokens=512)
    ngram = default_worker_command(tiny_llama_dir, speculative="ngram", n_draft=4, **flags)
    plain = default_worker_command(tiny_llama_dir, **flags)
    config = {"backend": "torch", "dtype": "float32", "max_session_tokens": 512, "draft": None, "n_draft": 0}
    files = [tiny_llama_dir / "model.safetensors", tiny_llama_dir / "tokenizer.json"]
    store = await SessionStore.create(tmp_path / "store", model_files=files, configuration=config)
    prompt = [5 + (i * 7) % 90 for i in range(30)]
    with trio.fail_after(HANG_GUARD_S):
        async with spawn_multiplexed_worker(ngram, session_store=store) as client:
            assert client.info.limits["speculative"] == "ngram"
            await client.open_session("s")
            first = await client.generate(prompt, greedy("s", 100)).wait()
            assert first.draft_proposed_tokens > 0 and 0 < first.draft_accepted_tokens <= first.draft_proposed_tokens
            saved = await client.save_session("s")  # the file channel: the store accepted the worker
            history = prompt + first.generated_token_ids
            live = await client.generate(history + [9], greedy("s", 20)).wait()
        async with spawn_multiplexed_worker(plain, session_store=store) as client:
            await client.resume_session("s")
            resumed = await client.generate(history + [9], greedy("s", 20)).wait()
    assert resumed.reused_prompt_tokens == saved.position
    assert resumed.generated_token_ids == live.generated_token_ids


def test_a_draft_model_is_told_from_ngram_drafting_by_the_hello(tmp_path):
    """A store declaring no draft takes an n-gram worker (no state of its own) but not a draft model."""
    from muxworker.client import ConfigurationMismatch
    from muxworker.transport.checkpoint import IdentityInputs

    def info(limits):
        model = ModelInfo(name="m", architecture="llama", vocab_size=300, context_length=2048, has_chat_template=False)
        return WorkerInfo(protocol=(1, 0), model=model, backend="torch", device="cpu", dtype="float32", limits=limits)

    store = SessionStore(tmp_path, identity="f" * 64, inputs=IdentityInputs((), {"draft": None, "n_draft": 0}))
    store.check_worker(info({"n_draft": 4, "speculative": "ngram"}))
    store.check_worker(info({"n_draft": 0}))
    with pytest.raises(ConfigurationMismatch, match="draft: store"):
        store.check_worker(info({"n_draft": 4}))
