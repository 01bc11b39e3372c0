"""Session checkpoints through the client and a real worker: save, restart, resume; the advanced API;
the checkpoint queue. Greedy float32 on a tiny random model, so continuations must match exactly.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading

import pytest
import trio

from muxworker.client import (
    CheckpointIncompatible,
    CheckpointNotFound,
    CheckpointRejected,
    ConfigurationMismatch,
    CPUCheckpoint,
    GenerationParams,
    SessionExists,
    SessionStore,
    Unsaveable,
    WorkerDiedError,
    default_worker_command,
    spawn_multiplexed_worker,
)

pytestmark = pytest.mark.slow  # real worker processes: the end-to-end tier (make test)

HANG_GUARD_S = 60.0


def greedy(session_id: str, n: int = 12) -> GenerationParams:
    return GenerationParams(session_id=session_id, max_new_tokens=n, temperature=0.0, stop_token_ids=[])


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def worker_command(model_dir):
    return default_worker_command(model_dir, dtype="float32", max_sessions=8, max_session_tokens=512)


def _configuration(**extra) -> dict:
    return {"backend": "torch", "dtype": "float32", "max_session_tokens": 512, **extra}


async def _store(path, model_dir, **extra) -> SessionStore:
    return await SessionStore.create(
        path,
        model_files=[model_dir / "model.safetensors", model_dir / "tokenizer.json"],
        configuration=_configuration(**extra),
    )


def _same_bytes(a: CPUCheckpoint, b: CPUCheckpoint) -> None:
    assert (a.format, a.geometry, a.position) == (b.format, b.geometry, b.position)
    assert a.token_ids.tobytes() == b.token_ids.tobytes()
    assert len(a.layers) == len(b.layers)
    for x, y in zip(a.layers, b.layers):
        assert x.start == y.start
        assert x.keys.tobytes() == y.keys.tobytes() and x.values.tobytes() == y.values.tobytes()


PROMPT = [3 + (11 * j) % 250 for j in range(40)]
SUFFIX = [7, 8, 9, 10, 11]


async def _cold(client, prompt: list[int], n: int = 12) -> list[int]:
    sid = f"cold-{len(prompt)}-{n}"
    await client.open_session(sid)
    result = await client.generate(prompt, greedy(sid, n)).wait()
    await client.close_session(sid)
    return result.generated_token_ids


async def test_save_restart_resume_prefills_only_the_suffix_and_matches_a_cold_run(worker_command, model_dir, tmp_path):
    store = await _store(tmp_path / "store", model_dir)
    async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
        await client.open_session("chat")
        first = await client.generate(PROMPT, greedy("chat")).wait()
        await client.save_session("chat")
        before = await client.export_checkpoint_to_cpu("chat", identity=store.identity)
    assert client.returncode == 0
    history = PROMPT + first.generated_token_ids
    saved_position = len(history) - 1  # the last sampled token has no KV yet
    assert before.position == saved_position

    # A later process: the store recreated from the same files and settings, a new worker.
    store = await _store(tmp_path / "store", model_dir)
    async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
        assert await client.resume_session("chat") == "chat"
        again = await client.export_checkpoint_to_cpu("chat", identity=store.identity)
        _same_bytes(again, before)  # byte for byte, through a file and two workers
        next_prompt = history + SUFFIX
        resumed = await client.generate(next_prompt, greedy("chat")).wait()
        assert resumed.reused_prompt_tokens == saved_position
        assert resumed.prefilled_prompt_tokens == len(next_prompt) - saved_position == 1 + len(SUFFIX)
        assert resumed.generated_token_ids == await _cold(client, next_prompt)
        with pytest.raises(SessionExists):
            await client.resume_session("chat")
        with pytest.raises(CheckpointNotFound):
            await client.resume_session("never-saved")


async def test_a_draft_model_session_saves_and_resumes_through_the_store_with_its_draft(model_dir, tmp_path):
    """A worker with a draft model saves through the file channel like any other: the draft's
    rows go with the session's (one segment file, no separate format), a turn later appends, and
    a new worker resumes with the draft where it was, exactly like the first one continues."""
    draft = model_dir  # the model drafting for itself: a draft model all the same, with its own cache
    command = default_worker_command(
        model_dir, dtype="float32", max_sessions=8, max_session_tokens=512, draft=draft, n_draft=3
    )
    store = await _store(tmp_path / "store", model_dir, draft=str(draft), n_draft=3)
    with trio.fail_after(HANG_GUARD_S):
        async with spawn_multiplexed_worker(command, session_store=store) as client:
            await client.open_session("chat")
            first = await client.generate(PROMPT, greedy("chat")).wait()
            saved = await client.save_session("chat")
            before = await client.export_checkpoint_to_cpu("chat", identity=store.identity)
            assert before.draft is not None and saved.segments == 1 and not saved.incremental
            history = PROMPT + first.generated_token_ids + SUFFIX
            second = await client.generate(history, greedy("chat")).wait()
            again = await client.save_session("chat")
            assert again.incremental and again.segments == 2
            expected = await client.generate(history + second.generated_token_ids + SUFFIX, greedy("chat")).wait()
        async with spawn_multiplexed_worker(command, session_store=store) as client:
            await client.resume_session("chat")
            resumed = await client.generate(history + second.generated_token_ids + SUFFIX, greedy("chat")).wait()
            assert resumed.prefilled_prompt_tokens == 1 + len(SUFFIX)
            assert resumed.generated_token_ids == expected.generated_token_ids
            # A host checkpoint with draft state restores into a new session of the same worker.
            await client.restore_checkpoint_from_cpu(before, "copy")
            copy = await client.export_checkpoint_to_cpu("copy", identity=store.identity)
            _same_bytes(copy, before)
            assert copy.draft_position == before.draft_position
            for x, y in zip(copy.draft["layers"], before.draft["layers"]):
                assert (x.start, x.keys.tobytes(), x.values.tobytes()) == (
                    y.start,
                    y.keys.tobytes(),
                    y.values.tobytes(),
                )
    # A worker without the draft refuses the session, leaving the id unused.
    async with spawn_multiplexed_worker(
        default_worker_command(model_dir, dtype="float32", max_sessions=8, max_session_tokens=512)
    ) as plain:
        with pytest.raises(CheckpointRejected, match="carries draft-model state"):
            await plain.restore_checkpoint_from_cpu(before, "x")


async def test_exact_retry_restores_one_token_early_and_prefills_one(worker_command, model_dir, tmp_path):
    identity = (await _store(tmp_path / "store", model_dir)).identity
    async with spawn_multiplexed_worker(worker_command) as client:
        await client.open_session("seed")
        await client.generate(PROMPT, greedy("seed")).wait()
        checkpoint = await client.export_checkpoint_to_cpu("seed", identity=identity)
        assert checkpoint.identity == identity
        retry = checkpoint.token_ids.tolist()  # exactly the saved tokens
        matched = checkpoint.common_prefix_length(retry)
        position = min(matched, max(0, len(retry) - 1))
        assert position == checkpoint.position - 1
        checkpoint.validate_restore_position(position)
        await client.restore_checkpoint_from_cpu(checkpoint, "fork", position=position, expected_identity=identity)
        result = await client.generate(retry, greedy("fork")).wait()
        assert (result.reused_prompt_tokens, result.prefilled_prompt_tokens) == (position, 1)
        assert result.generated_token_ids == await _cold(client, retry)
        # A partial match: an earlier prefix plus new input.
        partial = retry[:25] + SUFFIX
        await client.restore_checkpoint_from_cpu(checkpoint, "partial", position=25, expected_identity=identity)
        result = await client.generate(partial, greedy("partial")).wait()
        assert (result.reused_prompt_tokens, result.prefilled_prompt_tokens) == (25, len(SUFFIX))
        assert result.generated_token_ids == await _cold(client, partial)


async def test_a_loaded_checkpoint_survives_its_file_being_overwritten_and_truncated(
    worker_command, model_dir, tmp_path
):
    store = await _store(tmp_path / "store", model_dir)
    async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
        for sid, prompt in (("chat", PROMPT), ("other", PROMPT[::-1])):
            await client.open_session(sid)
            await client.generate(prompt, greedy(sid)).wait()
            await client.save_session(sid)
        exported = await client.export_checkpoint_to_cpu("chat", identity=store.identity)
        loaded = await trio.to_thread.run_sync(store.load, "chat")
        path = store.path_for("chat")
        shutil.copyfile(store.path_for("other"), path)  # `cp other path`: same inode, new bytes
        _same_bytes(loaded, exported)
        os.truncate(path, 0)  # reading a mapping of it now would raise SIGBUS
        _same_bytes(loaded, exported)
        await client.restore_checkpoint_from_cpu(loaded, "restored", expected_identity=store.identity)
        _same_bytes(await client.export_checkpoint_to_cpu("restored", identity=store.identity), exported)
        next_prompt = loaded.token_ids.tolist() + SUFFIX
        resumed = await client.generate(next_prompt, greedy("restored")).wait()
        assert resumed.reused_prompt_tokens == loaded.position
        assert resumed.generated_token_ids == await _cold(client, next_prompt)


async def test_model_and_configuration_mismatches_are_rejected(worker_command, model_dir, tiny_model_factory, tmp_path):
    store = await _store(tmp_path / "store", model_dir)
    async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
        await client.open_session("chat")
        await client.generate(PROMPT, greedy("chat")).wait()
        await client.save_session("chat")
        checkpoint = await client.export_checkpoint_to_cpu("chat", identity=store.identity)
        with pytest.raises(CheckpointIncompatible):
            await client.restore_checkpoint_from_cpu(checkpoint, "other", expected_identity="f" * 64)
    # Another configuration binds another identity: the saved file is refused, nothing is restored.
    other = await _store(tmp_path / "store", model_dir, dtype="bfloat16")
    async with spawn_multiplexed_worker(worker_command, session_store=other) as client:
        with pytest.raises(CheckpointIncompatible):
            await client.resume_session("chat")
        await client.open_session("chat")  # the id stayed unused
    # Another model geometry: the worker itself rejects the checkpoint.
    mistral = tiny_model_factory("mistral")
    async with spawn_multiplexed_worker(
        default_worker_command(mistral, dtype="float32", max_session_tokens=512)
    ) as client:
        with pytest.raises(CheckpointRejected, match="geometry"):
            await client.restore_checkpoint_from_cpu(checkpoint, "chat")
        await client.open_session("chat")


async def test_a_worker_running_another_dtype_than_the_store_declares_is_refused(model_dir, tmp_path):
    # The store says float32; the worker runs bfloat16. Before, the save went through and the
    # store held a bfloat16 file under a float32 identity.
    store = await _store(tmp_path / "store", model_dir)
    bf16 = default_worker_command(model_dir, max_sessions=8, max_session_tokens=512, dtype="bfloat16")
    async with spawn_multiplexed_worker(bf16, session_store=store) as client:
        assert client.info.dtype == "bfloat16"
        await client.open_session("chat")
        await client.generate(PROMPT, greedy("chat")).wait()
        with pytest.raises(ConfigurationMismatch, match=r"dtype: store float32, worker bfloat16$"):
            await client.save_session("chat")
        with pytest.raises(ConfigurationMismatch, match="dtype: store float32, worker bfloat16"):
            await client.resume_session("chat")
        # The advanced path into the store is refused by the checkpoint's own dtype.
        checkpoint = await client.export_checkpoint_to_cpu("chat", identity=store.identity)
        with pytest.raises(ConfigurationMismatch, match="dtype: store float32, checkpoint bfloat16"):
            await trio.to_thread.run_sync(store.save, "chat", checkpoint)
    assert await trio.to_thread.run_sync(store.list) == []
    # Every declared field the hello reports is compared, and all that differ are named.
    wide = await _store(tmp_path / "wide", model_dir, max_sessions=4, architecture="mistral")
    with pytest.raises(ConfigurationMismatch) as info:
        wide.check_worker(client.info)
    assert str(info.value).endswith(
        f"architecture: store mistral, worker {client.info.model.architecture}; "
        "dtype: store float32, worker bfloat16; max_sessions: store 4, worker 8"
    )  # max_session_tokens was declared too, and agrees


async def test_a_file_from_another_configuration_names_what_differs(worker_command, model_dir, tmp_path):
    store = await _store(tmp_path / "store", model_dir)
    async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
        await client.open_session("chat")
        await client.generate(PROMPT, greedy("chat")).wait()
        await client.save_session("chat")
    # The same directory opened for another setting and another tokenizer file: the error says so,
    # not just that two digests differ.
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_bytes((model_dir / "tokenizer.json").read_bytes() + b" ")
    other = await SessionStore.create(
        tmp_path / "store",
        model_files=[model_dir / "model.safetensors", tokenizer],
        configuration=_configuration(rope_theta=500000.0),
    )
    with pytest.raises(CheckpointIncompatible) as info:
        await trio.to_thread.run_sync(other.load, "chat")
    message = str(info.value)
    assert "rope_theta: file (not set), store 500000.0" in message
    assert "model file 2 (tokenizer.json): file " in message
    assert "model file 1" not in message  # the weights are the same


async def test_unsaveable_and_busy_sessions(worker_command, model_dir, tmp_path):
    store = await _store(tmp_path / "store", model_dir)
    async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
        await client.open_session("empty")
        with pytest.raises(Unsaveable):
            await client.save_session("empty")
        await client.open_session("busy")
        stream = client.generate(PROMPT, greedy("busy", 300))
        await stream.__anext__()
        with pytest.raises(Unsaveable):
            await client.save_session("busy")
        assert await trio.to_thread.run_sync(store.list) == []
        stream.cancel()
        result = await stream.wait()
        # A cancelled turn keeps what was streamed and stays saveable (issue 13: Ctrl-C keeps the session).
        await client.save_session("busy")
        saved = await trio.to_thread.run_sync(store.load, "busy")
        assert saved.token_ids.tolist() == (PROMPT + result.generated_token_ids)[: saved.position]


async def test_killing_the_worker_during_a_save_keeps_the_previous_file(worker_command, model_dir, tmp_path):
    store = await _store(tmp_path / "store", model_dir)
    async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
        await client.open_session("chat")
        await client.generate(PROMPT, greedy("chat")).wait()
        await client.save_session("chat")
        previous = await trio.to_thread.run_sync(store.load, "chat")
        await client.generate(PROMPT + SUFFIX, greedy("chat")).wait()
        os.kill(client.pid, signal.SIGSTOP)  # the export below stays in flight
        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                failure = []

                async def save() -> None:
                    try:
                        await client.save_session("chat")
                    except WorkerDiedError as exc:
                        failure.append(exc)

                nursery.start_soon(save)
                await trio.sleep(0.2)
                os.kill(client.pid, signal.SIGKILL)
        assert failure
    loaded = await trio.to_thread.run_sync(store.load, "chat")
    _same_bytes(loaded, previous)


class _SlowStore(SessionStore):
    """Records concurrent saves; a save can be held until the test releases it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.active = 0
        self.max_active = 0
        self.saved: list[str] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self._lock = threading.Lock()

    # A save through the worker's file channel runs from begin_save (the store creates the
    # segment the worker writes) to commit_save (the manifest is replaced) or abort_save.
    def begin_save(self, session_id):
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        return super().begin_save(session_id)

    def commit_save(self, plan, *args):
        self.entered.set()  # the worker has written the segment; the manifest is next
        self.hold.wait(HANG_GUARD_S)
        try:
            manifest = super().commit_save(plan, *args)
            self.saved.append(plan.session_id)
            return manifest
        finally:
            with self._lock:
                self.active -= 1

    def abort_save(self, plan):
        super().abort_save(plan)
        with self._lock:
            self.active -= 1


