"""Build of the vqlcmd package.

The Triton kernels live in the top-level folder ``kernels/`` (DESIGN.md) and are
installed as the sub-package ``vqlcmd.kernels`` (a top-level package named
``kernels`` would clash with an unrelated PyPI package of that name). The link
``vqlcmd/kernels -> ../kernels`` makes that one package in every install mode:
setuptools' lenient editable finder maps only top-level packages, so a
``package_dir`` entry alone would leave ``vqlcmd.kernels`` unimportable from an
editable install.

The C++/CUDA extension ``vqlcmd._C`` is added by ``csrc/build.py`` once it exists.
"""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["vqlcmd", "vqlcmd.*"]))
