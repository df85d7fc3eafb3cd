"""A real OpenID Connect provider for the single sign-on test: django-oauth-toolkit's, in a small Django project of
its own, run as its own process (serve.py)."""
