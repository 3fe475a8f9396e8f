"""The V100 inference portal: a Django project with its Celery app."""

from .celery import app as celery_app

__all__ = ("celery_app",)
