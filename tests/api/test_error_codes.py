"""The table of error codes in docs/api.md lists every code the API can answer: those the
app's code names (read from the source with `ast`), the ones it makes from a field's
name, and the field rules of Django REST framework's serializers; and nothing else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Made as f"invalid_{field}" / "invalid_" + name: one per field they are made for.
MADE_FROM_FIELD_NAMES = {
    "invalid_priority", "invalid_max_retries",  # jobs/submission.py _check_int
    "invalid_cron", "invalid_interval_seconds", "invalid_timezone",  # schedule timing
    "invalid_catch_up", "invalid_overlap",  # schedule choices
}  # fmt: skip
DYNAMIC_PRODUCERS = 4  # the places above that build a code from a name
# DRF's own: authentication, routing, throttling, parsing (malformed_json is its
# parse_error renamed), and the field rules of the serializers that read request bodies.
DRF = {
    "not_authenticated", "authentication_failed", "permission_denied", "not_found",
    "method_not_allowed", "unsupported_media_type", "throttled", "malformed_json",
    "server_error", "required", "null", "invalid", "blank", "max_length", "min_length",
    "min_value", "max_value", "max_string_length", "not_a_list", "not_a_dict", "empty",
    "invalid_choice", "date",
}  # fmt: skip


def codes_in_source() -> tuple[set[str], int]:
    found: set[str] = set()
    dynamic = 0
    # The app, and the deployment's middleware (refusals before any view).
    for path in [*sorted((ROOT / "jobs").rglob("*.py")), ROOT / "jobservice" / "middleware.py"]:
        if {"migrations", "admin", "management"} & set(path.parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            value = None
            if isinstance(node, ast.keyword) and node.arg == "code":
                value = node.value
            elif isinstance(node, ast.Assign) and [
                t.id for t in node.targets if isinstance(t, ast.Name)
            ] in (["code"], ["default_code"]):
                value = node.value
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_err":
                value = node.args[3] if len(node.args) > 3 else None
            elif (
                isinstance(node, ast.Assign)
                and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["codes"]
                and isinstance(node.value, ast.Dict)
            ):  # a reason → code map
                found |= {v.value for v in node.value.values if isinstance(v, ast.Constant)}
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and getattr(node.func.value, "id", "") == "codes"
                and node.func.attr == "get"
            ):
                value = node.args[1]
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.add(value.value)
            elif isinstance(value, ast.JoinedStr | ast.BinOp):
                dynamic += 1
    return found, dynamic


def codes_in_the_api_page() -> set[str]:
    text = (ROOT / "docs" / "api.md").read_text()
    table = re.search(r"^\| status \| codes \|\n\|---\|---\|\n((?:\|.*\n)+)", text, re.M)
    assert table, "the table of error codes in docs/api.md is gone"
    # "(with `job_id`)" names a field of the body, not a code.
    return set(re.findall(r"(?<!with )`([a-z_]+)`", table.group(1)))


def test_the_api_page_lists_every_code_the_api_answers():
    found, dynamic = codes_in_source()
    assert dynamic == DYNAMIC_PRODUCERS, "a code made from a name: list what it makes above"
    missing = sorted((found | MADE_FROM_FIELD_NAMES | DRF) - codes_in_the_api_page())
    assert not missing, f"add to the table of error codes in docs/api.md: {missing}"


def test_the_api_page_lists_no_code_the_api_never_answers():
    found, _ = codes_in_source()
    stale = sorted(codes_in_the_api_page() - found - MADE_FROM_FIELD_NAMES - DRF)
    assert not stale, f"codes in docs/api.md's table that nothing answers: {stale}"
