"""Triton kernels, installed as ``vqlcmd.kernels`` (see setup.py for why not ``kernels``)."""
