"""SessionRuntime(evict_idle_to_store=True): idle sessions are saved to the store and closed when the
worker's slots run out, and resumed on their next use.

The policy's rules run over the in-process fake worker (tests/helpers/fake_worker.py: two slots,
the engine's history and refusal rules); the tests marked ``worker`` also run on a real worker
subprocess on a tiny random model (slow). The end-to-end check runs the bundled SmolLM2 with float
weights in float32 and greedy decoding, where a resumed session must continue exactly like one
that never left its slot. trio.fail_after is a hang guard.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio
from helpers.fake_worker import FakeStore, fake_worker_client
from helpers.params import greedy
from helpers.runtime import BOTH, CONFIG, HANG_GUARD_S, PROMPT

from muxworker.client import (
    CapacityExhausted,
    CheckpointTooLarge,
    InvalidArgument,
    SessionExists,
    SessionRuntime,
    SessionStore,
    Unsaveable,
    default_worker_command,
    spawn_multiplexed_worker,
)
from muxworker.client.runtime import EvictionFailed, RuntimeGenerationResult

LONG = 4000  # runs until cancelled
LIMITS = dict(max_sessions=2, max_session_tokens=4096, max_inflight_requests=8)  # two slots: eviction


@pytest.fixture(scope="module")
def worker_command(tiny_llama_dir):
    return default_worker_command(tiny_llama_dir, dtype="float32", **LIMITS)


@pytest.fixture
async def store(backend, tmp_path, request):
    if backend == "fake":
        return FakeStore()
    model_dir = request.getfixturevalue("tiny_llama_dir")
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file())
    return await SessionStore.create(tmp_path / "s", model_files=files, configuration=CONFIG)


@pytest.fixture
async def client(backend, store, request):
    if backend == "fake":
        async with fake_worker_client(session_store=store, **LIMITS) as c:
            yield c
    else:
        async with spawn_multiplexed_worker(request.getfixturevalue("worker_command"), session_store=store) as c:
            yield c


@pytest.fixture
def runtime(client):
    return SessionRuntime(client, evict_idle_to_store=True)


async def saved(store) -> list[str]:
    return await trio.to_thread.run_sync(store.list)


async def turn(runtime, sid: str, prompt: list[int], n: int = 4) -> tuple[list[int], RuntimeGenerationResult]:
    """One generation; returns the session's history after it (prompt plus generated) and the result."""
    result = await runtime.generate(sid, prompt, greedy(n=n)).wait()
    return prompt + result.generated_token_ids, result


# ----------------------------------------------------------------------------------------------
# the policy


