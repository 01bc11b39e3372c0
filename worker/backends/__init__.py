"""Backends: a model, its KV cache and an executor behind one interface (``interface.py``).

``torch/`` runs on CPU and CUDA, ``mlx/`` on Apple silicon (and mlx[cpu] on Linux); the two define
the same public names in mirror files. ``muxworker.worker.build`` picks one through an explicit
table and imports only that one.
"""
