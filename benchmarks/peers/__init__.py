"""llama.cpp as a benchmark peer: building and serving it (``llamacpp.py``),
converting a checkpoint with its own converter (``gguf_convert.py``), and the
side-by-side serving comparison (``serving.py``). Driven by
``benchmarks/llamacpp_peer.py``; not part of any shipped package."""
