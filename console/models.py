import hashlib
import secrets

from django.conf import settings
from django.db import models
from django.utils import timezone

TOKEN_PREFIX = "llt_"


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class ApiTokenQuerySet(models.QuerySet):
    def active(self):
        return self.filter(revoked_at__isnull=True, user__is_active=True)


class ApiToken(models.Model):
    """A bearer token for the JSON API; it acts as its user, with the user's role.

    Only a digest is stored: the token itself is shown once, when it is made.
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    label = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=12, help_text="First characters of the token, to recognise it in lists.")
    digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = ApiTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"{self.prefix}… ({self.user})"

    @classmethod
    def issue(cls, user, label: str = "") -> tuple["ApiToken", str]:
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        row = cls.objects.create(user=user, label=label, prefix=token[:12], digest=digest(token))
        return row, token

    @classmethod
    def authenticate(cls, token: str):
        """The user a token acts as, or None when the token is unknown or revoked."""
        if not token.startswith(TOKEN_PREFIX):
            return None
        row = cls.objects.active().select_related("user").filter(digest=digest(token)).first()
        if row is None:
            return None
        now = timezone.now()
        # Record use at most once a minute, so a busy script does not write on every call.
        if row.last_used_at is None or (now - row.last_used_at).total_seconds() > 60:
            cls.objects.filter(pk=row.pk).update(last_used_at=now)
        return row.user