@BOTH
async def test_the_least_recently_used_idle_session_is_evicted_and_resumed_on_demand(runtime, store):
    with trio.fail_after(HANG_GUARD_S):
        await runtime.open_session("a")
        history_a, first = await turn(runtime, "a", PROMPT)
        assert first.resumed_from_store is False
        await runtime.open_session("b")
        history_b, _ = await turn(runtime, "b", PROMPT[:12])
        assert runtime.session_stats == {
            "live": 2,
            "evicted": 0,
            "evictions": 0,
            "resumes_from_store": 0,
            "eviction_failures": 0,
        }

        # Both slots are taken: opening c evicts a, used least recently, to the store.
        await runtime.open_session("c")
        assert runtime.session_state("a") == "evicted" and runtime.session_state("b") == "live"
        assert await saved(store) == ["a"]
        assert runtime.session_stats["live"] == 2 and runtime.session_stats["evicted"] == 1
        history_c, _ = await turn(runtime, "c", PROMPT[:8])

        # A generation on a resumes it transparently (evicting b), reusing every committed token:
        # its history but the last generated one, which has no KV yet.
        committed = len(history_a) - 1
        history_a, resumed = await turn(runtime, "a", history_a + [40, 41])
        assert resumed.resumed_from_store is True and resumed.finish_reason == "length"
        assert resumed.reused_prompt_tokens == committed
        assert runtime.session_state("b") == "evicted" and runtime.session_state("a") == "live"
        assert runtime.session_stats["evictions"] == 2 and runtime.session_stats["resumes_from_store"] == 1
        # Live again: the next turn is an ordinary one.
        committed = len(history_a) - 1
        history_a, again = await turn(runtime, "a", history_a)
        assert again.resumed_from_store is False and again.reused_prompt_tokens == committed

        # An evicted session is open as far as callers can tell; its save is already done.
        with pytest.raises(SessionExists, match="evicted"):
            await runtime.open_session("b")
        with pytest.raises(SessionExists, match="evicted"):
            await runtime.resume_session("b")
        await runtime.save_session("b")
        assert runtime.session_state("b") == "evicted"

        # Exporting an evicted session resumes it first (evicting c, now the least recently used).
        checkpoint = await runtime.export_checkpoint_to_cpu("b")
        assert checkpoint.token_ids.tolist() == history_b[:-1]
        assert runtime.session_state("b") == "live" and runtime.session_state("c") == "evicted"

        # Reset of an evicted session does not load it: its next use starts empty.
        await runtime.reset_session("c")
        assert runtime.session_state("c") == "evicted"
        with pytest.raises(Unsaveable, match="empty"):
            await runtime.save_session("c")
        _, cold = await turn(runtime, "c", history_c)
        assert cold.resumed_from_store is False and cold.reused_prompt_tokens == 0

        # Closing an evicted session forgets it; its file stays in the store, as after a save.
        assert runtime.session_state("a") == "evicted"
        await runtime.close_session("a")
        assert runtime.session_state("a") is None and "a" in await saved(store)
        await runtime.open_session("a")  # a new, empty session of that id
        _, fresh = await turn(runtime, "a", history_a)
        assert fresh.resumed_from_store is False and fresh.reused_prompt_tokens == 0
        stats = runtime.session_stats
        assert stats["live"] + stats["evicted"] == 3 and stats["live"] == 2 and stats["eviction_failures"] == 0
        assert runtime.admitted == 0 and runtime.leased_sessions == 0


async def test_an_empty_session_is_evicted_without_a_file_and_reopens_empty(runtime, store):
    with trio.fail_after(HANG_GUARD_S):
        for sid in ("a", "b", "c"):
            await runtime.open_session(sid)  # c evicts a, which holds nothing to save
        assert runtime.session_state("a") == "evicted" and await saved(store) == []
        _, result = await turn(runtime, "a", PROMPT)
        assert result.resumed_from_store is False and result.reused_prompt_tokens == 0
        assert runtime.session_stats["resumes_from_store"] == 0


async def test_with_no_idle_session_an_open_fails_at_once(runtime, store):
    with trio.fail_after(HANG_GUARD_S):
        await runtime.open_session("a")
        history_a, _ = await turn(runtime, "a", PROMPT)
        await runtime.open_session("b")
        await runtime.open_session("c")  # evicts a
        gb = runtime.generate("b", PROMPT, greedy(n=LONG))
        gc = runtime.generate("c", PROMPT, greedy(n=LONG))
        await gb.__anext__()
        await gc.__anext__()

        # Every live session is busy: nothing to evict, so CapacityExhausted, as without eviction.
        with pytest.raises(CapacityExhausted, match="no idle session") as refused:
            await runtime.open_session("d")
        assert not isinstance(refused.value, EvictionFailed)
        # The same for a generation that needs a's slot back; a stays evicted, nothing is lost.
        with pytest.raises(CapacityExhausted, match="no idle session"):
            await runtime.generate("a", history_a, greedy(n=2)).wait()
        assert runtime.session_state("a") == "evicted" and runtime.session_state("d") is None
        assert not gb.finished and not gc.finished

        gb.cancel()
        gc.cancel()
        assert (await gb.wait()).finish_reason == "cancelled"
        assert (await gc.wait()).finish_reason == "cancelled"
        _, resumed = await turn(runtime, "a", history_a, 2)
        assert resumed.resumed_from_store is True and resumed.reused_prompt_tokens == len(history_a) - 1
        assert runtime.admitted == 0 and runtime.leased_sessions == 0


