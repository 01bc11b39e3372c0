"""Build hook: setuptools reads everything from pyproject.toml; this file only adds the cffi module."""
from setuptools import setup

setup(cffi_modules=["native/_build.py:ffibuilder"])
