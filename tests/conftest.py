from __future__ import annotations

import pytest
from helpers.gguf_files import without_vocabulary
from helpers.tiny_models import write_tiny_model


def pytest_terminal_summary(terminalreporter) -> None:
    """The CPU a run's results depend on, what --dtype auto picks there and the native kernels'
    instruction set, as the run's last line (also under -q, which hides the header)."""
    import platform
    from pathlib import Path

    from muxworker import native
    from muxworker.worker.models.defaults import auto_dtype

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        cpu = next(line.partition(":")[2].strip() for line in cpuinfo.splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    terminalreporter.write_line(
        f"cpu: {cpu}; --dtype auto: {auto_dtype('cpu')}; native kernels: {native.ISA_NAMES[native.isa()]} "
        f"(best here {native.ISA_NAMES[native.best_isa()]}; {native.ISA_ENV} forces one)"
    )


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
