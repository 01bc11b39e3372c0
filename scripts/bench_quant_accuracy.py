"""How close the quantized path is to the float reference: teacher-forced top-1 agreement.

For each of three chat prompts, the reference (the GGUF dequantized to float32, ``--weights float
--dtype float32``) generates 64 greedy tokens; then every configuration scores those 64 tokens
after the prompt, and we count the positions where its top-1 token equals the reference's. Each
configuration scores them two ways: as decoding does (the prompt prefilled, then the tokens fed in
chunks of 8 rows, which a quantized model runs in the native step, row by row as a decode would)
and as one prefill pass (torch's dense path). Also the largest absolute logit difference and the
mean KL divergence from the reference, so "close" has a number.

    python scripts/bench_quant_accuracy.py [--model PATH|NAME] [--positions 64] [--threads 2] [--hf]
                                           [--reference ours|transformers]

``--reference transformers`` takes the reference from transformers' float32 model loaded from the
same GGUF (``gguf_file=``) instead of ours, and scores our float path too (issue 32's Gemma target).
A model without a chat template gets three plain-text prompts. ``--hf`` measures ``--quantize int4|int8`` instead: the GGUF is exported to a float32 Hugging Face
directory (a temporary one) and quantized at load, against that directory in float32.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from muxworker.worker.backends.interface import SeqSpan
from muxworker.worker.build import load_engine
from muxworker.worker.engine.config import EngineConfig

CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one paragraph."}],
    [
        {"role": "system", "content": "You are a terse coding assistant."},
        {"role": "user", "content": "Write a Python function that reverses a linked list, with a docstring."},
    ],
    [{"role": "user", "content": "Explain in simple words why the sky is blue."}],
]
# For a base model (no chat template).
PROMPTS = [
    "The capital of France is Paris. It is known for",
    'def reverse_linked_list(head):\n    """Reverse a singly linked list',
    "Explain in simple words why the sky is blue. The sky looks blue because",
]
# (label, --dtype, --weights, --quantize)
CONFIGS = [
    ("--weights quantized --dtype bfloat16 (the default here)", "bfloat16", "quantized", None),
    ("--weights quantized --dtype float32", "float32", "quantized", None),
    ("--weights float --dtype bfloat16", "bfloat16", "float", None),
]
HF_CONFIGS = [
    ("--quantize int8 --dtype bfloat16", "bfloat16", None, "int8"),
    ("--quantize int4 --dtype bfloat16", "bfloat16", None, "int4"),
    ("--quantize int4 --dtype float32", "float32", None, "int4"),
]