async def _slow_store(path, model_dir) -> _SlowStore:
    identity = (await _store(path, model_dir)).identity
    return _SlowStore(path, identity=identity)


async def test_concurrent_saves_are_serialized_in_call_order(worker_command, model_dir, tmp_path):
    store = await _slow_store(tmp_path / "store", model_dir)
    async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
        sids = [f"s{i}" for i in range(5)]
        for i, sid in enumerate(sids):
            await client.open_session(sid)
            await client.generate(PROMPT[: 10 + i], greedy(sid, 4)).wait()
        exported: list[int] = []
        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                for sid in sids:
                    nursery.start_soon(client.save_session, sid)
                    await trio.sleep(0)  # queue them in this order
                    nursery.start_soon(lambda s=sid: _export_into(client, s, exported))
                    await trio.sleep(0)
        assert store.max_active == 1
        assert store.saved == sids
        assert len(exported) == len(sids)
        for sid in sids:
            assert (await trio.to_thread.run_sync(store.load, sid)).position == (
                await client.export_checkpoint_to_cpu(sid)
            ).position


async def _export_into(client, sid: str, out: list[int]) -> None:
    out.append((await client.export_checkpoint_to_cpu(sid)).position)


async def test_queued_checkpoint_operations_can_be_cancelled_and_started_ones_settle(
    worker_command, model_dir, tmp_path
):
    store = await _slow_store(tmp_path / "store", model_dir)
    async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
        for sid in ("a", "b"):
            await client.open_session(sid)
            await client.generate(PROMPT, greedy(sid, 4)).wait()
        store.hold.clear()
        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                first = trio.CancelScope()
                queued = trio.CancelScope()
                outcome: dict[str, str] = {}

                async def run(name: str, scope: trio.CancelScope, call) -> None:
                    with scope:
                        await call()
                        outcome[name] = "done"
                        return
                    outcome[name] = "cancelled"

                nursery.start_soon(run, "first", first, lambda: client.save_session("a"))
                await trio.to_thread.run_sync(store.entered.wait)  # "a" is in its file write
                nursery.start_soon(run, "queued", queued, lambda: client.save_session("b"))
                await trio.sleep(0.1)
                queued.cancel()  # still waiting for the queue: it never starts
                await trio.sleep(0.1)
                assert outcome == {"queued": "cancelled"}
                first.cancel()  # already transferring: the cancel waits for it to settle
                await trio.sleep(0.1)
                assert "first" not in outcome
                store.hold.set()
        # The started save completed (and says so; the caller's next checkpoint sees the cancel);
        # the queued one never ran.
        assert outcome == {"queued": "cancelled", "first": "done"}
        assert store.saved == ["a"]
        assert await trio.to_thread.run_sync(store.list) == ["a"]
        # The queue is free again.
        await client.save_session("b")
        assert await trio.to_thread.run_sync(store.list) == ["a", "b"]


