"""Completion events and the outbox (docs/events.md): the webhooks a client registered,
one event's delivery to one of them, how far each outbox subscriber got, and the
application's own events. Written by the outbox's subscribers and `jobs.events.publish`,
read by the dispatcher and the delivery workers, apart from the job's own writes."""

from __future__ import annotations

from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from jobs.models.jobs import Client, Job


class CircuitState(models.TextChoices):
    """A webhook endpoint's circuit breaker (jobs.events.circuit)."""

    CLOSED = "closed"  # deliveries go out
    OPEN = "open"  # deferred without a network attempt until circuit_open_until
    HALF_OPEN = "half_open"  # one probe delivery is out; the rest wait for its answer


class Webhook(models.Model):
    """A client's endpoint for its jobs' lifecycle events. The signing secret is not
    stored: it is derived from `secret_salt` and JOBS_WEBHOOK_KEY (jobs.events.signing),
    so a read of this table alone cannot forge a signature."""

    # webhook_client_idx leads with it (D406).
    client = models.ForeignKey(Client, on_delete=models.CASCADE, related_name="webhooks",
                               db_index=False)  # fmt: skip
    url = models.URLField(max_length=2000)
    events = ArrayField(models.CharField(max_length=40))
    enabled = models.BooleanField(default=True)
    secret_salt = models.CharField(max_length=64)
    disabled_reason = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())
    # Ids, not times: an event whose id was drawn before the webhook was created is not
    # its to receive, every later one is (D194).
    after_event_id = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="The last history id drawn when it was created: it gets the events after "
        "it (empty: created before this was noted, every event the outbox dispatches).",
    )
    # The circuit breaker, written by delivery attempts under their job's fence.
    circuit_state = models.CharField(
        max_length=10, choices=CircuitState.choices, db_default=CircuitState.CLOSED
    )
    circuit_failures = models.IntegerField(
        db_default=0, help_text="Failed attempts in a row (reset by an answer)."
    )
    circuit_open_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Open: deliveries wait until then; half open: the probe's deadline.",
    )

    class Meta:
        db_table = "jobs_webhook"
        ordering = ["id"]
        indexes = [models.Index(name="webhook_client_idx", fields=["client", "id"])]
        constraints = [
            models.CheckConstraint(name="webhook_has_events", condition=~Q(events=[])),
            models.CheckConstraint(
                name="webhook_circuit_state_valid",
                condition=Q(circuit_state__in=CircuitState.values),
            ),
        ]

    def __str__(self) -> str:
        return f"webhook {self.id} {self.url}"


class WebhookDelivery(models.Model):
    """One event for one webhook. `job` is the delivery job (its status is the
    delivery's: done = delivered, failed = dead letter); NULL while the delivery
    waits for an earlier event of the same job to the same endpoint (seq order)."""

    id = models.BigAutoField(primary_key=True)
    # Indexed by delivery_once_per_event and delivery_chain_idx, which lead with it (D406).
    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries",
                                db_index=False)  # fmt: skip
    event_id = models.BigIntegerField(help_text="The jobs_jobevent row (the message id).")
    source_job_id = models.BigIntegerField()
    seq = models.IntegerField()
    type = models.CharField(max_length=40)
    body = models.TextField(help_text="The signed JSON, the same on every attempt.")
    job = models.OneToOneField(
        Job,
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="webhook_delivery",
    )
    attempts = models.IntegerField(default=0)
    last_status_code = models.IntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True, default="")
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "jobs_webhookdelivery"
        ordering = ["-id"]
        verbose_name_plural = "webhook deliveries"
        permissions = [("redeliver_webhookdelivery", "Can redeliver failed webhook deliveries")]
        constraints = [
            models.UniqueConstraint(name="delivery_once_per_event", fields=["webhook", "event_id"]),
        ]
        indexes = [
            models.Index(name="delivery_chain_idx", fields=["webhook", "source_job_id", "seq"]),
            # Waiting deliveries only: what a full webhooks queue held back (D110).
            models.Index(
                name="delivery_waiting_idx",
                fields=["webhook", "source_job_id", "seq", "id"],
                condition=models.Q(job__isnull=True),
            ),
        ]

    def __str__(self) -> str:
        return f"delivery {self.id}: {self.type} of job {self.source_job_id} (seq {self.seq})"


class OutboxCursor(models.Model):
    """How far one outbox subscriber got, moved in the transaction of its work.

    `last_id` is the last history row handled. Ids are taken before their
    transactions commit, so rows past `horizon_id` may still appear: the
    dispatcher reads only up to a horizon whose snapshot's in-progress
    transactions have all ended (jobs.events.outbox)."""

    name = models.CharField(max_length=50, primary_key=True)
    last_id = models.BigIntegerField(default=0)
    horizon_id = models.BigIntegerField(null=True, blank=True)
    horizon_snapshot = models.TextField(null=True, blank=True)
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "jobs_outboxcursor"

    def __str__(self) -> str:
        return f"{self.name} at {self.last_id}"


class DomainEvent(models.Model):
    """An application event written by `jobs.events.publish` in the caller's
    transaction; each subscriber got its job in the same transaction."""

    id = models.BigAutoField(primary_key=True)
    type = models.CharField(max_length=200)
    payload = models.JSONField(default=dict)
    at = models.DateTimeField(db_default=Now())
    # The Kafka message key its publisher chose (None: the event id).
    key = models.CharField(max_length=255, null=True, blank=True)

    class Meta:
        db_table = "jobs_domainevent"
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.type} {self.id}"
