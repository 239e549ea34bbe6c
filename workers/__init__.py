"""Celery workers: the app factory, one step task per engine queue, the child-process step runner.

Importing this package imports neither Celery nor any engine SDK; the API imports
``workers.queues`` to enqueue steps on the Celery app it was given.
"""
