"""Periodic jobs without a leader (docs/schedules.md): every runreaper fires due slots,
and a slot makes its job only through the scheduler_runs row it inserts first."""
