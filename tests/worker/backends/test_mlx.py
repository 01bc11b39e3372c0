"""The MLX backend against the torch backend (and transformers), and checkpoints across the two.

Tolerances (float32 logits, max abs difference): 1e-4 on the tiny random models (measured ~2e-6,
~5e-6 on qwen3 and gemma3), 1e-3 on SmolLM2-135M (measured ~2e-4). Engine-level behaviours run on
both backends through the ``backend`` fixture; greedy float32 tokens must be equal across backends.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")

from helpers.engine import greedy, prompt_ids, run

from muxworker.transport.checkpoint import CPUCheckpoint, LayerState
from muxworker.transport.errors import CheckpointRejected, SessionNotFound
from muxworker.worker.backends.interface import SeqSpan
from muxworker.worker.backends.mlx import cache as mlx_cache
from muxworker.worker.backends.mlx.executor import MLXExecutor
from muxworker.worker.backends.torch import cache as torch_cache
from muxworker.worker.backends.torch.executor import TorchExecutor
from muxworker.worker.build import BACKENDS, BackendUnavailableError, get_backend, load_engine, load_model
from muxworker.worker.engine.config import EngineConfig

ARCHS = ["llama", "llama3", "qwen2", "mistral", "qwen3", "gemma3"]  # gemma3: sliding, full, sliding
TINY_ATOL = 1e-4
SMOL_ATOL = 1e-3


@pytest.fixture(params=["torch", "mlx"])
def backend(request):
    return request.param


def make(model_dir, backend, *, dtype="float32", **cfg):
    cfg.setdefault("max_session_tokens", 512)
    # Float weights on both: MLX has no int4 path, and the comparisons are of the same weights.
    return load_engine(model_dir, EngineConfig(**cfg), dtype=dtype, backend=backend, progress=None, weights="float")


def executor(model_dir, backend, *, slots=2, max_tokens=256, dtype="float32", rollback_rows=0):
    loaded = load_model(model_dir, backend=backend, dtype=dtype, progress=None, weights="float")
    return get_backend(backend).executor(loaded.model, slots, max_tokens, rollback_rows, "cpu")


def both(model_dir, **kw):
    return executor(model_dir, "torch", **kw), executor(model_dir, "mlx", **kw)


def span(ex, slot, start, ids, offset=0):
    """One sequence's forward: logits of every row."""
    n = len(ids)
    return ex.forward(ids, list(range(start, start + n)), [SeqSpan(slot, start, n, offset)], list(range(n)))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def same_layers(a: list[LayerState], b: list[LayerState]) -> bool:
    return len(a) == len(b) and all(
        x.start == y.start
        and x.keys.dtype == y.keys.dtype
        and np.array_equal(x.keys, y.keys)
        and np.array_equal(x.values, y.values)
        for x, y in zip(a, b)
    )


