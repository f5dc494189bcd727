"""Built-in features of the ``base`` namespace; always loaded by ``initialize``."""
