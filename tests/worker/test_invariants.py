"""What the engine guarantees whatever the CPU, on the bundled SmolLM2 in its default weights (GGUF
blocks in the native decode step), under both dtypes ``--dtype auto`` picks (bfloat16 on CPUs with
AVX512-BF16 or AMX, float32 elsewhere) and on every instruction set of the native kernels this CPU
runs (AVX-512 VNNI, AVX2, portable C; ``MUXWORKER_NATIVE_ISA`` forces one for a whole process).

Greedy tokens differ between those configurations in near-ties, so no test asserts which words a
model picks; within each configuration a session's greedy tokens are the same decoded alone or
batched with others, with n-gram drafts verified in chunks or without, beside a late joiner whose
prompt prefills in chunks (passes that mix dense prefill rows with native decode rows), and
continued live or resumed from its checkpoint.
"""

from __future__ import annotations

import pytest
from helpers.engine import greedy, run
from helpers.gguf_files import converted_smollm

from muxworker import native
from muxworker.worker.build import load_engine
from muxworker.worker.engine.config import EngineConfig

N_DRAFT = 4
ISAS = [pytest.param(level, id=name) for level, name in enumerate(native.ISA_NAMES) if level <= native.best_isa()]


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def engines(request, tmp_path_factory):
    """(plain, n-gram drafting) engines of one dtype; one pair at a time (module scope, by param)."""
    d = converted_smollm(tmp_path_factory.getbasetemp())

    def engine(speculative: str | None):
        config = EngineConfig(
            max_sessions=6,
            max_session_tokens=512,
            prefill_chunk_tokens=48,
            n_draft=N_DRAFT if speculative else 0,
            speculative=speculative,
        )
        return load_engine(d, config, device="cpu", dtype=request.param, progress=None)

    plain, drafting = engine(None), engine("ngram")
    assert plain.dtype_name == drafting.dtype_name == request.param
    assert plain.executor.native is not None and drafting.executor.native is not None  # the path under test
    return plain, drafting


@pytest.fixture
def forced_isa(request):
    native.set_isa(request.param)
    yield request.param
    native.set_isa(-1)  # back to the default (MUXWORKER_NATIVE_ISA's or the best)


@pytest.mark.parametrize("forced_isa", ISAS, indirect=True)
def test_batching_drafting_and_resuming_change_no_greedy_token(engines, forced_isa):
    plain, drafting = engines
    assert native.isa() == forced_isa
    # Portable C runs about ten times slower than the SIMD kernels: a smaller scene there.
    sessions, n = (4, 24) if forced_isa else (2, 10)
    tok = plain.tokenizer
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    prompts = [tok.encode(f"# file {i}\n" + code * (1 + i % 3) + "def mul(a, b):") for i in range(sessions)]
    late = tok.encode("Write the word hello ten times: hello hello hello" * 6)  # > 48: prefilled in chunks
    want = {}
    for i, ids in enumerate([*prompts, late]):  # each session alone, plain decoding
        plain.open_session(f"s{i}")
        plain.submit(i + 1, f"s{i}", ids, greedy(n))
        want.update({rid: res["generated_token_ids"] for rid, (_, res) in run(plain).items()})
        plain.close_session(f"s{i}")

    for i, ids in enumerate(prompts):  # together, drafting, a late joiner prefilling beside them
        drafting.open_session(f"s{i}")
        drafting.submit(i + 1, f"s{i}", ids, greedy(n))
    for _ in range(3):
        drafting.step()
    drafting.open_session("late")
    drafting.submit(sessions + 1, "late", late, greedy(n))
    results = {rid: res for rid, (_, res) in run(drafting).items()}
    assert {rid: res["generated_token_ids"] for rid, res in results.items()} == want
    assert sum(res["draft_accepted_tokens"] for res in results.values()) > 0

    # Resumed from its checkpoint (its short next prompt runs in the native step) equals continued
    # live, the two decoding together.
    history = drafting.session_tokens("s0")
    drafting.restore_checkpoint("r0", drafting.export_checkpoint("s0"))
    follow = history + tok.encode("\n\ndef div(a, b):")
    drafting.submit(11, "s0", follow, greedy(n // 2))
    drafting.submit(12, "r0", follow, greedy(n // 2))
    live, resumed = (res for _, (_, res) in sorted(run(drafting).items()))
    assert resumed["reused_prompt_tokens"] == live["reused_prompt_tokens"] > 0
    assert resumed["generated_token_ids"] == live["generated_token_ids"]
    for sid in [f"s{i}" for i in range(sessions)] + ["late", "r0"]:
        drafting.close_session(sid)
