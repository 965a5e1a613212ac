"""The example shop's settings. The database comes from ``SHOP_DATABASE_URL``
(``postgres://user:password@host:5432/name``, with ``?search_path=schema`` if the tables
live in a schema of their own; ``mysql://user:password@host:3306/name`` for MySQL or
MariaDB) or is a SQLite file beside the project."""

import os
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "example-only-not-a-secret")
DEBUG = False
ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    # pulse: its schema with manage.py migrate, its admin pages, manage.py pulse, and
    # lease.fenced(django.db.connection).
    "celery_pulse.contrib.django",
    # Schedules edited in the admin; pulse's leader-elected beat reads them (no celery beat).
    "django_celery_beat",
    "example_django.orders",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "example_django.shop.urls"
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages"]},
}]
STATIC_URL = "static/"


def _database(url: str | None) -> dict:
    if not url:
        return {"ENGINE": "django.db.backends.sqlite3",
                "NAME": os.environ.get("SHOP_SQLITE", str(BASE_DIR / "shop.sqlite3"))}
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    engine = "mysql" if parts.scheme.startswith(("mysql", "mariadb")) else "postgresql"
    database = {"ENGINE": f"django.db.backends.{engine}", "NAME": parts.path.lstrip("/"),
                "USER": unquote(parts.username or ""), "PASSWORD": unquote(parts.password or ""),
                "HOST": parts.hostname or "", "PORT": str(parts.port or "")}
    if "search_path" in query:
        database["OPTIONS"] = {"options": f"-c search_path={query['search_path'][0]}"}
    return database


DATABASES = {"default": _database(os.environ.get("SHOP_DATABASE_URL"))}

# Celery, read through the CELERY namespace (shop/celery.py).
CELERY_BROKER_URL = os.environ.get("SHOP_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("SHOP_QUEUE", "shop")
CELERY_RESULT_BACKEND = "pulse://"
# pulse's store is Django's own "default" database: no second URL to keep in step.
CELERY_PULSE_DATABASE = os.environ.get("SHOP_PULSE_DATABASE", "default")
CELERY_PULSE_LEASE_TTL = float(os.environ.get("SHOP_LEASE_TTL", "30"))
CELERY_PULSE_RECOVER_INTERVAL = float(os.environ.get("SHOP_RECOVER_INTERVAL", "2"))
CELERY_TASK_ALWAYS_EAGER = os.environ.get("SHOP_EAGER") == "1"
# django-celery-beat's schedules, fired by pulse's leader-elected beat inside the workers.
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_PULSE_LEADER_TTL = float(os.environ.get("SHOP_LEADER_TTL", "15"))
CELERY_PULSE_BEAT_CATCHUP = os.environ.get("SHOP_BEAT_CATCHUP", "latest")