# ----------------------------------------------------------------------------------------------
# Model: logits against transformers and the torch model


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers_and_torch(tiny_model_factory, arch):
    import transformers

    d = tiny_model_factory(arch)
    ids = prompt_ids(70, seed=1)  # 70 > mistral's and gemma3's window of 16
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    t, m = both(d)
    ours = span(m, 0, 0, ids)
    assert ours.dtype == torch.float32 and ours.device.type == "cpu" and ours.shape == expected.shape
    assert max_diff(ours, expected) <= TINY_ATOL
    assert max_diff(ours, span(t, 0, 0, ids)) <= TINY_ATOL


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_match_torch(tiny_model_factory, arch):
    t, m = both(tiny_model_factory(arch))
    ids = prompt_ids(60, seed=2)
    pos = 0
    for n in (13, 1, 20, 1, 1, 5, 19):  # chunks wider and narrower than the window, and decode steps
        chunk = ids[pos : pos + n]
        assert max_diff(span(m, 1, pos, chunk), span(t, 1, pos, chunk)) <= TINY_ATOL, f"chunk at {pos} of {n}"
        pos += n


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3"])
def test_packed_batch_with_batched_decode_matches_torch_and_separate_runs(tiny_model_factory, arch):
    """Three decode rows (batched attention) and a prefill chunk in one forward, past the window."""
    d = tiny_model_factory(arch)
    seqs = [prompt_ids(n, seed=10 + n) for n in (9, 21, 34, 25)]
    t, m = both(d, slots=4)
    alone = executor(d, "mlx", slots=4)
    for ex in (t, m, alone):
        for slot, s in enumerate(seqs[:3]):
            span(ex, slot, 0, s[:-1])
        span(ex, 3, 0, seqs[3][:12])
    tokens = [s[-1] for s in seqs[:3]] + seqs[3][12:]
    positions = [len(s) - 1 for s in seqs[:3]] + list(range(12, 25))
    spans = [SeqSpan(i, len(s) - 1, 1, i) for i, s in enumerate(seqs[:3])] + [SeqSpan(3, 12, 13, 3)]
    rows = list(range(16))
    packed = m.forward(tokens, positions, spans, rows)
    assert max_diff(packed, t.forward(tokens, positions, spans, rows)) <= TINY_ATOL
    separate = torch.cat(
        [span(alone, i, len(s) - 1, s[-1:]) for i, s in enumerate(seqs[:3])] + [span(alone, 3, 12, seqs[3][12:])]
    )
    assert max_diff(packed, separate) <= 1e-5


def test_ring_spare_rows_roll_back_like_torch(tiny_mistral_dir):
    """Rollback rows (speculative decoding): write past the length, continue from an earlier one."""
    t, m = both(tiny_mistral_dir, rollback_rows=3)
    ids, drafted = prompt_ids(50, seed=3), prompt_ids(4, seed=4)
    for ex in (t, m):
        span(ex, 0, 0, ids[:30])
        span(ex, 0, 30, drafted)  # rows 30..33; then keep only 30 and continue from 31
        span(ex, 1, 0, ids[:25])
    assert max_diff(span(m, 0, 31, ids[31:36]), span(t, 0, 31, ids[31:36])) <= TINY_ATOL
    # Batched decode over the spare rows (stale draft rows are masked out) equals single decodes
    # on a cache that never held the drafts.
    ref = executor(tiny_mistral_dir, "mlx")
    span(ref, 0, 0, ids[:30] + drafted[:1] + ids[31:36])
    span(ref, 1, 0, ids[:25])
    for p, q in ((36, 25), (37, 26), (38, 27)):
        packed = m.forward([ids[p], ids[q]], [p, q], [SeqSpan(0, p, 1, 0), SeqSpan(1, q, 1, 1)], [0, 1])
        single = torch.cat([span(ref, 0, p, [ids[p]]), span(ref, 1, q, [ids[q]])])
        assert max_diff(packed, single) <= 1e-5


def test_forward_rejects_out_of_range_input(tiny_llama_dir):
    m = executor(tiny_llama_dir, "mlx", max_tokens=32)
    with pytest.raises(ValueError, match="positions"):
        span(m, 0, 30, [1, 2, 3])  # MLX gathers do not check bounds, so the executor does
    with pytest.raises(ValueError, match="token ids"):
        span(m, 0, 0, [1, 384])
    with pytest.raises(ValueError, match="spans"):
        m.forward([1, 2], [0, 1], [SeqSpan(0, 0, 1, 0)], [0])


# ----------------------------------------------------------------------------------------------
# Cache: the same interface and retention rules


