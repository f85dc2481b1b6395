"""Traces, error reports and log fields of the job pipeline (docs/observability.md):
`hooks` (what the pipeline calls), `tracing` (OpenTelemetry), `errors` (Sentry), `logs`
(the logging filter). Importing the package imports nothing of the app, so a logging
configuration may name `jobs.observability.logs` before Django's apps are loaded."""
