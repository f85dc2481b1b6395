"""The staff console: ModelAdmins (`options`), staff actions (`actions`), list filters,
the capped-count paginator, the dashboard and the display helpers, registered here."""

from django.contrib import admin

from jobs.admin.options import ClientAdmin, JobAdmin
from jobs.admin.webhooks import WebhookAdmin, WebhookDeliveryAdmin
from jobs.models import Client, Job, Webhook, WebhookDelivery

admin.site.register(Job, JobAdmin)
admin.site.register(Client, ClientAdmin)
admin.site.register(Webhook, WebhookAdmin)
admin.site.register(WebhookDelivery, WebhookDeliveryAdmin)
