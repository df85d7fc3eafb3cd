import os

from celery import Celery
from celery.signals import beat_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

app = Celery("lifeline")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
app.autodiscover_tasks(related_name="reactions")  # recovery.reactions.react: the outbox, every second


@beat_init.connect
def _control_plane_started(sender=None, **kwargs) -> None:
    """Beat starts with the control plane (there is exactly one): nodes that have not served yet are joining,
    and the level kept from before the start is evaluated afresh (recovery.actions.capacity)."""
    # Imported here, not at the top: this module loads with the console package, before Django's apps are ready.
    from recovery.actions import capacity

    capacity.control_plane_started()
