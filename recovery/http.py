"""Small helpers shared by the JSON endpoints of the control plane and the console."""

from django.http import JsonResponse


def bearer_token(request) -> str | None:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def json_error(status: int, message: str, **extra) -> JsonResponse:
    """An error body that says what was wrong and what to do."""
    return JsonResponse({"error": {"status": status, "message": message, **extra}}, status=status)
