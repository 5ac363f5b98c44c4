"""BitSparse in training frameworks, each imported only when its module is.

``bitsparse.integrations.transformers``: ``BitSparseTrainer`` (or ``BitSparseTrainerMixin``) and
``BitSparseCallback`` for Hugging Face's ``Trainer`` (``pip install -e ".[transformers]"``).
``bitsparse.integrations.lightning``: ``BitSparseCallback`` for Lightning's ``Trainer``
(``pip install -e ".[lightning]"``). Importing ``bitsparse`` or this package imports neither
framework.
"""
