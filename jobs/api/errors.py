"""One error shape for every API failure, with a stable machine-readable code.

    {"detail": "human message", "code": "stable_code",
     "errors": {"field": [{"message": "...", "code": "..."}]}}   # only for field errors

`detail` is DRF's key; `code` never changes for a given rule, so clients
branch on it rather than on the message.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import signals
from django.http import HttpResponse, JsonResponse
from django.urls import NoReverseMatch, get_resolver, get_urlconf, reverse
from django.utils.log import log_response
from django.views import defaults
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from jobs import exceptions as refusals

_STATUS_FOR = {
    refusals.UnknownTask: status.HTTP_400_BAD_REQUEST,
    refusals.UnknownQueue: status.HTTP_400_BAD_REQUEST,
    refusals.RequestInvalid: status.HTTP_400_BAD_REQUEST,
    refusals.InvalidSubmission: status.HTTP_400_BAD_REQUEST,
    refusals.PayloadTooLarge: status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
    refusals.QueueFull: status.HTTP_429_TOO_MANY_REQUESTS,
    refusals.ClientQueueFull: status.HTTP_429_TOO_MANY_REQUESTS,
    refusals.QuotaExceeded: status.HTTP_400_BAD_REQUEST,
    refusals.RateLimited: status.HTTP_429_TOO_MANY_REQUESTS,
    refusals.DebounceConflict: status.HTTP_409_CONFLICT,
    refusals.IdempotencyConflict: status.HTTP_409_CONFLICT,
    refusals.BatchInvalid: status.HTTP_400_BAD_REQUEST,
    refusals.BatchIdempotencyConflict: status.HTTP_409_CONFLICT,
    refusals.WorkflowIdempotencyConflict: status.HTTP_409_CONFLICT,
}
# DRF's own default codes renamed where the rule has a clearer name.
_RENAMED = {"parse_error": "malformed_json"}


class RequestTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "Request body too large."
    default_code = "request_too_large"


class InvalidCursor(exceptions.APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_detail = "Invalid cursor: use the `next` or `previous` link of a page as given."
    default_code = "invalid_cursor"


class Conflict(exceptions.APIException):
    """409; `extra` is merged into the error body (e.g. the job's current status)."""

    status_code = status.HTTP_409_CONFLICT
    default_detail = "Conflict."
    default_code = "conflict"

    def __init__(
        self, detail: str | None = None, code: str | None = None, extra: dict | None = None
    ) -> None:
        super().__init__(detail, code)
        self.extra = extra or {}


def _field_errors(detail: Any) -> dict[str, list[dict[str, str]]]:
    """DRF's nested ValidationError detail → {field: [{message, code}]}."""
    if isinstance(detail, list):
        detail = {"non_field_errors": detail}
    out: dict[str, list[dict[str, str]]] = {}
    for field, errs in detail.items():
        if isinstance(errs, dict):  # nested serializer: flatten as field.sub
            for sub, items in _field_errors(errs).items():
                out[f"{field}.{sub}"] = items
            continue
        if not isinstance(errs, list):
            errs = [errs]
        out[field] = [{"message": str(e), "code": getattr(e, "code", "invalid")} for e in errs]
    return out


def error_body(
    detail: str, code: str, errors: dict[str, list[dict[str, str]]] | None = None, **more: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"detail": detail, "code": code}
    if errors:
        body["errors"] = errors
    body.update(more)
    return body


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF exception handler producing the shape above (set per view in jobs.api.views)."""
    if isinstance(exc, refusals.SubmissionError):
        code = exc.code
        errors = {exc.field: [{"message": exc.message, "code": code}]} if exc.field else None
        if isinstance(
            exc,
            refusals.BatchInvalid | refusals.BatchIdempotencyConflict | refusals.RequestInvalid,
        ):
            errors = exc.errors
        more: dict[str, Any] = {}
        headers: dict[str, str] = {}
        if isinstance(exc, refusals.IdempotencyConflict):
            more["job_id"] = exc.job.pk
        if isinstance(exc, refusals.WorkflowIdempotencyConflict):
            more["workflow_id"] = exc.workflow_id
        if isinstance(exc, refusals.BatchIdempotencyConflict):
            more["job_ids"] = {str(n): job_id for n, job_id in exc.conflicts.items()}
        if isinstance(exc, refusals.QueueFull | refusals.RateLimited):
            headers["Retry-After"] = str(exc.retry_after)
        if isinstance(exc, refusals.RateLimited):
            more["retry_after"] = exc.retry_after
        if isinstance(exc, refusals.DebounceConflict):
            more["job_id"] = exc.job_id
        return Response(
            error_body(exc.message, code, errors, **more),
            status=_STATUS_FOR.get(type(exc), status.HTTP_400_BAD_REQUEST),
            headers=headers,
        )

    response = drf_exception_handler(exc, context)
    if response is None:
        return unexpected_error(exc, context["request"])
    if isinstance(exc, exceptions.ValidationError):
        errors = _field_errors(exc.detail)
        codes = {e["code"] for items in errors.values() for e in items}
        # One rule broken → its code at the top; several → the generic "invalid".
        code = codes.pop() if len(codes) == 1 else "invalid"
        response.data = error_body(refusals.first_message(errors), code, errors)
        return response
    if isinstance(exc, exceptions.APIException):
        detail = exc.detail
        code = getattr(detail, "code", None) or exc.default_code
        code = _RENAMED.get(code, code)
        message = str(detail) if not isinstance(detail, list | dict) else str(exc.default_detail)
        more = {}
        if isinstance(exc, exceptions.Throttled) and exc.wait is not None:
            more["retry_after"] = int(exc.wait) + 1
        more.update(getattr(exc, "extra", {}))
        response.data = error_body(message, code, **more)
    elif response.status_code == status.HTTP_404_NOT_FOUND:
        response.data = error_body("Not found.", "not_found")
    elif response.status_code == status.HTTP_403_FORBIDDEN:
        response.data = error_body("Permission denied.", "permission_denied")
    return response


def unexpected_error(exc: Exception, request: Any) -> Response | None:
    """A bug in an API view. Where Django's own 500 path already ends in this shape (the
    root URLconf's handler500 is ours and the path is under /api/), or DEBUG wants its
    traceback page, it is left to Django (None). Elsewhere (the API included under another
    prefix of a project with its own handler500) the same steps are taken here, the
    got_request_exception signal and the django.request error log with the traceback,
    and the answer is JSON."""
    django_request = getattr(request, "_request", request)
    if settings.DEBUG or settings.DEBUG_PROPAGATE_EXCEPTIONS:
        return None
    if _is_api(django_request) and _root_handler500() is handler500:
        return None
    signals.got_request_exception.send(sender=None, request=django_request)
    response = Response(
        error_body("Internal server error.", "server_error"),
        status=status.HTTP_500_INTERNAL_SERVER_ERROR,
    )
    log_response(
        "%s: %s",
        "Internal Server Error",
        django_request.path,
        response=response,
        request=django_request,
        exception=exc,
    )
    return response


def _root_handler500() -> Any:
    return get_resolver(get_urlconf()).resolve_error_handler(500)


# --- responses Django makes itself, for paths under /api/ ----------------------------


def _is_api(request: Any) -> bool:
    return request.path.startswith("/api/")


@csrf_exempt  # token-authenticated API: a POST to a miss is a 404, not a CSRF 403 page
def api_not_found(request: Any, *args: Any, **kwargs: Any) -> JsonResponse:
    """Catch-all for API paths no route matches (the last route of jobs.api.urls, so
    under whatever prefix the API is included, and the deployment's /api/): a JSON 404,
    never Django's HTML page, with DEBUG on or off."""
    try:
        schema = reverse("api-schema")
    except NoReverseMatch:  # included under a namespace: the hint goes, the 404 stays
        schema = "the API's schema/"
    return JsonResponse(
        error_body(
            f"No API endpoint at {request.path!r} (API paths end with a slash; see {schema}).",
            "not_found",
        ),
        status=status.HTTP_404_NOT_FOUND,
    )


def handler404(request: Any, exception: Exception) -> HttpResponse:
    if _is_api(request):
        return api_not_found(request)
    return defaults.page_not_found(request, exception)


def handler500(request: Any) -> HttpResponse:
    """An unexpected error: under /api/ the same shape as every other error, no details."""
    if _is_api(request):
        return JsonResponse(
            error_body("Internal server error.", "server_error"),
            status=status.HTTP_500_INTERNAL_SERVER_ERROR,
        )
    return defaults.server_error(request)
