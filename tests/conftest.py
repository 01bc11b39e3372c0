from __future__ import annotations

import pytest
from helpers.gguf_files import without_vocabulary
from helpers.tiny_models import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Returns make(arch="llama", **overrides) -> Path, caching one directory per configuration."""
    made: dict[tuple, object] = {}

    def make(arch: str = "llama", **overrides):
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            made[key] = write_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tiny_model_factory):
    return tiny_model_factory("mistral")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def smollm2_reference(tmp_path_factory):
    """transformers' SmolLM2 (tokenizer, float32 model in eval mode) straight from the bundled GGUF:
    the reference several modules compare against, loaded once (it takes about 14 s)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from muxworker.worker.models.loader import bundled_gguf_path

    gguf = bundled_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The model from the same tensors and metadata less the vocabulary arrays, which it does not
    # read and transformers would parse again (gguf_files.without_vocabulary).
    weights = without_vocabulary(gguf, tmp_path_factory.getbasetemp() / "smollm2-weights.gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        weights.parent, gguf_file=weights.name, dtype=torch.float32
    )
    return tok, model.eval()
