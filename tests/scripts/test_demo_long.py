"""scripts/demo.py (`make demo`) end to end on a tiny model: both conversations are saved, resumed
after a worker restart and continued, the long one holds 2,000+ tokens, and the resumed turns
reproduce the replies the sessions gave when continued without the restart."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "scripts" / "demo.py"


def _num(text: str) -> int:
    return int(text.replace(",", ""))


@pytest.mark.slow  # the demo spawns and restarts real workers
def test_the_demo_resumes_a_long_conversation(tiny_llama_dir, tmp_path):
    argv = [sys.executable, str(DEMO), "--model", str(tiny_llama_dir), "--threads", "1", "--store", str(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert out.startswith("model: model.safetensors (safetensors, ")  # the header names the weights' format
    assert "the worker's hello: weights float, dtype " in out
    assert out.count("| same reply as the session continued without the restart | yes |") == 2

    saved = _num(re.search(r"The long conversation \(([\d,]+) tokens saved\)", out)[1])
    assert saved >= 2000
    long_table = out[out.index("6. The long conversation") :]
    row = re.search(
        r"\| prompt tokens \| ([\d,]+) reused \+ ([\d,]+) prefilled of ([\d,]+) "
        r"\| 0 reused \+ ([\d,]+) prefilled of ([\d,]+) \|",
        long_table,
    )
    reused, prefilled, total, cold_prefilled, cold_total = (_num(g) for g in row.groups())
    # The resumed session computes only the new turn (and the history's last token, whose KV no
    # step had computed yet); the cold one prefills all of it.
    assert reused >= saved - 1 and reused + prefilled == total
    assert cold_prefilled == cold_total == total
    assert re.search(rf"resumed vs cold, {saved:,}-token conversation: first token [\d,]+ ms vs [\d,]+ ms", out)
    assert "restored by resume_session in" in long_table and "| whole turn (" in long_table


@pytest.mark.slow
def test_the_header_names_the_bundled_gguf_and_its_tensor_types():
    from muxworker.worker.models.loader import resolve_model

    spec = importlib.util.spec_from_file_location("demo", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    header = demo.weights_format(resolve_model(None))
    assert header.startswith("SmolLM2-135M-Instruct.Q4_1.gguf (GGUF, ")
    assert re.search(r"\d+ Q4_1", header) and "Q8_0" in header
