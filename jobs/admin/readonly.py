"""Permissions of the admin pages that show rows only the services write."""

from __future__ import annotations

from jobs import replica


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


class ListsFromReplica:
    """The list page reads the replica when one is usable (D147): rendered inside the
    block, since the page's querysets run while the template renders. Its actions
    (POST) and every other page stay on the primary."""

    def changelist_view(self, request, extra_context=None):
        if request.method != "GET":
            return super().changelist_view(request, extra_context)
        with replica.reads():
            response = super().changelist_view(request, extra_context)
            if hasattr(response, "render"):
                response.render()
            return response
