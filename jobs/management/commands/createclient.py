"""`manage.py createclient NAME`: a new API client; its token is the last line printed."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import IntegrityError, transaction

from jobs.models import Client


class Command(BaseCommand):
    help = "Create an API client and print its token (shown once; only its hash is stored)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="Unique client name, 1-100 characters.")

    def handle(self, *args: Any, name: str, **options: Any) -> None:
        name = name.strip()
        max_len = Client._meta.get_field("name").max_length
        if not name or len(name) > max_len:
            raise CommandError(f"client name must be 1-{max_len} characters")
        if Client.objects.filter(name=name).exists():
            raise CommandError(f"a client named {name!r} already exists")
        try:
            with transaction.atomic():
                client, token = Client.create_with_token(name)
        except IntegrityError as exc:  # created concurrently under the same name
            raise CommandError(f"a client named {name!r} already exists") from exc
        self.stdout.write(f"Created client {client.name!r} (id {client.pk}).")
        self.stdout.write("Its token, shown only now (send it as 'Authorization: Token <token>'):")
        self.stdout.write(token)
