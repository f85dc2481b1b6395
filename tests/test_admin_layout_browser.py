"""The admin job list fits a 1,400 px screen: no column is cut off or scrolled away.

Real chromium (see test_admin_browser.py); the screenshot is saved for a person to look at.
"""

from __future__ import annotations

import pytest

from jobs.models import Client
from tests.factories import JobFactory, raw
from tests.test_admin_browser import SCREENSHOTS, page  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

WIDTH = 1400


def test_job_list_fits_1400_px(page):  # noqa: F811
    client = Client.objects.create(name="billing-service-eu-west-1", token_hash="x" * 64)
    owner = "worker-7f9c2d1e-host.internal.example.com:123456:9f8e7d6c5b4a"
    for status in ("queued", "processing", "done", "failed", "enqueue_failed"):
        job = JobFactory.create(
            status=status,
            task="reports.generate-monthly-invoice-pdf",
            queue="invoices.eu-west-1.high",
            client_id=client.pk,
            max_retries=100,
            worker=owner,
        )
        raw("UPDATE jobs_job SET retry_count = 42 WHERE id = %s AND status = 'queued'", [job.pk])
    page.set_viewport_size({"width": WIDTH, "height": 900})
    page.goto(f"{page.base}/admin/jobs/job/")
    page.wait_for_selector("#result_list")
    page.screenshot(path=str(SCREENSHOTS / "job-list-1400.png"), full_page=True)
    sizes = page.evaluate(
        """() => {
          const table = document.querySelector('#result_list');
          const box = table.closest('.results');
          return {
            viewport: window.innerWidth,
            page: document.documentElement.scrollWidth,
            table: table.getBoundingClientRect().right,
            box: box.clientWidth, boxScroll: box.scrollWidth,
            headers: [...table.querySelectorAll('thead th')].map(th => th.innerText.trim()),
          };
        }"""
    )
    print(sizes)
    assert sizes["page"] <= sizes["viewport"], sizes  # no horizontal scroll of the page
    assert sizes["boxScroll"] <= sizes["box"], sizes  # nor of the results box
    assert sizes["table"] <= sizes["viewport"], sizes
    for header in ("STATUS", "TASK", "QUEUE", "OWNED BY", "CLIENT", "AGE", "IN STATE"):
        assert any(header in h.upper() for h in sizes["headers"]), sizes["headers"]


def test_dashboard_cards_wrap_evenly(page):  # noqa: F811
    JobFactory.create(status="done")
    page.set_viewport_size({"width": WIDTH, "height": 900})
    page.goto(f"{page.base}/admin/jobs/job/dashboard/")
    page.wait_for_selector(".jd-card")
    page.screenshot(path=str(SCREENSHOTS / "dashboard-1400.png"), full_page=True)
    boxes = page.evaluate(
        """() => [...document.querySelectorAll('.jd-grid .jd-card')].map(c => {
             const r = c.getBoundingClientRect();
             return [Math.round(r.left), Math.round(r.top), Math.round(r.width)];
           })"""
    )
    assert len(boxes) >= 6, boxes
    widths = {w for _, _, w in boxes}
    assert max(widths) - min(widths) <= 1, boxes  # one column width for every card
    lefts_by_row: dict[int, list[int]] = {}
    for left, top, _ in boxes:
        lefts_by_row.setdefault(top, []).append(left)
    rows = list(lefts_by_row.values())
    for row in rows[1:]:  # later rows start in the first row's columns
        assert row == rows[0][: len(row)], boxes
