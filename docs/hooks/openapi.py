"""The API reference page, generated when the site is built from the OpenAPI document
the deployment serves (drf-spectacular, the same generator as /api/v1/schema/), so the
reference cannot drift from the code and the site's search finds every operation and
field. The document itself is published beside it as openapi.yaml."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from mkdocs.structure.files import File

PAGE = "api/reference.md"
DOCUMENT = "api/openapi.yaml"
METHODS = ("get", "post", "put", "patch", "delete")


def served_schema(root: Path) -> dict[str, Any]:
    """The deployment's schema, without a database: generating it connects to nothing."""
    sys.path.insert(0, str(root))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "jobservice.settings")
    os.environ.setdefault("DATABASE_URL", "postgres://unused@127.0.0.1:1/unused")
    import django

    django.setup()
    from drf_spectacular.generators import SchemaGenerator

    return SchemaGenerator().get_schema(request=None, public=True)


def anchor(name: str) -> str:
    return "schema-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def cell(text: Any) -> str:
    """Text fit for one Markdown table cell."""
    return re.sub(r"\s*\n\s*", " ", str(text or "")).replace("|", "\\|").strip()


def type_of(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return f"[{name}](#{anchor(name)})"
    for key, joiner in (("allOf", " and "), ("oneOf", " or "), ("anyOf", " or ")):
        if key in schema:
            text = joiner.join(type_of(s) for s in schema[key])
            return text + (", nullable" if schema.get("nullable") else "")
    kind = schema.get("type", "any")
    if kind == "array":
        text = f"array of {type_of(schema.get('items', {}))}"
    elif kind == "object" and "additionalProperties" in schema:
        extra = schema["additionalProperties"]
        text = "object" if extra is True else f"object of {type_of(extra)}"
    else:
        text = f"{kind} ({schema['format']})" if "format" in schema else kind
    if "enum" in schema:
        text += ": " + ", ".join(f"`{v}`" for v in schema["enum"] if v not in ("", None))
    bounds = [f"{k} {schema[k]}" for k in ("minimum", "maximum", "minLength", "maxLength")
              if k in schema]  # fmt: skip
    if bounds:
        text += f" ({', '.join(bounds)})"
    if schema.get("nullable"):
        text += ", nullable"
    return text


def body_types(content: dict[str, Any]) -> str:
    return "; ".join(f"{type_of(c.get('schema', {}))} (`{media}`)" for media, c in content.items())


def operation(path: str, method: str, op: dict[str, Any]) -> list[str]:
    out = [f"### {method.upper()} `{path}`", ""]
    if op.get("summary"):
        out += [op["summary"], ""]
    if op.get("description"):
        out += [op["description"].strip(), ""]
    security = op.get("security")
    if security is not None:
        schemes = sorted({name for s in security for name in s} - {""}) or ["none"]
        out += [f"Authentication: {', '.join(schemes)}.", ""]
    params = op.get("parameters", [])
    if params:
        out += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for p in params:
            out.append(
                f"| `{p['name']}` | {p['in']} | {cell(type_of(p.get('schema', {})))} | "
                f"{'yes' if p.get('required') else 'no'} | {cell(p.get('description'))} |"
            )
        out.append("")
    body = op.get("requestBody")
    if body:
        out += [f"Request body: {body_types(body.get('content', {}))}.", ""]
    out += ["| status | body | description |", "|---|---|---|"]
    for status, answer in op.get("responses", {}).items():
        content = body_types(answer.get("content", {})) or "—"
        out.append(f"| {status} | {cell(content)} | {cell(answer.get('description'))} |")
    return [*out, ""]


def component(name: str, schema: dict[str, Any]) -> list[str]:
    out = [f"### {name} {{#{anchor(name)}}}", ""]
    if schema.get("description"):
        out += [schema["description"].strip(), ""]
    properties = schema.get("properties")
    if not properties:
        return [*out, f"Type: {type_of(schema)}.", ""]
    required = set(schema.get("required", []))
    out += ["| field | type | required | description |", "|---|---|---|---|"]
    for field, spec in properties.items():
        kind = type_of(spec) + (", read-only" if spec.get("readOnly") else "")
        out.append(
            f"| `{field}` | {cell(kind)} | {'yes' if field in required else 'no'} | "
            f"{cell(spec.get('description'))} |"
        )
    return [*out, ""]


def render(schema: dict[str, Any]) -> str:
    info = schema.get("info", {})
    out = [
        "# API reference",
        "",
        f"{info.get('title', 'API')} {info.get('version', '')}: {info.get('description', '')}",
        "",
        "Generated from the OpenAPI document when this site was built: the service serves the "
        "same document at `/api/v1/schema/` and its Swagger UI at `/api/v1/docs/`. "
        "The document: [openapi.yaml](openapi.yaml). How to use the API, with a walk-through: "
        "[The REST API](../api.md); every error code: "
        "[Errors](../api.md#errors).",
        "",
    ]
    by_tag: dict[str, list[tuple[str, str, dict]]] = {}
    for path, item in schema.get("paths", {}).items():
        for method in METHODS:
            if method in item:
                tag = (item[method].get("tags") or ["other"])[0]
                by_tag.setdefault(tag, []).append((path, method, item[method]))
    for tag in sorted(by_tag):
        out += [f"## {tag.capitalize()}", ""]
        for path, method, op in by_tag[tag]:
            out += operation(path, method, op)
    components = schema.get("components", {}).get("schemas", {})
    if components:
        out += ["## Schemas", ""]
        for name in sorted(components):
            out += component(name, components[name])
    return "\n".join(out)


def on_files(files, config):
    schema = served_schema(Path(__file__).resolve().parents[2])  # the repository's code
    files.append(File.generated(config, PAGE, content=render(schema)))
    document = yaml.safe_dump(schema, sort_keys=False, allow_unicode=True)
    files.append(File.generated(config, DOCUMENT, content=document))
    return files
