"""Run the test identity provider: `python -m tests.oidc_provider.serve --data DIR --port N --client-id … …`.

Makes its signing key and database in DIR, its users and groups (--user name:password:group,group), the console as
a confidential client with its redirect URIs, then serves on 127.0.0.1:N and prints "ready <issuer>"."""

import argparse
import os
import sys
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server


class Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class Quiet(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the standard library's name
        print("provider:", format % args, file=sys.stderr, flush=True)


def signing_key(path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.write_bytes(pem)


def setup(args) -> None:
    from django.contrib.auth.models import Group, User
    from django.core.management import call_command
    from oauth2_provider.models import Application

    call_command("migrate", verbosity=0)
    for spec in args.user:
        name, password, groups = spec.split(":", 2)
        user = User.objects.create_user(name, email=f"{name}@example.com", password=password, first_name=name.title())
        user.groups.set([Group.objects.get_or_create(name=g)[0] for g in groups.split(",") if g])
    Application.objects.create(
        name="Lifeline",
        client_id=args.client_id,
        client_secret=args.client_secret,
        client_type=Application.CLIENT_CONFIDENTIAL,
        authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
        redirect_uris=args.redirect_uri,
        post_logout_redirect_uris=args.logout_redirect_uri,
        algorithm=Application.RS256_ALGORITHM,
        skip_authorization=True,  # the company's own console: no consent screen
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--client-id", required=True)
    parser.add_argument("--client-secret", required=True)
    parser.add_argument("--redirect-uri", required=True)
    parser.add_argument("--logout-redirect-uri", required=True)
    parser.add_argument("--user", action="append", default=[], help="name:password:group,group")
    args = parser.parse_args()
    args.data.mkdir(parents=True, exist_ok=True)
    signing_key(args.data / "signing-key.pem")
    os.environ["OIDC_PROVIDER_DATA"] = str(args.data)
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.oidc_provider.settings"
    import django

    django.setup()
    setup(args)
    from django.core.wsgi import get_wsgi_application

    server = make_server("127.0.0.1", args.port, get_wsgi_application(), server_class=Server, handler_class=Quiet)
    print(f"ready http://127.0.0.1:{args.port}/o", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
