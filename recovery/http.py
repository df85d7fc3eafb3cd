"""Small helpers shared by the JSON endpoints of the control plane and the console."""

import json

from django.http import JsonResponse


def bearer_token(request) -> str | None:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def json_error(status: int, message: str, **extra) -> JsonResponse:
    """An error body that says what was wrong and what to do."""
    return JsonResponse({"error": {"status": status, "message": message, **extra}}, status=status)


def json_object(request, shape: str = "") -> dict | JsonResponse:
    """The request's JSON object (none sent: empty), or the 400 that names the body; `shape` shows what it holds."""
    try:
        body = json.loads(request.body or b"{}")
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past reading
        return json_error(400, "The body is not valid JSON.", field="body")
    if not isinstance(body, dict):
        return json_error(400, f"The body must be a JSON object{': ' + shape if shape else ''}.", field="body")
    return body


def patch_body(request) -> tuple[dict, str] | JsonResponse:
    """A PATCH body `{field: value, ..., "reason": ...}`: the fields and the reason, or the 400 that says what was
    wrong with it."""
    body = json_object(request, '{field: value, ..., "reason": ...}')
    if isinstance(body, JsonResponse):
        return body
    return body, str(body.pop("reason", ""))