@pytest.mark.parametrize("rollback_rows", [0, 2])
def test_cache_retention_rules_match_torch(rollback_rows):
    windows = [None, 5, 40]  # full, ring, and a window >= max_tokens (full layout, logical window)
    t = torch_cache.KVCache(windows, 2, 32, 2, 4, torch.float32, "cpu", rollback_rows=rollback_rows)
    m = mlx_cache.KVCache(windows, 2, 32, 2, 4, mx.float32, rollback_rows=rollback_rows)
    assert m.windows == t.windows and m.slots == t.slots and m.nbytes == t.nbytes
    assert [type(x).__name__ for x in m.layers] == [type(x).__name__ for x in t.layers]
    for length in range(33):
        assert m.earliest_position(length) == t.earliest_position(length)
        for position in range(length + 2):
            assert m.can_truncate(length, position) == t.can_truncate(length, position)
        for lm, lt in zip(m.layers, t.layers):
            assert lm.retained(length) == lt.retained(length) and lm.needed(length) == lt.needed(length)


@pytest.mark.parametrize("start", [0, 3, 27])
@pytest.mark.parametrize("window", [None, 5])
def test_cache_rows_round_trip_like_torch(window, start):
    """import_rows then export_rows, and copy_slot, give the same logical rows on both layouts."""
    rng = np.random.default_rng(start)
    n = 32 - start
    k = rng.standard_normal((n, 2, 4), dtype=np.float32)
    v = rng.standard_normal((n, 2, 4), dtype=np.float32)
    t = torch_cache.KVCache([window], 2, 32, 2, 4, torch.float32, "cpu")
    m = mlx_cache.KVCache([window], 2, 32, 2, 4, mx.float32)
    t.layers[0].import_rows(0, start, torch.from_numpy(k), torch.from_numpy(v))
    m.layers[0].import_rows(0, start, mx.array(k), mx.array(v))
    m.copy_slot(0, 1, 32)
    m.layers[0].import_rows(0, 31, mx.zeros((1, 2, 4)), mx.zeros((1, 2, 4)))  # the copy stays independent
    for position in range(1, 33):
        if not t.can_truncate(32, position):
            continue
        lo_t, kt, vt = t.layers[0].export_rows(0, 32, position)
        lo_m, km, vm = m.layers[0].export_rows(1, 32, position)
        assert lo_m == lo_t
        assert np.array_equal(np.array(km), kt.numpy()) and np.array_equal(np.array(vm), vt.numpy())


# ----------------------------------------------------------------------------------------------
# Executor: the same interface, checkpoint rows in the same logical layout


