"""The staff console: ModelAdmins (`options`), staff actions (`actions`), list filters,
the capped-count paginator, the dashboard and the display helpers, registered here."""

from django.contrib import admin

from jobs.admin.archive import ArchivedPeriodAdmin
from jobs.admin.flow import BatchAdmin, SequenceAdmin
from jobs.admin.options import ClientAdmin, JobAdmin
from jobs.admin.queues import QueueAdmin
from jobs.admin.schedules import ScheduleAdmin
from jobs.admin.webhooks import WebhookAdmin, WebhookDeliveryAdmin
from jobs.admin.workflows import WorkflowAdmin
from jobs.models import (
    ArchivedPeriod,
    Batch,
    Client,
    Job,
    Queue,
    Schedule,
    Sequence,
    Webhook,
    WebhookDelivery,
    Workflow,
)

admin.site.register(Job, JobAdmin)
admin.site.register(Client, ClientAdmin)
admin.site.register(Queue, QueueAdmin)
admin.site.register(Schedule, ScheduleAdmin)
admin.site.register(Workflow, WorkflowAdmin)
admin.site.register(Webhook, WebhookAdmin)
admin.site.register(WebhookDelivery, WebhookDeliveryAdmin)
admin.site.register(ArchivedPeriod, ArchivedPeriodAdmin)
admin.site.register(Sequence, SequenceAdmin)
admin.site.register(Batch, BatchAdmin)
