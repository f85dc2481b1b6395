"""Factories that build jobs through the services, so every row went through
legal transitions (the database guard allows nothing else)."""

from __future__ import annotations

from typing import Any

import factory
from django.db import connection

from jobs import services
from jobs.models import Client, Job


def raw(sql: str, params: Any = None) -> list[tuple]:
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall() if cur.description else []


class ClientFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Client

    name = factory.Sequence(lambda n: f"client-{n}")
    token_hash = factory.Sequence(lambda n: Client.hash_token(f"token-{n}"))


class JobFactory(factory.Factory):
    """A queued job; pass status= to walk it there through the services."""

    class Meta:
        model = Job

    task = "echo"
    payload = factory.LazyFunction(dict)
    queue = "default"
    priority = 0
    max_retries = 3

    @classmethod
    def _create(
        cls, model_class, status: str = "queued", worker: str = "w-factory", **kwargs
    ) -> Job:
        job, _ = services.submit(**kwargs)
        if status == "queued":
            pass
        elif status == "enqueue_failed":
            services.mark_enqueue_failed([job.pk])
        elif status == "processing":
            assert services.claim(worker, job.pk)
        elif status == "done":
            lease = services.claim(worker, job.pk)
            services.complete([(lease, {"ok": True})])
        elif status == "failed":
            lease = services.claim(worker, job.pk)
            services.fail([(lease, "boom", True)])
        else:
            raise ValueError(status)
        return Job.objects.get(pk=job.pk)

    @classmethod
    def _build(cls, model_class, **kwargs):
        raise NotImplementedError("jobs exist only in the database; use create()")
