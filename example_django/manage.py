#!/usr/bin/env python
"""Django's command line for the example shop (run from the repository's root:
``python example_django/manage.py migrate``)."""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_django.shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
