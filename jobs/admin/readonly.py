"""Permissions of the admin pages that show rows only the services write."""

from __future__ import annotations


class WrittenByServices:
    """Rows only the services write: no add, change or delete in the admin."""

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class SeenWithJobs:
    """Parts of a job (history, steps, signals): whoever may view jobs may view them."""

    def has_view_permission(self, request, obj=None) -> bool:
        return request.user.has_perm("jobs.view_job")