def _forward(engine, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of one prefill in slot 0 (float32, CPU)."""
    ex = engine.executor
    n = len(ids)
    return ex.forward(ids, list(range(n)), [SeqSpan(0, 0, n, 0)], list(range(n)))


def _decode_rows(engine, prompt: list[int], gen: list[int], chunk: int = 8) -> torch.Tensor:
    """Logits [len(gen), V] of ``gen`` scored as decoding scores it: the prompt prefilled, then
    the tokens fed ``chunk`` at a time (short spans: the native step of a quantized model)."""
    ex = engine.executor
    n = len(prompt)
    rows = [ex.forward(prompt, list(range(n)), [SeqSpan(0, 0, n, 0)], [n - 1])]
    for i in range(0, len(gen) - 1, chunk):
        part = gen[i : min(i + chunk, len(gen) - 1)]
        pos = list(range(n + i, n + i + len(part)))
        rows.append(ex.forward(part, pos, [SeqSpan(0, n + i, len(part), 0)], list(range(len(part)))))
    return torch.cat(rows)


def _greedy(engine, ids: list[int], n: int) -> list[int]:
    ex = engine.executor
    out: list[int] = []
    logits = _forward(engine, ids)[-1]
    pos = len(ids)
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        logits = ex.forward([tok], [pos], [SeqSpan(0, pos, 1, 0)], [0])[0]
        pos += 1
    return out


def _transformers_reference(model: str | None):
    """(greedy, score) of transformers' float32 model loaded from the GGUF itself."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from muxworker.worker.models.loader import NAMED_MODELS, bundled_gguf_path, named_model_path

    path = bundled_gguf_path() if model is None else named_model_path(model) if model in NAMED_MODELS else Path(model)
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()

    @torch.inference_mode()
    def score(ids: list[int]) -> torch.Tensor:
        return ref(torch.tensor([ids])).logits[0].float()

    @torch.inference_mode()
    def greedy(ids: list[int], n: int) -> list[int]:
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return out[0, len(ids) :].tolist()

    return greedy, score


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF or model directory (default: the bundled SmolLM2 Q4_1)")
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reference", choices=("ours", "transformers"), default="ours")
    ap.add_argument(
        "--hf", action="store_true", help="measure --quantize on the model exported to a float HF directory"
    )
    args = ap.parse_args()
    configs = CONFIGS
    if args.hf:
        import tempfile
        from pathlib import Path

        from muxworker.worker.models.convert import convert_gguf
        from muxworker.worker.models.loader import bundled_gguf_path

        out = Path(tempfile.mkdtemp(prefix="muxworker-hf-")) / "model"
        args.model = convert_gguf(args.model or bundled_gguf_path(), out, progress=None, weights="copy")
        configs = HF_CONFIGS
    torch.set_num_threads(args.threads)
    config = EngineConfig(max_sessions=1, max_session_tokens=1024, prefix_cache_entries=0)

    def engine(dtype: str, weights: str | None, quantize: str | None):
        return load_engine(args.model, config, dtype=dtype, weights=weights, quantize=quantize, progress=None)

    reference = engine("float32", "float", None)
    tok = reference.tokenizer
    if tok.has_chat_template:
        prompts = [
            tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), parse_special=True) for c in CHATS
        ]
    else:
        prompts = [tok.encode(p, add_special_tokens=True) for p in PROMPTS]
    if args.reference == "transformers":
        greedy, score = _transformers_reference(args.model)
        configs = [("--weights float --dtype float32 (ours)", "float32", "float", None), *configs]
        what = "transformers' float32 model loaded from the same GGUF"
    else:
        greedy, score = functools.partial(_greedy, reference), functools.partial(_forward, reference)
        what = "the float32 dequantized model"
    sequences = [(p, greedy(p, args.positions)) for p in prompts]
    ref_logits = [score(p + g)[len(p) - 1 : len(p) - 1 + len(g)] for p, g in sequences]
    del reference, greedy, score

    print(f"teacher-forced top-1 agreement with {what}, {args.positions} positions x 3 prompts")
    print("| configuration | scored as | top-1 agreement | max abs logit diff | mean KL(ref || it) |")
    print("|---|---|---:|---:|---:|")
    for label, dtype, weights, quantize in configs:
        eng = engine(dtype, weights, quantize)
        native = "native step" if eng.executor.native is not None else "torch"
        for way, decode in ((f"decode rows ({native})", True), ("one prefill (torch, dense)", False)):
            agree = total = 0
            diff = 0.0
            kls = []
            for (prompt, gen), ref in zip(sequences, ref_logits):
                if decode:
                    got = _decode_rows(eng, prompt, gen)
                else:
                    got = _forward(eng, prompt + gen)[len(prompt) - 1 : len(prompt) - 1 + len(gen)]
                agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
                total += len(gen)
                diff = max(diff, float((got - ref).abs().max()))
                kl = torch.nn.functional.kl_div(
                    got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none"
                )
                kls.append(kl.sum(-1).mean().item())
            print(
                f"| {label} | {way} | {agree}/{total} = {100 * agree / total:.1f}% | {diff:.2f} "
                f"| {sum(kls) / len(kls):.4f} |"
            )
        del eng
    return 0


if __name__ == "__main__":
    sys.exit(main())
