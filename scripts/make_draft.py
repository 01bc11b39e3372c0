"""Derive an early-exit draft model from a model by keeping its first K decoder layers.

The draft is a complete Hugging Face directory: config.json with num_hidden_layers=K, the weights of
layers 0..K-1 plus the embeddings, the final norm and the LM head (tied or not), and the tokenizer
files copied unchanged, so it shares the target's tokenizer as speculative decoding requires.

    python scripts/make_draft.py --layers 8 OUT_DIR              # from the bundled SmolLM2
    python scripts/make_draft.py --model PATH --layers 8 OUT_DIR

The draft's hidden state after K layers goes straight through the final norm and the LM head, which
the model was never trained for; how often the target agrees with it is measured by
scripts/bench_speculative.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

from muxworker.worker.models.loader import load_model_dir, load_state_dict, resolve_model

COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def make_draft(model: str | os.PathLike[str] | None, out_dir: str | os.PathLike[str], layers: int) -> Path:
    """Write the first ``layers`` layers of ``model`` (None: the bundled SmolLM2) to ``out_dir``."""
    from safetensors.torch import save_file

    src = resolve_model(model, progress=None)
    files = load_model_dir(src)
    config = dict(files.config)
    total = int(config["num_hidden_layers"])
    if not 1 <= layers <= total:
        raise ValueError(f"--layers must be in [1, {total}] (the model has {total} layers), got {layers}")
    state = load_state_dict(src)
    kept = {}
    for name, tensor in state.items():
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) < layers:
            # safetensors refuses tensors that share memory (tied weights appear once anyway).
            kept[name] = tensor.contiguous().clone()
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    if isinstance(config.get("max_window_layers"), int):
        config["max_window_layers"] = min(config["max_window_layers"], layers)
    name = config.get("_name_or_path") or Path(src).name
    config["_name_or_path"] = f"{Path(str(name)).name}-early-exit-{layers}"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in COPIED_FILES:
        if (Path(src) / file).is_file():
            shutil.copyfile(Path(src) / file, out / file)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="directory to write the draft model to")
    ap.add_argument("--layers", type=int, required=True, help="decoder layers to keep (the first K)")
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: bundled SmolLM2)")
    args = ap.parse_args(argv)
    try:
        out = make_draft(args.model, args.out_dir, args.layers)
    except (ValueError, OSError) as exc:
        print(f"make_draft: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
