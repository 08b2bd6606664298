"""The CPU backend's C kernels, their header and their build, in one place.

``cpu_decode.c`` (decode attention and the KV write, read through the page
table in place; ``cpu_decode.py`` loads it as ``CpuDecodeOps``) and
``cpu_gemv.c`` (one-row int4/int8 products; ``paged_server.models.quantization.cpu_gemv``
loads it) share ``bf16.h`` and are compiled on first use by ``c_library.py``.
The reference ops beside this folder (``paged_ref.ops``) stay the definition
the kernels are tested against.
"""
