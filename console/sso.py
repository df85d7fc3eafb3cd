"""Single sign-on: OpenID Connect's authorization-code flow (with PKCE) through mozilla-django-oidc, roles from the
identity provider's groups (docs/operations.md, "Single sign-on").

Off unless configured (LIFELINE_OIDC_* in console/settings.py). When on, the login page offers "Sign in with …";
a user who signs in gets the Lifeline role their groups map to (LIFELINE_OIDC_ROLE_MAP, read again at every sign-in,
so a group taken away at the provider takes the role away at the next one); a user whose groups map to no role is
refused, with a page that says which groups the provider sent and which ones Lifeline maps. Local accounts stay for
break-glass: one with a password is never taken over by a sign-in of the same name.
"""

from urllib.parse import urlencode

from django.conf import settings
from django.contrib import auth
from django.contrib.auth import get_user_model
from django.http import Http404, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST
from mozilla_django_oidc import views as oidc_views
from mozilla_django_oidc.auth import OIDCAuthenticationBackend

from console.actions import set_user_role
from recovery import roles
from recovery.actions import audit

REFUSED = "lifeline_sso_refused"  # the session key the refusal page reads


def enabled() -> bool:
    return settings.LIFELINE_OIDC


def mapped_roles(claims: dict) -> tuple[list[str], list[str]]:
    """The provider's groups (the role claim: a list, or one string) and the Lifeline roles they map to, strongest
    first."""
    value = claims.get(settings.LIFELINE_OIDC_ROLE_CLAIM) or []
    groups = [value] if isinstance(value, str) else [str(g) for g in value]
    found = {settings.LIFELINE_OIDC_ROLE_MAP[g] for g in groups if g in settings.LIFELINE_OIDC_ROLE_MAP}
    return groups, [role for role in roles.PRECEDENCE if role in found]


class RoleMappingBackend(OIDCAuthenticationBackend):
    """mozilla-django-oidc's backend, inert when single sign-on is off; users are matched by the username claim
    and given the roles their groups map to."""

    def __init__(self, *args, **kwargs):
        if enabled():
            super().__init__(*args, **kwargs)
        else:
            self.UserModel = get_user_model()

    def authenticate(self, request, **kwargs):
        if not enabled():
            return None
        return super().authenticate(request, **kwargs)

    def verify_claims(self, claims) -> bool:
        return bool(claims.get("sub")) and bool(claims.get(settings.LIFELINE_OIDC_USERNAME_CLAIM))

    def filter_users_by_claims(self, claims):
        return self.UserModel.objects.filter(username=claims[settings.LIFELINE_OIDC_USERNAME_CLAIM])

    def get_or_create_user(self, access_token, id_token, payload):
        claims = self.get_userinfo(access_token, id_token, payload)
        if not self.verify_claims(claims):
            return self.refuse("", f"the provider sent no {settings.LIFELINE_OIDC_USERNAME_CLAIM!r} claim for you")
        username = str(claims[settings.LIFELINE_OIDC_USERNAME_CLAIM])[:150]
        groups, found = mapped_roles(claims)
        user = self.filter_users_by_claims(claims).first()
        if user is not None and user.has_usable_password():
            return self.refuse(
                username,
                f"a local account named {username!r} exists (one with a password, kept for break-glass): "
                "an admin must rename one of the two before you can sign in",
            )
        if not found:
            if user is not None:  # their group was taken away at the provider: so is their role here
                user.groups.clear()
                user.is_staff = user.is_superuser = False
                user.save(update_fields=["is_staff", "is_superuser"])
            mapping = ", ".join(f"{g} → {r}" for g, r in settings.LIFELINE_OIDC_ROLE_MAP.items()) or "none"
            return self.refuse(
                username,
                f"none of your groups at the identity provider ({', '.join(groups) or 'none sent'}) gives a "
                f"Lifeline role (the groups that do: {mapping}); ask for one of them, or an admin to map yours",
            )
        if user is None:
            user = self.UserModel.objects.create_user(username)
            user.set_unusable_password()  # signs in only through the provider
            user.save(update_fields=["password"])
        # The strongest mapped role as their only one, the admin site's flags with it: as an admin would set it.
        user = set_user_role(username, found[0], email=claims.get("email", ""), actor=f"sso:{username}")
        audit.record(username, "sso_login", f"user:{username}", role=found[0], groups=groups[:20])
        return user

    def refuse(self, username: str, why: str):
        self.request.session[REFUSED] = why
        audit.record(username or "anonymous", "sso_refused", f"user:{username}", reason=why)
        return None


@require_GET
def refused(request):
    """Where a refused sign-in lands: why, and the way back."""
    why = request.session.pop(REFUSED, None) or "the sign-in did not complete (the provider said no, or it timed out)"
    return render(
        request,
        "registration/sso_refused.html",
        {"why": why, "provider": settings.LIFELINE_OIDC_PROVIDER_NAME, "again": reverse("oidc_authentication_init")},
        status=403,
    )


def _when_enabled(view):
    def gated(request, *args, **kwargs):
        if not enabled():
            raise Http404("Single sign-on is not configured here (LIFELINE_OIDC_* unset): log in with a local account.")
        return view(request, *args, **kwargs)

    return gated


begin = _when_enabled(oidc_views.OIDCAuthenticationRequestView.as_view())  # to the provider
callback = _when_enabled(oidc_views.OIDCAuthenticationCallbackView.as_view())  # back from it


@require_POST
def logout(request):
    """Out of Lifeline; a user who signed in through the provider is also signed out there where it has an
    end-session endpoint (LIFELINE_OIDC_LOGOUT_ENDPOINT), then sent back to the login page."""
    id_token = request.session.get("oidc_id_token")
    auth.logout(request)
    back = request.build_absolute_uri(reverse(settings.LOGOUT_REDIRECT_URL))
    if enabled() and id_token and settings.LIFELINE_OIDC_LOGOUT_ENDPOINT:
        query = {"id_token_hint": id_token, "post_logout_redirect_uri": back, "client_id": settings.OIDC_RP_CLIENT_ID}
        return HttpResponseRedirect(f"{settings.LIFELINE_OIDC_LOGOUT_ENDPOINT}?{urlencode(query)}")
    return HttpResponseRedirect(back)
