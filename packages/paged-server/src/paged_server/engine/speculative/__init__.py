"""Speculative decoding: drafts proposed cheaply, checked by the model in one pass (``ngram.py``, ``verify.py``)."""
