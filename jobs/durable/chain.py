"""Continue-as-new (D315): a long-lived durable job ends its run and starts the next
with an empty history, so no run's history grows past JOBS_MAX_STEPS. Each run is a
job of its own (done with a link to the next); the runs share `chain_id`."""

from __future__ import annotations

from typing import Any

from jobs import selectors
from jobs.durable.errors import ContinueAsNew, StepError, to_json

SAME_PAYLOAD: Any = object()


class Chain:
    """continue_as_new, mixed into DurableContext."""

    def _in_workflow(self) -> bool:
        return selectors.in_workflow(self.job_id)

    def continue_as_new(self, payload: Any = SAME_PAYLOAD) -> None:
        """End this run and start the next run of the job with an empty history and
        `payload` (default: this run's own). Never returns: the attempt ends, and the
        switch is one fenced transaction (jobs.services.continue_as_new)."""
        if not self.durable:
            raise StepError("continue_as_new needs a task registered durable=True")
        text = None if payload is SAME_PAYLOAD else to_json("continue_as_new payload", payload)
        if self._in_workflow():
            raise StepError("continue_as_new is not for a workflow step: its children wait on it")
        raise ContinueAsNew(text)
