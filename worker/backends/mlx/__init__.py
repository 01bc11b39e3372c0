"""The MLX backend (Metal, or mlx[cpu] on Linux): ``model.py``, ``cache.py``, ``executor.py``, the
mirror of the torch backend's files."""
