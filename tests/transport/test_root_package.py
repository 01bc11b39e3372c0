"""The installed package: its version, and which layers an application pulls in."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import muxworker


def test_the_package_names_its_installed_version():
    assert muxworker.__version__ == version("muxworker")


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return set(out.stdout.split())


def test_the_client_and_model_resolution_do_not_import_torch(tiny_llama_dir):
    """An application that talks to a worker and binds a store to its model files needs neither
    torch (about +180 MiB, +1.2 s) nor the worker's engine."""
    modules = _modules_after(
        "import muxworker.client, muxworker.chat\n"
        "from muxworker.worker.models import model_identity_files, resolve_model, worker_configuration\n"
        f"model_identity_files(resolve_model({str(tiny_llama_dir)!r}, progress=None))\n"
    )
    assert "torch" not in modules
    assert not any(m.startswith(("muxworker.worker.engine", "muxworker.worker.backends")) for m in modules)
