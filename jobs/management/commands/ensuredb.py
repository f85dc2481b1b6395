"""manage.py ensuredb — create the database DATABASE_URL names when it is missing.

For development: `make migrate` and `make run` call it, so pointing DATABASE_URL at a
new name on an existing server just works. It connects to the server's `postgres`
maintenance database (as Django's test runner does) and never touches an existing one.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, connections
from psycopg import errors, sql


class Command(BaseCommand):
    help = "Create the database named by DATABASE_URL if it does not exist yet."

    def add_arguments(self, parser):
        parser.add_argument(
            "--database", default=DEFAULT_DB_ALIAS, help="Database alias [%(default)s]."
        )

    def handle(self, *args, **opts):
        connection = connections[opts["database"]]
        name = connection.settings_dict["NAME"]
        if not name:
            raise CommandError("the database settings name no database")
        # Django's own way to reach the server without the target database.
        with connection._nodb_cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name])
            if cursor.fetchone():
                self.stdout.write(f"database {name} exists")
                return
            try:
                cursor.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            except errors.DuplicateDatabase:  # created meanwhile by another process
                self.stdout.write(f"database {name} exists")
                return
        self.stdout.write(f"database {name} created")