def test_executor_interface_mirrors_torch(tiny_mistral_dir):
    t, m = both(tiny_mistral_dir)
    assert isinstance(t, TorchExecutor) and isinstance(m, MLXExecutor)
    assert (t.backend, m.backend) == ("torch", "mlx")
    assert (m.dtype_name, m.device_name) == (t.dtype_name, t.device_name) == ("float32", "cpu")
    assert m.args == t.args and m.cache.windows == t.cache.windows
    for name in ("forward", "export_layers", "import_layers"):
        assert callable(getattr(m, name))
    ids = prompt_ids(40, seed=5)
    for ex in (t, m):
        span(ex, 1, 0, ids)
    # The same logical rows (computed by each backend, so equal up to rounding).
    for a, b in zip(m.export_layers(1, 40, 40), t.export_layers(1, 40, 40)):
        assert (
            (a.start, a.keys.shape, a.keys.dtype)
            == (b.start, b.keys.shape, b.keys.dtype)
            == (24, (16, 2, 16), np.float32)
        )  # the W rows retained() claims
        assert np.allclose(a.keys, b.keys, atol=1e-5) and np.allclose(a.values, b.values, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_export_import_bit_exact(tiny_mistral_dir, dtype):
    m = executor(tiny_mistral_dir, "mlx", dtype=dtype)
    assert m.dtype_name == dtype
    logits = span(m, 0, 0, prompt_ids(30, seed=6))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    layers = m.export_layers(0, 30, 30)
    storage = np.uint16 if dtype == "bfloat16" else np.float16  # bfloat16 travels as its bits
    assert all(x.keys.dtype == storage and x.keys.flags.c_contiguous and x.keys.shape[1:] == (2, 16) for x in layers)
    m.import_layers(1, 30, layers)
    assert same_layers(m.export_layers(1, 30, 30), layers)
    with pytest.raises(ValueError, match="needs"):
        m.import_layers(1, 30, [LayerState(x.start, x.keys.view(np.int16), x.values.view(np.int16)) for x in layers])


# ----------------------------------------------------------------------------------------------
# Engine behaviours on both backends


def test_batching_invariance(tiny_llama_dir, backend):
    prompts = [prompt_ids(5 + 7 * i, seed=i) for i in range(6)]
    alone = []
    for p in prompts:
        eng = make(tiny_llama_dir, backend)
        eng.open_session("s")
        eng.submit(1, "s", p, greedy(10))
        alone.append(run(eng)[1][1]["generated_token_ids"])
    eng = make(tiny_llama_dir, backend, prefill_chunk_tokens=16)
    for i, p in enumerate(prompts):
        eng.open_session(f"s{i}")
        eng.submit(i + 1, f"s{i}", p, greedy(10))
    together = run(eng)
    assert [together[i + 1][1]["generated_token_ids"] for i in range(6)] == alone


def test_sliding_window_extension_matches_cold(tiny_mistral_dir, backend):
    eng = make(tiny_mistral_dir, backend, prefill_chunk_tokens=7)
    eng.open_session("s")
    p1 = prompt_ids(40, 7)
    eng.submit(1, "s", p1, greedy(20))
    r1 = run(eng)[1][1]
    p2 = p1 + r1["generated_token_ids"] + prompt_ids(11, 8)
    eng.submit(2, "s", p2, greedy(10))
    r2 = run(eng)[2][1]
    assert r2["reused_prompt_tokens"] == len(p1) + 19
    cold = make(tiny_mistral_dir, backend)
    cold.open_session("c")
    cold.submit(1, "c", p2, greedy(10))
    assert run(cold)[1][1]["generated_token_ids"] == r2["generated_token_ids"]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_prefix_cache_hit_matches_cold(tiny_model_factory, backend, arch):
    """A hit copies an entry's slot (copy_slot) into the session's; a ring entry only offers its tail."""
    d = tiny_model_factory(arch)
    first = prompt_ids(35, 9)
    eng = make(d, backend, prefix_cache_entries=1)
    eng.open_session("a")
    eng.submit(1, "a", first, greedy(4))
    run(eng)
    eng.open_session("b")
    p = first + prompt_ids(6, 11)
    eng.submit(2, "b", p, greedy(6))
    res = run(eng)[2][1]
    assert res["reused_prompt_tokens"] == len(first)
    cold = make(d, backend)
    cold.open_session("c")
    cold.submit(1, "c", p, greedy(6))
    assert run(cold)[1][1]["generated_token_ids"] == res["generated_token_ids"]


def test_speculative_greedy_equals_plain_greedy(tiny_model_factory, backend):
    """A draft's rejected rows roll back (ring spare rows on the sliding-window target)."""
    target, draft = tiny_model_factory("mistral"), tiny_model_factory("llama")
    outs = []
    for n_draft, d in ((0, None), (3, draft)):
        eng = load_engine(
            target,
            EngineConfig(max_session_tokens=256, n_draft=n_draft, prefill_chunk_tokens=8),
            backend=backend,
            draft=d,
            progress=None,
        )
        for i in range(3):
            eng.open_session(f"s{i}")
            eng.submit(i + 1, f"s{i}", prompt_ids(20 + 9 * i, i), greedy(24))
        res = run(eng)
        outs.append([res[i + 1][1]["generated_token_ids"] for i in range(3)])
        accepted = sum(res[i + 1][1]["draft_accepted_tokens"] for i in range(3))
        proposed = sum(res[i + 1][1]["draft_proposed_tokens"] for i in range(3))
    assert 0 < accepted < proposed  # some drafts were rejected and rolled back
    assert outs[1] == outs[0]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_export_restore_round_trip_is_byte_equal(tiny_model_factory, backend, arch):
    d = tiny_model_factory(arch)
    eng = make(d, backend)
    eng.open_session("s")
    eng.submit(1, "s", prompt_ids(40, 11), greedy(8))
    run(eng)
    ck = eng.export_checkpoint("s")
    assert ck.format == {"backend": backend, "dtype": "float32", "layout_version": 1}
    other = make(d, backend)
    other.open_session("busy")  # another session takes slot 0
    other.restore_checkpoint("r", ck)
    assert same_layers(other.export_checkpoint("r").layers, ck.layers)


# ----------------------------------------------------------------------------------------------
# Across backends: greedy tokens and checkpoints


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_across_backends(tiny_model_factory, arch):
    d = tiny_model_factory(arch)
    prompts = [prompt_ids(n, seed=20 + n) for n in (6, 23, 45)]  # 23 and 45 exceed the window (mistral, gemma3)
    outs = {}
    for b in ("torch", "mlx"):
        eng = make(d, b, prefill_chunk_tokens=10)
        for i, p in enumerate(prompts):
            eng.open_session(f"s{i}")
            eng.submit(i + 1, f"s{i}", p, greedy(16))
        res = run(eng)
        outs[b] = [res[i + 1][1]["generated_token_ids"] for i in range(len(prompts))]
    assert outs["mlx"] == outs["torch"]


@pytest.mark.parametrize(("src", "dst"), [("torch", "mlx"), ("mlx", "torch")])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3"])
def test_checkpoint_moves_across_backends(tiny_model_factory, arch, src, dst):
    """The engine's restore compares dtype, layout and geometry, not the backend."""
    d = tiny_model_factory(arch)
    eng = make(d, src)
    eng.open_session("s")
    p1 = prompt_ids(40, 12)
    eng.submit(1, "s", p1, greedy(8))
    r1 = run(eng)[1][1]
    ck = eng.export_checkpoint("s")
    assert ck.format["backend"] == src
    other = make(d, dst)
    other.restore_checkpoint("r", ck)
    assert same_layers(other.export_checkpoint("r").layers, ck.layers)
    p2 = p1 + r1["generated_token_ids"] + prompt_ids(6, 13)
    other.submit(1, "r", p2, greedy(8))
    r2 = run(other)[1][1]
    assert r2["prefilled_prompt_tokens"] == len(p2) - ck.position
    cold = make(d, dst)
    cold.open_session("c")
    cold.submit(1, "c", p2, greedy(8))
    assert run(cold)[1][1]["generated_token_ids"] == r2["generated_token_ids"]


def test_bfloat16_checkpoint_moves_across_backends_bit_exact(tiny_mistral_dir):
    engines = {b: make(tiny_mistral_dir, b, dtype="bfloat16") for b in ("torch", "mlx")}
    engines["torch"].open_session("s")
    engines["torch"].submit(1, "s", prompt_ids(30, 14), greedy(4))
    run(engines["torch"])
    ck = engines["torch"].export_checkpoint("s")
    assert ck.format["dtype"] == "bfloat16" and ck.layers[0].keys.dtype == np.uint16
    engines["mlx"].restore_checkpoint("r", ck)
    back = engines["mlx"].export_checkpoint("r")
    assert back.format == {**ck.format, "backend": "mlx"} and same_layers(back.layers, ck.layers)
    engines["mlx"].submit(1, "r", ck.token_ids.tolist() + [5], greedy(4))
    assert run(engines["mlx"])[1][1]["completion_tokens"] == 4


def test_restore_rejects_dtype_and_geometry_mismatch_across_backends(tiny_model_factory):
    llama, mistral = tiny_model_factory("llama"), tiny_model_factory("mistral")
    eng = make(mistral, "mlx", dtype="bfloat16")
    eng.open_session("s")
    eng.submit(1, "s", prompt_ids(20, 15), greedy(2))
    run(eng)
    bf16 = eng.export_checkpoint("s")
    f32 = make(mistral, "torch")
    with pytest.raises(CheckpointRejected, match="dtype bfloat16 does not match the worker's float32"):
        f32.restore_checkpoint("r", bf16)
    with pytest.raises(SessionNotFound):
        f32.session_tokens("r")
    wrong = make(llama, "mlx", dtype="bfloat16")
    with pytest.raises(CheckpointRejected, match="geometry"):
        wrong.restore_checkpoint("r", bf16)
    with pytest.raises(SessionNotFound):
        wrong.session_tokens("r")
    # The restore path checks every layer's rows, whatever backend wrote them.
    bad = CPUCheckpoint(bf16.format, bf16.geometry, bf16.position, bf16.token_ids, bf16.layers)
    bad.format = {**bad.format, "layout_version": 2}
    with pytest.raises(CheckpointRejected, match="layout_version 2 is not supported"):
        make(mistral, "mlx", dtype="bfloat16").restore_checkpoint("r", bad)


# ----------------------------------------------------------------------------------------------
# Backend selection


def test_backend_table_and_errors(tiny_llama_dir, monkeypatch):
    assert set(BACKENDS) == {"torch", "mlx"}
    with pytest.raises(BackendUnavailableError, match="expected one of torch, mlx"):
        load_engine(tiny_llama_dir, EngineConfig(), backend="jax", progress=None)
    with pytest.raises(ValueError, match="cpu or gpu"):
        load_engine(tiny_llama_dir, EngineConfig(), backend="mlx", device="tpu", progress=None)
    # A missing mlx package is a clear error at selection time.
    monkeypatch.setitem(sys.modules, "mlx", None)
    monkeypatch.setitem(sys.modules, "mlx.core", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'muxworker\[mlx\]'"):
        load_engine(tiny_llama_dir, EngineConfig(), backend="mlx", progress=None)


def test_torch_backend_never_imports_mlx(tiny_llama_dir):
    code = (
        "import sys\n"
        "from muxworker.worker.build import load_engine\n"
        "from muxworker.worker.engine.config import EngineConfig\n"
        f"eng = load_engine({str(tiny_llama_dir)!r}, EngineConfig(max_session_tokens=64), progress=None)\n"
        "assert eng.backend == 'torch'\n"
        "assert not any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules), 'mlx imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


async def test_worker_subprocess_serves_mlx_and_takes_torch_checkpoints(tiny_mistral_dir, tmp_path):
    """Real workers over real pipes: a torch session's checkpoint continues on an MLX worker, as a
    host checkpoint and through one session store (whose identity leaves the backend out), and a
    save the MLX worker appends to the torch worker's segments resumes on torch again."""
    import trio

    from muxworker.client import GenerationParams, SessionStore, default_worker_command, spawn_multiplexed_worker
    from muxworker.worker.models import worker_configuration

    def params(sid):
        return GenerationParams(session_id=sid, max_new_tokens=8, temperature=0.0, stop_token_ids=[])

    store = await SessionStore.create(
        tmp_path / "store",
        model_files=[tiny_mistral_dir / "model.safetensors"],
        configuration=worker_configuration(backend=None, dtype="float32", model_dir=tiny_mistral_dir),
    )
    prompt = prompt_ids(30, 16)
    with trio.fail_after(120):  # a hang guard, not a timing assertion
        async with (
            spawn_multiplexed_worker(
                default_worker_command(tiny_mistral_dir, backend="torch", dtype="float32", max_session_tokens=256),
                session_store=store,
            ) as t,
            spawn_multiplexed_worker(
                default_worker_command(tiny_mistral_dir, backend="mlx", dtype="float32", max_session_tokens=256),
                session_store=store,
            ) as m,
        ):
            assert (t.info.backend, m.info.backend) == ("torch", "mlx")
            assert (m.info.device, m.info.dtype) == ("cpu", "float32")
            results = {}
            for name, c in (("torch", t), ("mlx", m)):
                await c.open_session("s")
                results[name] = await c.generate(prompt, params("s")).wait()
            assert results["mlx"].generated_token_ids == results["torch"].generated_token_ids
            ck = await t.export_checkpoint_to_cpu("s")
            await m.restore_checkpoint_from_cpu(ck, "r")
            follow = ck.token_ids.tolist() + results["torch"].generated_token_ids[-1:] + prompt_ids(5, 17)
            on_mlx = await m.generate(follow, params("r")).wait()
            on_torch = await t.generate(follow, params("s")).wait()
            assert on_mlx.prefilled_prompt_tokens == len(follow) - ck.position
            assert on_mlx.generated_token_ids == on_torch.generated_token_ids
            # Through the store: torch saves, MLX resumes and appends a turn, torch resumes that.
            await t.open_session("x")
            first = await t.generate(prompt, params("x")).wait()
            await t.save_session("x")
            assert await m.resume_session("x") == "x"
            turn = prompt + first.generated_token_ids + prompt_ids(4, 18)
            on_mlx = await m.generate(turn, params("x")).wait()
            assert on_mlx.prefilled_prompt_tokens == len(turn) - (len(prompt) + len(first.generated_token_ids) - 1)
            saved = await m.save_session("x")
            assert saved.incremental and saved.segments == 2  # MLX rows after the torch segment
            await t.close_session("x")
            await t.resume_session("x")
            then = turn + on_mlx.generated_token_ids + prompt_ids(3, 19)
            on_torch = await t.generate(then, params("x")).wait()
            on_mlx = await m.generate(then, params("x")).wait()
            assert on_torch.prefilled_prompt_tokens == on_mlx.prefilled_prompt_tokens < len(then) - 20
            assert on_torch.generated_token_ids == on_mlx.generated_token_ids


# ----------------------------------------------------------------------------------------------
# The bundled SmolLM2


@pytest.fixture(scope="module")
def smollm2_models():
    """SmolLM2 loaded once for the module, float32 weights, on each backend."""
    return {b: load_model(None, backend=b, dtype="float32", progress=None, weights="float") for b in ("torch", "mlx")}


@pytest.mark.slow
def test_smollm2_logits_match_torch(smollm2_models):
    t, m = (get_backend(b).executor(smollm2_models[b].model, 2, 256, 0, "cpu") for b in ("torch", "mlx"))
    ids = prompt_ids(72, seed=18, vocab=49152)
    pos = 0
    for n in (32, 1, 20, 1, 1, 17):
        chunk = ids[pos : pos + n]
        assert max_diff(span(m, 1, pos, chunk), span(t, 1, pos, chunk)) <= SMOL_ATOL, f"chunk at {pos} of {n}"
        pos += n


@pytest.mark.slow
def test_smollm2_greedy_chats_equal_torch(smollm2_models):
    from helpers.chats import CHATS

    from muxworker.worker.engine import Engine

    outs = {}
    for b in ("torch", "mlx"):
        loaded = smollm2_models[b]
        config = EngineConfig(max_session_tokens=1024, max_sessions=len(CHATS))
        executor = get_backend(b).executor(loaded.model, len(CHATS), 1024, 0, "cpu")
        eng = Engine(executor, loaded.tokenizer, config, model_name=loaded.name, weights=loaded.weights)
        for i, messages in enumerate(CHATS):
            eng.open_session(f"c{i}")
            ids = eng.tokenizer.encode(
                eng.tokenizer.apply_chat_template(messages, add_generation_prompt=True), parse_special=True
            )
            eng.submit(i + 1, f"c{i}", ids, greedy(16))
        res = run(eng)
        outs[b] = [res[i + 1][1]["generated_token_ids"] for i in range(len(CHATS))]
    assert outs["mlx"] == outs["torch"]
