# syntax=docker/dockerfile:1
# One image for every role: the API (default command), workers, the reaper and migrations.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DJANGO_SETTINGS_MODULE=jobservice.settings \
    JOBS_PRODUCTION=1 \
    BIND=0.0.0.0:8000

WORKDIR /app

# HAProxy, the API's front (the compose service `proxy`, `python -m jobservice.proxy`):
# Debian's package; it runs as the image's user, with its files under /tmp.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends haproxy \
 && rm -rf /var/lib/apt/lists/*

# Dependencies first, read from pyproject, so a code change does not reinstall them.
COPY pyproject.toml ./
# The app's dependencies and the deployment's (the `deploy` extra: gunicorn, whitenoise, ...,
# and the feature extras it names, kafka, archive and server, spelled out: not from an index).
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; x = p['optional-dependencies']; print('\n'.join(p['dependencies'] + [r for e in ('kafka', 'archive', 'server', 'otel', 'sentry', 'deploy') for r in x[e] if not r.startswith('jobservice')]))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

COPY . .
RUN pip install --no-deps .

# Hashed, compressed static files for whitenoise (the admin's CSS/JS). Production
# settings refuse to load without these variables; collectstatic touches neither
# the database nor Redis, so placeholders that exist only in this step suffice.
RUN SECRET_KEY="build-only-$(python -c 'import secrets; print(secrets.token_urlsafe(48))')" \
    DATABASE_URL=postgres://unused@localhost/unused \
    REDIS_URL=redis://localhost:6379/0 \
    python manage.py collectstatic --noinput

# Run as an unprivileged user that owns nothing in /app.
RUN groupadd --system --gid 10001 jobs \
 && useradd --system --uid 10001 --gid jobs --no-create-home --shell /usr/sbin/nologin jobs
USER 10001:10001

EXPOSE 8000 8080 9101 9102
# The API: granian by default, JOBS_HTTP_SERVER=gunicorn for gunicorn.conf.py as it is (D135).
# Its front: `python -m jobservice.proxy` (HAProxy on 8080, D204, D250).
CMD ["python", "-m", "jobservice.serve"]
