"""Triton kernels, installed as ``vqlcmd.kernels`` (see setup.py for why not ``kernels``).

One module per op; the kernels of ``softmax_embedding_average`` are in ``_sea_*.py`` beside it
(README.md has the map and the measurements behind each variant). Whether the kernels run
compiled or in Triton's interpreter is fixed when they are first imported
(``TRITON_INTERPRET=1`` then means the interpreter), so import them lazily, after the
environment is set; ``vqlcmd.ops._triton`` does.

``aot_check`` compiles every kernel configuration for H100 (sm_90) on a machine without a GPU.
"""
