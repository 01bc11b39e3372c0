"""Crafted model files and chat templates: how long each refusal takes and how much memory it needs.

    python scripts/bench_crafted_models.py [--only SUBSTRING]

Each case runs in a subprocess of its own (GGUF cases through convert_gguf, the path
``python -m muxworker.serve`` takes at start; template cases through Tokenizer.apply_chat_template,
the path of every request, after the start's check); the parent reads the child's peak RSS and CPU
time from os.wait4. One end-to-end case runs ``python -m muxworker.serve`` on a crafted GGUF.
Target (issue 40): each a clean error in < 5 s and < 500 MB. The tests
(tests/worker/models/test_crafted_models.py) assert the errors; this measures their cost.
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIG = 2**31

TEMPLATES = {
    "template: 'x' * 10^9": "{{ 'x' * 1000000000 }}",
    "template: range(10^9)": "{% for i in range(10**9) %}x{% endfor %}",
    "template: nested loops 10^5 x 10^5": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}",
    "template: nested output 10^5 x 10^5": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}"
    "{% endfor %}",
    "template: set block 10^10 pieces": "{% set x %}{% for i in range(99999) %}{% for j in range(99999) %}ab"
    "{% endfor %}{% endfor %}{% endset %}{{ x }}",
    "template: recursive macro": "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
    "template: doubling macro": "{% macro m(s) %}{{ m(s ~ s) }}{% endmacro %}{{ m('x') }}",
    "template: recursive loop": "{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}",
    "template: center(10^9)": "{{ 'x' | center(1000000000) }}",
    "template: '%1000000000s'": "{{ '%1000000000s' % 'x' }}",
    "template: 2 ** 10^8": "{{ 2 ** 100000000 }}",
    "template: list of 1 MB x 1000": "{% set l = ['x' * 1000000] * 1000 %}{{ l }}",
    "template: replace 1 MB by 1 MB": "{% set s = 'x' * 1000000 %}{{ s.replace('x', s) }}",
    "template: growing list of 1 MB": "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
    "{% set ns.l = ns.l + ['x' * 1000000] %}{% endfor %}",
    "template: recursive 8 MB values": "{% macro m(n) %}{% set s = 'y' * 8000000 %}{{ m(n + 1) }}{{ s[:1] }}"
    "{% endmacro %}{{ m(0) }}",
}

# GGUF metadata overrides of a small, otherwise valid header (no tensors: every bound is checked
# before the tensors are).
HYPERPARAMETERS = {
    "gguf: block_count 2^31": ("llama.block_count", BIG),
    "gguf: block_count 0": ("llama.block_count", 0),
    "gguf: head_count 0": ("llama.attention.head_count", 0),
    "gguf: head_count 2^31": ("llama.attention.head_count", BIG),
    "gguf: embedding_length 2^31": ("llama.embedding_length", BIG),
    "gguf: context_length 2^31": ("llama.context_length", BIG),
    "gguf: rope.freq_base -1": ("llama.rope.freq_base", -1.0),
    "gguf: rope.freq_base NaN": ("llama.rope.freq_base", float("nan")),
}


def _string(s: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(s) if length is None else length) + s


HEADERS = {
    "gguf: 2^31 tensors": (BIG, 0, b"", b""),
    "gguf: 2^31 metadata keys": (0, BIG, b"", b""),
    "gguf: key of 2^31 bytes": (0, 1, _string(b"k", BIG), b""),
    "gguf: string of 2^40 bytes": (0, 1, _string(b"general.name") + struct.pack("<I", 8) + _string(b"", 2**40), b""),
    "gguf: array of 2^31 strings": (0, 1, _string(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, BIG), b""),
    "gguf: array of 2^40 floats": (0, 1, _string(b"tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 2**40), b""),
    "gguf: tensor of 2^62 x 2^62": (1, 0, b"", _string(b"w") + struct.pack("<IQQIQ", 2, 2**62, 2**62, 0, 0)),
    "gguf: tensor with 5 dims": (1, 0, b"", _string(b"w") + struct.pack("<I", 5) + bytes(52)),
}


def _write_metadata_gguf(path: Path, key: str, value: float) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    values = {
        "llama.block_count": 2,
        "llama.context_length": 256,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 96,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
    }
    values[key] = value
    for k, v in values.items():
        kind = gguf.GGUFValueType.FLOAT32 if isinstance(v, float) else gguf.GGUFValueType.UINT32
        w.add_key_value(k, v, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def _run_case(name: str, work: Path) -> str:
    """Runs in the child: the error the case ends in (its first line), or what it rendered."""
    if name in TEMPLATES:
        from tokenizers import Tokenizer as BackendTokenizer
        from tokenizers import models

        from muxworker.worker.models.tokenizer import ChatTemplateError, Tokenizer

        tokenizer = Tokenizer(BackendTokenizer(models.BPE(vocab={"a": 0}, merges=[])), chat_template=TEMPLATES[name])
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        except ChatTemplateError as e:
            return f"ChatTemplateError: {e}"
        return f"RENDERED {len(text)} characters"
    from muxworker.worker.models.convert import convert_gguf
    from muxworker.worker.models.loader import InvalidModelError

    path = work / "crafted.gguf"
    if name in HYPERPARAMETERS:
        _write_metadata_gguf(path, *HYPERPARAMETERS[name])
    else:
        n_tensors, n_kv, kvs, tensors = HEADERS[name]
        path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs + tensors + bytes(64))
    try:
        convert_gguf(path, work / "out", progress=None, weights="link")
    except InvalidModelError as e:
        return f"InvalidModelError: {str(e).replace(str(path), 'crafted.gguf')}"
    return "CONVERTED"


def _measure(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, float, float, int, str]:
    """(exit status, wall s, cpu s, peak RSS in MiB, last stderr/stdout line) of a child process."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = [line for line in out.splitlines() if line.strip()]
    return proc.returncode, wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss // 1024, lines[-1] if lines else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child's entry point
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(_run_case(args.case, Path(args.work)), flush=True)
        return 0
    names = [n for n in (*TEMPLATES, *HYPERPARAMETERS, *HEADERS) if args.only in n]
    print(f"{'case':40s} {'exit':>4s} {'wall s':>7s} {'cpu s':>6s} {'peak MiB':>8s}  result")
    worst_wall, worst_rss = 0.0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            work = Path(tmp) / str(i)
            work.mkdir()
            code, wall, cpu, rss, last = _measure([sys.executable, __file__, "--case", name, "--work", str(work)])
            worst_wall, worst_rss = max(worst_wall, wall), max(worst_rss, rss)
            print(f"{name:40s} {code:4d} {wall:7.2f} {cpu:6.2f} {rss:8d}  {last[:110]}", flush=True)
        if args.only in "serve: block_count 2^31 (end to end)":
            work = Path(tmp) / "serve"
            work.mkdir()
            path = work / "crafted.gguf"
            _write_metadata_gguf(path, "llama.block_count", BIG)
            env = {**os.environ, "MUXWORKER_CACHE": str(work / "cache")}
            argv = [sys.executable, "-m", "muxworker.serve", "--model", str(path), "--port", "0"]
            code, wall, cpu, rss, last = _measure([*argv, "--store", str(work / "store")], env)
            worst_wall, worst_rss = max(worst_wall, wall), max(worst_rss, rss)
            name = "serve: block_count 2^31 (end to end)"
            print(
                f"{name:40s} {code:4d} {wall:7.2f} {cpu:6.2f} {rss:8d}  {last.replace(str(path), 'crafted.gguf')[:110]}"
            )
    print(f"worst: {worst_wall:.2f} s, {worst_rss} MiB (target: < 5 s and < 500 MB each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
