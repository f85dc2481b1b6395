"""The OpenAPI document is valid, public, and every operation in it is exercised by a test."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from openapi_spec_validator import validate

from tests.api.conftest import API_DIR, DESELECTED_API_TESTS, EXERCISED, route_template

EXPECTED_OPERATIONS = {
    ("GET", "/api/v1/jobs/"),
    ("POST", "/api/v1/jobs/"),
    ("POST", "/api/v1/jobs/batch/"),
    ("GET", "/api/v1/jobs/{id}/"),
    ("POST", "/api/v1/jobs/{id}/cancel/"),
    ("GET", "/api/v1/jobs/{id}/history/"),
    ("GET", "/api/v1/schedules/"),
    ("POST", "/api/v1/schedules/"),
    ("GET", "/api/v1/schedules/{id}/"),
    ("PATCH", "/api/v1/schedules/{id}/"),
    ("DELETE", "/api/v1/schedules/{id}/"),
    ("POST", "/api/v1/jobs/{id}/signal/"),
    ("POST", "/api/v1/workflows/"),
    ("GET", "/api/v1/workflows/{id}/"),
    ("POST", "/api/v1/workflows/{id}/cancel/"),
    ("GET", "/api/v1/webhooks/"),
    ("POST", "/api/v1/webhooks/"),
    ("GET", "/api/v1/webhooks/{id}/"),
    ("PATCH", "/api/v1/webhooks/{id}/"),
    ("DELETE", "/api/v1/webhooks/{id}/"),
    ("POST", "/api/v1/webhooks/{id}/rotate-secret/"),
    ("GET", "/api/v1/webhooks/{webhook_pk}/deliveries/"),
    ("POST", "/api/v1/webhooks/{webhook_pk}/deliveries/{id}/redeliver/"),
    ("POST", "/api/v1/batches/"),
    ("GET", "/api/v1/batches/{id}/"),
    ("GET", "/api/v1/sequences/"),
    ("POST", "/api/v1/sequences/resume/"),
    ("POST", "/api/v1/sequences/skip/"),
}
HTTP_METHODS = {"get", "put", "post", "delete", "patch", "options", "head", "trace"}


def fetch_schema(anon) -> dict:
    r = anon.get("/api/v1/schema/")
    assert r.status_code == 200
    return yaml.safe_load(r.content)


def operations(schema: dict) -> set[tuple[str, str]]:
    return {
        (method.upper(), path)
        for path, item in schema["paths"].items()
        for method in item
        if method in HTTP_METHODS
    }


def test_schema_is_public_and_valid_openapi_3(anon):
    schema = fetch_schema(anon)
    assert schema["openapi"].startswith("3.")
    validate(schema)
    r = anon.get("/api/v1/schema/?format=json")
    assert r.status_code == 200 and r.json()["paths"] == schema["paths"]


def test_schema_describes_the_api(anon):
    schema = fetch_schema(anon)
    assert operations(schema) == EXPECTED_OPERATIONS
    batch = schema["paths"]["/api/v1/jobs/batch/"]["post"]
    assert {"200", "201", "400", "401", "409", "413", "429"} <= set(batch["responses"])
    post = schema["paths"]["/api/v1/jobs/"]["post"]
    assert {p["name"] for p in post["parameters"]} == {"Idempotency-Key"}
    assert {"200", "201", "400", "401", "409", "413", "429"} <= set(post["responses"])
    assert schema["components"]["securitySchemes"]["ClientToken"]["name"] == "Authorization"
    history = schema["paths"]["/api/v1/jobs/{id}/history/"]["get"]
    assert {p["name"] for p in history["parameters"]} == {"id", "cursor", "page_size"}
    page = history["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert page == "#/components/schemas/PaginatedJobEventList"
    event = schema["components"]["schemas"]["JobEvent"]["properties"]
    assert "actor" not in event
    assert event["role"]["allOf"] == [{"$ref": "#/components/schemas/RoleEnum"}]
    roles = schema["components"]["schemas"]["RoleEnum"]["enum"]
    assert roles == ["worker", "reaper", "staff", "client", "api"]
    submit = schema["components"]["schemas"]["JobSubmit"]
    assert submit["properties"]["priority"]["maximum"] == 100
    assert submit["required"] == ["payload", "task"]
    assert "unique_key" in submit["properties"]
    answer = post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert answer == "#/components/schemas/SubmittedJob"
    assert "duplicate" in schema["components"]["schemas"]["SubmittedJob"]["properties"]
    jobs = {p["name"] for p in schema["paths"]["/api/v1/jobs/"]["get"]["parameters"]}
    assert "schedule" in jobs
    write = schema["components"]["schemas"]["ScheduleWrite"]["properties"]
    assert {"cron", "interval_seconds", "timezone", "catch_up", "overlap"} <= set(write)
    detail = schema["paths"]["/api/v1/schedules/{id}/"]
    assert {"get", "patch", "delete"} <= set(detail)
    assert {"400", "404"} <= set(detail["patch"]["responses"])


def test_docs_page_is_served(anon):
    r = anon.get("/api/v1/docs/")
    assert r.status_code == 200
    assert b"swagger" in r.content.lower()
    assert b"/api/v1/schema/" in r.content
    # Assets come from this service, not a CDN: the page works without the internet.
    bundle = b'src="/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js"'
    assert bundle in r.content
    assert b"https://" not in r.content


def test_route_template_matches_the_schema_spelling():
    assert route_template("api/v1/jobs/<int:pk>/cancel/") == "/api/v1/jobs/{id}/cancel/"
    assert route_template("api/v1/jobs/") == "/api/v1/jobs/"


def test_every_schema_operation_is_exercised(anon, request):
    """Runs last (see conftest): EXERCISED holds what the other API tests really requested."""
    modules = {p.name for p in API_DIR.glob("test_*.py")}
    ran = {Path(str(item.path)).name for item in request.session.items}
    if DESELECTED_API_TESTS or not modules <= ran:
        pytest.skip("needs the whole tests/api suite in the same run")
    schema = fetch_schema(anon)
    missing = operations(schema) - EXERCISED
    assert not missing, f"schema operations no test requested: {sorted(missing)}"
    undocumented = {
        (m, p) for m, p in EXERCISED if p.startswith(("/api/v1/jobs", "/api/v1/schedules"))
    }
    undocumented -= operations(schema)
    assert not undocumented, f"requested but not in the schema: {sorted(undocumented)}"