async def test_a_session_opened_not_evictable_is_never_evicted(runtime, store):
    # A server's one-request sessions: they must never leave a file behind.
    with trio.fail_after(HANG_GUARD_S):
        await runtime.open_session("pinned", evictable=False)
        await turn(runtime, "pinned", PROMPT)
        await runtime.open_session("a")
        await turn(runtime, "a", PROMPT)
        assert runtime.live_sessions() == ["pinned", "a"]
        await runtime.open_session("b")  # evicts "a", the only evictable idle one
        assert runtime.session_state("pinned") == "live" and runtime.session_state("a") == "evicted"
        assert await saved(store) == ["a"]
        stream = runtime.generate("b", PROMPT, greedy(n=LONG))
        with pytest.raises(CapacityExhausted):
            await runtime.open_session("c")  # "b" is busy and "pinned" may not go
        await stream.aclose()  # now idle: "b" goes for "c", never "pinned"
        await runtime.open_session("c")
        assert runtime.live_sessions() == ["pinned", "c"]
        assert runtime.session_state("b") == "evicted" and "pinned" not in await saved(store)


@BOTH
async def test_a_failed_save_during_eviction_keeps_the_session_live(runtime, store):
    with trio.fail_after(HANG_GUARD_S):
        await runtime.open_session("a")
        history_a, _ = await turn(runtime, "a", PROMPT)
        await runtime.open_session("b")
        history_b, _ = await turn(runtime, "b", PROMPT[:12])

        limit = store.max_bytes
        store.max_bytes = 1  # every save now fails (the store's own limit), as a full disk would
        with pytest.raises(EvictionFailed, match="'a'") as failed:
            await runtime.open_session("c")
        assert isinstance(failed.value, CapacityExhausted)
        assert failed.value.session_id == "a" and isinstance(failed.value.cause, CheckpointTooLarge)
        assert isinstance(failed.value.__cause__, CheckpointTooLarge)
        assert "stays live" in str(failed.value)
        # a was neither closed nor marked evicted: its next turn reuses its cache in the worker.
        assert runtime.session_state("a") == "live" and runtime.session_state("c") is None
        assert runtime.session_stats["eviction_failures"] == 1 and runtime.session_stats["evictions"] == 0
        assert await saved(store) == []
        _, kept = await turn(runtime, "a", history_a)
        assert kept.resumed_from_store is False and kept.reused_prompt_tokens == len(history_a) - 1

        store.max_bytes = limit
        await runtime.open_session("c")  # evicts b, now the least recently used
        assert runtime.session_state("b") == "evicted" and await saved(store) == ["b"]
        _, resumed = await turn(runtime, "b", history_b)
        assert resumed.resumed_from_store is True and resumed.reused_prompt_tokens == len(history_b) - 1


@BOTH
async def test_concurrent_sessions_three_times_the_slots_lose_no_history(client, store):
    """Six sessions on two slots, all chatting at once: a turn that finds no idle session to evict
    is refused (and retried); every turn reuses its session's whole committed history, resumed from
    the store or not."""
    runtime = SessionRuntime(client, evict_idle_to_store=True)
    refusals = 0
    resumed_turns = 0

    async def chat(i: int) -> None:
        nonlocal refusals, resumed_turns
        sid = f"s{i}"
        while True:
            try:
                await runtime.open_session(sid)
                break
            except CapacityExhausted:
                refusals += 1
                await trio.sleep(0.01)
        history = PROMPT[: 5 + i]
        for k in range(4):
            while True:
                try:
                    result = await runtime.generate(sid, history, greedy(n=3)).wait()
                    break
                except CapacityExhausted:
                    refusals += 1
                    await trio.sleep(0.01)
            # The previous turn's prompt and generated tokens but the last (no KV yet) and [50 + k].
            expected_reuse = 0 if k == 0 else len(history) - 2
            assert result.reused_prompt_tokens == expected_reuse, (sid, k, result)
            resumed_turns += result.resumed_from_store
            history = history + result.generated_token_ids + [50 + k]
            assert runtime.session_stats["live"] <= 2
            await trio.sleep(0.02)  # the user thinks: the session is idle, so it may be evicted

    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(chat, i)
    stats = runtime.session_stats
    assert stats["live"] == 2 and stats["evicted"] == 4 and stats["eviction_failures"] == 0
    assert stats["resumes_from_store"] == resumed_turns > 0
    assert runtime.admitted == 0 and runtime.leased_sessions == 0


# ----------------------------------------------------------------------------------------------
# the bundled SmolLM2: 3x more sessions than slots, continuations exact


