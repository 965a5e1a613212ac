"""The ``-P pulse`` pool (``pulse`` alias)."""
