"""The bridge between ``lowprec`` layers and ``nvdlfw_inspect``: routing state and the debug features.

``FEATURE_DIR`` holds the ``transformer_engine`` namespace and its features. Importing ``lowprec``
registers it with ``nvdlfw_inspect``, so passing it in ``feature_dirs`` is optional.
"""

from pathlib import Path

FEATURE_DIR = Path(__file__).resolve().parent / "features"

__all__ = ["FEATURE_DIR"]
