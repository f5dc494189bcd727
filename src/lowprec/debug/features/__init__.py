"""The ``transformer_engine`` config namespace: its API (``api.py``) and one module per feature."""
