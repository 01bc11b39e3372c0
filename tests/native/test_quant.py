"""The native quantized products (native/quant.c) against the gguf package's dequantization.

The oracle: the activations rounded to int8 per block of 32 (what the products multiply), times
the gguf package's dequantized weights, in float64. Every type, every instruction set this CPU
has, random blocks and the bundled model's own tensors."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from muxworker import native
from muxworker.worker.models.loader import bundled_gguf_path

TYPES = list(native.QUANT_TYPES)
# Byte offsets of each type's float16 scales (random bytes there could be NaN or huge).
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
ISAS = [level for level in range(3) if level <= native.best_isa()]


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    native.set_isa(-1)
    native.set_threads(2)


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    b = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[type_name]:
        scales = rng.uniform(0.001, 0.02, size=(rows, cols // values)).astype(np.float16)
        b[:, :, off : off + 2] = scales.view(np.uint8).reshape(rows, cols // values, 2)
    if type_name == "Q8_0":  # llama.cpp's quantizer never writes -128
        q = b[:, :, 2:].view(np.int8)
        q[q == -128] = -127
    return b.reshape(rows, -1)


def int8_rounded(x: np.ndarray) -> np.ndarray:
    """The activations as the products see them: int8 per block of 32 with scale max|x| / 127."""
    blocks = x.astype(np.float64).reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(-1, keepdims=True) / 127
    q = np.clip(np.rint(np.divide(blocks, d, out=np.zeros_like(blocks), where=d > 0)), -127, 127)
    return (q * d).reshape(x.shape)


def oracle(blocks: np.ndarray, type_name: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the exact product of int8-rounded x and the dequantized weights, its magnitude scale)."""
    w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]).reshape(blocks.shape[0], -1)
    a = int8_rounded(x)
    return a @ w.astype(np.float64).T, np.abs(a) @ np.abs(w.astype(np.float64)).T


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_each_type_on_each_instruction_set_equals_the_oracle(type_name: str, isa: int) -> None:
    native.set_isa(isa)
    blocks = random_blocks(type_name, 48, 512, seed=isa)
    x = np.random.default_rng(1).standard_normal((5, 512)).astype(np.float32)
    want, scale = oracle(blocks, type_name, x)
    got = native.qmatmul(blocks, type_name, x)
    # Float rounding only: each 32-value block's integer dot is exact, its float32 sum is not.
    assert np.abs(got - want).max() <= 2e-6 * scale.max()
    assert np.abs(got - want).max() > 0 or isa == 0  # it did compute in float32, not float64


@pytest.mark.parametrize("type_name", TYPES)
def test_instruction_sets_agree_and_rows_do_not_depend_on_their_batch(type_name: str) -> None:
    blocks = random_blocks(type_name, 40, 768, seed=3)
    x = np.random.default_rng(2).standard_normal((native.MAX_ROWS, 768)).astype(np.float32)
    results = []
    for isa in ISAS:
        native.set_isa(isa)
        full = native.qmatmul(blocks, type_name, x)
        # Each row alone, and in batches of every size, gives the same bits as in the full batch.
        for m in (1, 3, 5, 8):
            np.testing.assert_array_equal(native.qmatmul(blocks, type_name, x[:m]), full[:m])
        np.testing.assert_array_equal(native.qmatmul(blocks, type_name, x[7:8])[0], full[7])
        native.set_threads(1)
        np.testing.assert_array_equal(native.qmatmul(blocks, type_name, x), full)  # any thread count
        native.set_threads(2)
        results.append(full)
    for other in results[1:]:  # the orders of the float sums differ, by rounding only
        np.testing.assert_allclose(other, results[0], rtol=1e-5, atol=1e-5 * np.abs(results[0]).max())


def test_row_map_places_each_row() -> None:
    blocks = random_blocks("Q4_1", 64, 256)
    x = np.random.default_rng(4).standard_normal((2, 256)).astype(np.float32)
    perm = np.random.default_rng(5).permutation(64).astype(np.int32)
    plain = native.qmatmul(blocks, "Q4_1", x)
    mapped = native.qmatmul(blocks, "Q4_1", x, row_map=perm)
    np.testing.assert_array_equal(mapped[:, perm], plain)


