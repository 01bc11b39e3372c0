"""The torch backend (CPU, CUDA): ``model.py``, ``cache.py``, ``executor.py``."""
