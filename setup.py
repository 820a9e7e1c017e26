"""The packages of kvplay's wheel; everything else is in pyproject.toml.

Setuptools' `packages.find` in pyproject.toml cannot add a package that lives outside kvplay/, and the wheel needs
one: the repository's top-level assets/ (the bundled model, texts, architectures, recordings, seeds), installed as
kvplay/_assets through pyproject.toml's package-dir mapping, where kvplay.paths.assets() finds it.
"""
from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["kvplay*"]), "kvplay._assets"])
