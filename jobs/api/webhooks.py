"""Webhooks API (issue 16): a client's endpoints for its jobs' lifecycle events, and their
deliveries. Another client's webhook is a 404; a refused request writes nothing (400).
The signing secret is in the answer to a create or a rotation, and nowhere else."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models.functions import Now
from drf_spectacular.utils import OpenApiParameter, extend_schema_field
from rest_framework import exceptions, serializers, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from jobs import admission, selectors, services
from jobs.api.errors import Conflict, exception_handler
from jobs.api.parsers import BoundedJSONParser
from jobs.api.policy import APIPolicy
from jobs.api.schema import extend_schema
from jobs.api.views import IdCursorPagination, error_responses
from jobs.events import circuit, signing, ssrf
from jobs.lifecycle import Status
from jobs.models import CircuitState, Webhook, WebhookDelivery

EVENT_CHOICES = [*signing.event_types(), signing.ALL_EVENTS]
# A delivery's status is its job's: done = delivered, failed = a dead letter.
DELIVERY_STATUS = {Status.DONE.value: "delivered", Status.FAILED.value: Status.FAILED.value}
DELIVERY_STATUSES = ["pending", "delivered", Status.FAILED.value]


class CircuitSerializer(serializers.Serializer):
    state = serializers.ChoiceField(choices=CircuitState.choices)
    failures = serializers.IntegerField()
    open_until = serializers.DateTimeField(allow_null=True)


class WebhookSerializer(serializers.ModelSerializer):
    url = serializers.CharField(
        max_length=2000,
        help_text="https in production; never a loopback, private, link-local or metadata "
        "address unless JOBS_WEBHOOK_ALLOW_PRIVATE=1 (checked again at every delivery).",
    )
    events = serializers.ListField(
        child=serializers.ChoiceField(choices=EVENT_CHOICES),
        min_length=1,
        max_length=len(EVENT_CHOICES),
        help_text='Event types to send, or ["*"] for every one.',
    )
    enabled = serializers.BooleanField(required=False, default=True)
    disabled_reason = serializers.CharField(
        read_only=True, help_text="Why delivery stopped (e.g. the receiver answered 410)."
    )

    circuit = serializers.SerializerMethodField(
        help_text="The endpoint's circuit breaker: `state` closed (deliveries go out), open "
        "(deliveries wait until `open_until` without a call or a retry spent) or half_open "
        "(the next or current attempt is a probe); `failures`: failed attempts in a row."
    )

    class Meta:
        model = Webhook
        fields = ["id", "url", "events", "enabled", "disabled_reason", "circuit", "created_at",
                  "updated_at"]  # fmt: skip
        read_only_fields = ["id", "created_at", "updated_at"]

    @extend_schema_field(CircuitSerializer)
    def get_circuit(self, hook: Webhook) -> dict[str, Any]:
        return circuit.describe(hook)

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - {"url", "events", "enabled"})
            if unknown:
                raise exceptions.ValidationError(
                    {name[:100]: ["Unknown field."] for name in unknown}, code="unknown_field"
                )
        return super().to_internal_value(data)

    def validate_url(self, value: str) -> str:
        try:
            ssrf.check(value)
        except ssrf.UnsafeURL as exc:
            raise serializers.ValidationError(str(exc), code="unsafe_url") from None
        return value

    def validate_events(self, value: list[str]) -> list[str]:
        return sorted(set(value))


class WebhookWithSecretSerializer(WebhookSerializer):
    secret = serializers.CharField(
        read_only=True, help_text="whsec_…: shown on create and rotation only; keep it."
    )

    class Meta(WebhookSerializer.Meta):
        fields = [*WebhookSerializer.Meta.fields, "secret"]


class DeliverySerializer(serializers.ModelSerializer):
    message_id = serializers.SerializerMethodField(help_text="The webhook-id header.")
    status = serializers.SerializerMethodField(help_text="pending, delivered or failed.")
    job_id = serializers.IntegerField(
        read_only=True, allow_null=True, help_text="The delivery job (null: waiting)."
    )
    error = serializers.SerializerMethodField()

    class Meta:
        model = WebhookDelivery
        fields = ["id", "message_id", "type", "source_job_id", "seq", "status", "attempts",
                  "last_status_code", "last_attempt_at", "error", "job_id",
                  "created_at"]  # fmt: skip

    def get_message_id(self, d: WebhookDelivery) -> str:
        return signing.message_id(d.event_id)

    def get_status(self, d: WebhookDelivery) -> str:
        return DELIVERY_STATUS.get(d.job.status, "pending") if d.job_id and d.job else "pending"

    def get_error(self, d: WebhookDelivery) -> str | None:
        return (d.job.error if d.job_id and d.job else None) or d.last_error or None


class DeliveryPagination(IdCursorPagination):
    ordering = ("-id",)


_errors = error_responses({
    404: "No such webhook (or delivery) for this client.",
    409: "The delivery is not a dead letter (see `status`).",
})  # fmt: skip


class WebhookViewSet(APIPolicy, viewsets.GenericViewSet):
    serializer_class = WebhookSerializer
    parser_classes = [BoundedJSONParser]
    pagination_class = None

    def get_exception_handler(self) -> Any:
        return exception_handler

    def get_queryset(self) -> Any:
        if getattr(self, "swagger_fake_view", False):
            return Webhook.objects.none()
        return Webhook.objects.filter(client=self.request.user).order_by("id")

    def _with_secret(self, hook: Webhook) -> dict:
        return {**WebhookSerializer(hook).data, "secret": signing.secret_for(hook.secret_salt)}

    @extend_schema(summary="The client's webhooks", responses={200: WebhookSerializer(many=True),
                                                               **_errors(401)})  # fmt: skip
    def list(self, request: Request) -> Response:
        return Response(WebhookSerializer(self.get_queryset(), many=True).data)

    @extend_schema(
        summary="Register a webhook",
        description="Answers the signing secret (`whsec_…`) once. Deliveries are signed per "
        "Standard Webhooks (`webhook-id`, `webhook-timestamp`, `webhook-signature`).",
        request=WebhookSerializer,
        responses={201: WebhookWithSecretSerializer, **_errors(400, 401, 413, 415)},
    )
    def create(self, request: Request) -> Response:
        ser = WebhookSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        with transaction.atomic(durable=True):
            admission.check_quota(admission.WEBHOOKS, request.user.pk)
            hook = Webhook.objects.create(
                client=request.user,
                secret_salt=signing.new_salt(),
                after_event_id=selectors.last_drawn_id(),  # its events start after it (D194)
                **ser.validated_data,
            )
        return Response(self._with_secret(hook), status=status.HTTP_201_CREATED)

    @extend_schema(summary="A webhook", responses={200: WebhookSerializer, **_errors(401, 404)})
    def retrieve(self, request: Request, pk: int) -> Response:
        return Response(WebhookSerializer(self.get_object()).data)

    @extend_schema(
        summary="Change a webhook",
        description="Any of `url`, `events`, `enabled`. Enabling clears `disabled_reason`.",
        request=WebhookSerializer(partial=True),
        responses={200: WebhookSerializer, **_errors(400, 401, 404, 413, 415)},
    )
    def partial_update(self, request: Request, pk: int) -> Response:
        hook = self.get_object()
        ser = WebhookSerializer(hook, data=request.data, partial=True)
        ser.is_valid(raise_exception=True)
        fields = dict(ser.validated_data)
        if fields.get("enabled"):
            fields["disabled_reason"] = ""
        Webhook.objects.filter(pk=hook.pk).update(**fields, updated_at=Now())
        hook.refresh_from_db()
        return Response(WebhookSerializer(hook).data)

    @extend_schema(summary="Delete a webhook", responses={204: None, **_errors(401, 404)})
    def destroy(self, request: Request, pk: int) -> Response:
        self.get_object().delete()
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(
        summary="Rotate a webhook's signing secret",
        description="The old secret stops signing at once; the new one is in the answer only.",
        request=None,
        responses={200: WebhookWithSecretSerializer, **_errors(401, 404)},
    )
    def rotate_secret(self, request: Request, pk: int) -> Response:
        hook = self.get_object()
        hook.secret_salt = signing.new_salt()
        hook.save(update_fields=["secret_salt"])
        return Response(self._with_secret(hook))


class DeliveryViewSet(APIPolicy, viewsets.GenericViewSet):
    """A webhook's deliveries, newest first; `?status=failed` lists the dead letters."""

    serializer_class = DeliverySerializer
    pagination_class = DeliveryPagination
    parser_classes = [BoundedJSONParser]
    filter_backends: list[Any] = []

    def get_exception_handler(self) -> Any:
        return exception_handler

    def get_queryset(self) -> Any:
        if getattr(self, "swagger_fake_view", False):
            return WebhookDelivery.objects.none()
        hook = Webhook.objects.filter(pk=self.kwargs["webhook_pk"], client=self.request.user)
        if not hook.exists():
            raise exceptions.NotFound()
        return WebhookDelivery.objects.filter(webhook_id=self.kwargs["webhook_pk"]).select_related(
            "job"
        )

    @extend_schema(
        summary="A webhook's deliveries, newest first",
        parameters=[
            OpenApiParameter(
                "status",
                str,
                enum=DELIVERY_STATUSES,
                required=False,
                description="failed: the dead letters (budget spent).",
            ),
        ],  # fmt: skip
        responses={200: DeliverySerializer(many=True), **_errors(400, 401, 404)},
    )
    def list(self, request: Request, webhook_pk: int) -> Response:
        unknown = sorted(set(request.query_params) - {"status", "cursor", "page_size"})
        wanted = request.query_params.get("status")
        if unknown or (wanted is not None and wanted not in DELIVERY_STATUSES):
            raise exceptions.ValidationError(
                {
                    "status" if not unknown else unknown[0][:100]: [
                        f"Accepted: status ({', '.join(DELIVERY_STATUSES)}), cursor, page_size."
                    ]
                }  # fmt: skip
            )
        qs = self.get_queryset()
        if wanted == "delivered":
            qs = qs.filter(job__status=Status.DONE)
        elif wanted == Status.FAILED:
            qs = qs.filter(job__status=Status.FAILED)
        elif wanted == "pending":
            qs = qs.exclude(job__status__in=[Status.DONE, Status.FAILED])
        page = self.paginate_queryset(qs)
        return self.get_paginated_response(DeliverySerializer(page, many=True).data)

    @extend_schema(
        summary="Redeliver a dead letter",
        description="failed → a new attempt with a fresh retry budget (the same message id).",
        request=None,
        responses={200: DeliverySerializer, **_errors(401, 404, 409)},
    )
    def redeliver(self, request: Request, webhook_pk: int, pk: int) -> Response:
        delivery = self.get_queryset().filter(pk=pk).first()
        if delivery is None:
            raise exceptions.NotFound()
        with transaction.atomic(durable=True):
            retried = services.staff_retry(
                [delivery.job_id] if delivery.job_id else [], actor=f"client:{request.user.name}"
            )
        delivery = self.get_queryset().get(pk=pk)
        if not retried:
            raise Conflict(
                f"delivery {pk} is not a dead letter",
                code="not_failed",
                extra={"status": DeliverySerializer(delivery).data["status"]},
            )
        return Response(DeliverySerializer(delivery).data)