async def test_close_never_autosaves(worker_command, model_dir, tmp_path):
    store = await _store(tmp_path / "store", model_dir)
    async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
        await client.open_session("chat")
        await client.generate(PROMPT, greedy("chat")).wait()
    assert await trio.to_thread.run_sync(store.list) == []  # the session was saveable; nothing saved it


@pytest.mark.slow
async def test_smollm2_save_restart_resume_matches_a_cold_run(tmp_path):
    from muxworker.worker.models.loader import bundled_gguf_path

    command = default_worker_command(dtype="float32", weights="float", max_session_tokens=1024)
    store_args = dict(model_files=[bundled_gguf_path()], configuration=_configuration(max_session_tokens=1024))
    store = await SessionStore.create(tmp_path / "store", **store_args)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    async with spawn_multiplexed_worker(command, session_store=store, startup_timeout=600) as client:
        first_prompt = (await client.apply_chat_template(chat)).token_ids
        await client.open_session("chat")
        first = await client.generate(first_prompt, GenerationParams(session_id="chat", max_new_tokens=24)).wait()
        await client.save_session("chat")
        before = await client.export_checkpoint_to_cpu("chat", identity=store.identity)
    store = await SessionStore.create(tmp_path / "store", **store_args)
    async with spawn_multiplexed_worker(command, session_store=store, startup_timeout=600) as client:
        await client.resume_session("chat")
        _same_bytes(await client.export_checkpoint_to_cpu("chat", identity=store.identity), before)
        # The complete next prompt: the saved history (an answer that stopped ends with the committed
        # <|im_end|>; one cut at max_new_tokens is closed here) plus the next turn in the chat format.
        close = "" if first.finish_reason == "stop" else "<|im_end|>"
        suffix = await client.tokenize(close + "\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n")
        next_prompt = first_prompt + first.generated_token_ids + suffix
        resumed = await client.generate(next_prompt, GenerationParams(session_id="chat", max_new_tokens=24)).wait()
        assert resumed.reused_prompt_tokens == before.position
        assert resumed.prefilled_prompt_tokens == len(next_prompt) - before.position
        await client.open_session("cold")
        cold = await client.generate(next_prompt, GenerationParams(session_id="cold", max_new_tokens=24)).wait()
        assert resumed.generated_token_ids == cold.generated_token_ids  # what the reply says is the model's
