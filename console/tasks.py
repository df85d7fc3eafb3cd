"""The console's Celery tasks: adapters that call one function and own the retries (recovery/tasks.py holds the
control plane's)."""

import smtplib

from celery import shared_task
from django.utils import timezone

from console import exports
from console.readmodels import reports


@shared_task(ignore_result=True, autoretry_for=(OSError, smtplib.SMTPException), retry_backoff=60, max_retries=5)
def mail_weekly_report() -> list[str]:
    """Monday 06:00 UTC (CELERY_BEAT_SCHEDULE): last week's SLA report to every manager, with its PDF."""
    return exports.mail_report(reports.last_complete("week", timezone.now()))