SESSIONS = 6
TURNS = 4
NEW_TOKENS = 4
TOPICS = ["the sea", "a red kite", "bread", "the moon", "old maps", "rain on glass"]
SMOL_HANG_GUARD_S = 600.0  # about 20 s on 2 idle cores; a loaded host can take several times that


@pytest.mark.slow
async def test_smollm2_six_sessions_on_two_slots_continue_like_a_run_that_never_evicts(tmp_path):
    from muxworker.worker.models.loader import bundled_gguf_path

    flags = dict(dtype="float32", weights="float", max_session_tokens=512)
    configuration = {"backend": "torch", "dtype": "float32", "weights": "float", "max_session_tokens": 512}
    store = await SessionStore.create(
        tmp_path / "store", model_files=[bundled_gguf_path()], configuration=configuration
    )
    sids = [f"chat{i}" for i in range(SESSIONS)]
    order = [i for i in range(SESSIONS) for _ in range(TURNS)]
    random.Random(16).shuffle(order)

    clients = {}
    async with trio.open_nursery() as nursery:

        async def start(name: str, command: list[str], session_store) -> None:
            clients[name] = await spawn_multiplexed_worker(
                command, session_store=session_store, nursery=nursery, startup_timeout=600
            )

        async with trio.open_nursery() as starting:  # both start at once
            starting.start_soon(start, "reference", default_worker_command(max_sessions=SESSIONS, **flags), None)
            starting.start_soon(start, "evicting", default_worker_command(max_sessions=2, **flags), store)
        try:
            with pytest.raises(InvalidArgument, match="session_store"):
                SessionRuntime(clients["reference"], evict_idle_to_store=True)
            reference = SessionRuntime(clients["reference"])
            evicting = SessionRuntime(clients["evicting"], evict_idle_to_store=True)
            assert clients["evicting"].info.limits["max_sessions"] == 2
            with trio.fail_after(SMOL_HANG_GUARD_S):
                for sid in sids:  # opening the third and later ones evicts the (empty) first ones
                    await reference.open_session(sid)
                    await evicting.open_session(sid)
                # The context of each session in each run: text segments and generated token ids.
                contexts = {run: {sid: [] for sid in sids} for run in ("reference", "evicting")}
                done = dict.fromkeys(sids, 0)
                resumed_turns = 0
                for step, i in enumerate(order):
                    sid = sids[i]
                    text = (
                        f"Turn {done[sid]} of a note about {TOPICS[i]}:" if done[sid] else f"A note about {TOPICS[i]}:"
                    )
                    was_evicted = evicting.session_state(sid) == "evicted"
                    results = {}
                    for run, runtime in (("reference", reference), ("evicting", evicting)):
                        prompt = contexts[run][sid] + [text]
                        results[run] = result = await runtime.generate(sid, prompt, greedy(n=NEW_TOKENS)).wait()
                        contexts[run][sid] = prompt + [result.generated_token_ids]
                    ref, got = results["reference"], results["evicting"]
                    where = f"step {step}, {sid} turn {done[sid]}"
                    assert got.generated_token_ids == ref.generated_token_ids, where
                    assert (got.prompt_tokens, got.reused_prompt_tokens, got.prefilled_prompt_tokens) == (
                        ref.prompt_tokens,
                        ref.reused_prompt_tokens,
                        ref.prefilled_prompt_tokens,
                    ), where
                    assert got.resumed_from_store == (was_evicted and done[sid] > 0), where
                    assert ref.resumed_from_store is False
                    assert evicting.session_stats["live"] <= 2
                    resumed_turns += got.resumed_from_store
                    done[sid] += 1
                stats = evicting.session_stats
                assert stats["live"] == 2 and stats["evicted"] == SESSIONS - 2
                assert stats["resumes_from_store"] == resumed_turns >= SESSIONS
                assert reference.session_stats["evicted"] == 0 and reference.session_stats["evictions"] == 0
                for sid in sids:
                    await evicting.close_session(sid)
                assert evicting.session_stats["live"] == evicting.session_stats["evicted"] == 0
                await evicting.open_session("after")  # every slot is free again: no eviction
                assert evicting.session_stats["evictions"] == stats["evictions"]
        finally:
            for client in clients.values():
                await client.close()