def test_the_bundled_models_tensors_equal_the_oracle() -> None:
    reader = gguf.GGUFReader(bundled_gguf_path())
    tensors = {t.name: t for t in reader.tensors}
    rng = np.random.default_rng(6)
    for name in ("blk.3.ffn_down.weight", "blk.7.attn_q.weight", "token_embd.weight"):
        t = tensors[name]
        rows, cols = int(t.shape[1]), int(t.shape[0])
        blocks = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
        if rows > 4096:
            blocks = blocks[:4096]  # the 49,152-row head: its first rows
        x = rng.standard_normal((3, cols)).astype(np.float32)
        want, scale = oracle(blocks, t.tensor_type.name, x)
        got = native.qmatmul(blocks, t.tensor_type.name, x)
        assert np.abs(got - want).max() <= 2e-6 * scale.max(), name


def test_bad_arguments_say_what_is_wrong() -> None:
    blocks = random_blocks("Q4_0", 4, 64)
    with pytest.raises(ValueError, match="Q2_K"):
        native.qmatmul(blocks, "Q2_K", np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match="1 <= M <= 16"):
        native.qmatmul(blocks, "Q4_0", np.zeros((17, 64), np.float32))
    with pytest.raises(ValueError, match="need 72 bytes"):
        native.qmatmul(blocks, "Q4_0", np.zeros((1, 128), np.float32))
    with pytest.raises(ValueError, match="whole number of blocks"):
        native.quant_row_bytes("Q4_K", 64)
    with pytest.raises(ValueError, match="native threads"):
        native.set_threads(0)


def test_the_thread_pool_starts_its_first_job_and_survives_a_fork() -> None:
    blocks = random_blocks("Q4_1", 64, 256)
    x = np.ones((1, 256), np.float32)
    for _ in range(20):  # a job posted before a new worker first runs must not be missed
        native.set_threads(1)
        native.set_threads(2)
        want = native.qmatmul(blocks, "Q4_1", x)
    pid = os.fork()
    if pid == 0:  # the child has no workers: it runs alone instead of waiting for them
        import signal

        signal.alarm(10)
        ok = np.array_equal(native.qmatmul(blocks, "Q4_1", x), want) and native._lib.mux_q_threads() == 1
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_isa_variable_names_each_level_and_refuses_what_the_cpu_lacks() -> None:
    for best in range(3):
        assert native.parse_isa("", best) == native.parse_isa(" auto ", best) == best
        for level, name in enumerate(native.ISA_NAMES[: best + 1]):
            assert native.parse_isa(name, best) == native.parse_isa(name.upper().replace("-", ""), best) == level
    with pytest.raises(
        ValueError, match=r"MUXWORKER_NATIVE_ISA=avx512-vnni: this CPU cannot run .* \(it runs portable, avx2\)"
    ):
        native.parse_isa("avx512-vnni", 1)
    with pytest.raises(ValueError, match=r"cannot run the avx2 kernels \(it runs portable\)"):
        native.parse_isa("avx2", 0)
    with pytest.raises(ValueError, match="'sse4' names no instruction set .* use auto, portable, avx2, avx512-vnni"):
        native.parse_isa("sse4", 2)


def _with_isa_variable(value: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter (the variable is read once, at import) reporting the level it runs."""
    code = (
        "from muxworker import native\n"
        "assert native.crc32c(b'123456789') == 0xE3069283  # the CRC never depends on the variable\n"
        "native.set_threads(1)\n"
        "print(native.isa())\n"
    )
    env = {**os.environ, native.ISA_ENV: value}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_the_isa_variable_forces_the_kernels_of_a_whole_process() -> None:
    for level in ISAS:
        run = _with_isa_variable(native.ISA_NAMES[level])
        assert (run.returncode, run.stdout.strip()) == (0, str(level)), run.stderr
    refused = _with_isa_variable("sse4")
    assert (
        refused.returncode == 1 and "ValueError: MUXWORKER_NATIVE_ISA='sse4' names no instruction set" in refused.stderr
    )
