"""The job service's web pages: ``mount_ui(app)`` adds the HTML pages and the ``/static`` files.

Pages are static HTML + hand-written JavaScript shipped inside the package (``static/``: no CDN, no build
step; ``plot.js`` is the SVG plotting module); they read everything from the REST API in the browser.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from .studies import mount_studies

STATIC_DIR = Path(__file__).resolve().with_name("static")
# Pages and scripts change with the package; make browsers revalidate instead of using a stale copy.
NO_CACHE = {"Cache-Control": "no-cache"}


class _RevalidatedStaticFiles(StaticFiles):
    """StaticFiles whose responses carry ``Cache-Control: no-cache`` (ETag revalidation still applies)."""

    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers.update(NO_CACHE)
        return response


def _page(name: str):
    """An endpoint answering with the page ``static/NAME`` (its JavaScript reads the URL's parameters)."""
    return lambda: FileResponse(STATIC_DIR / name, media_type="text/html", headers=NO_CACHE)


pages = APIRouter(include_in_schema=False)
for _url, _name in [("/", "jobs.html"), ("/compare", "compare.html"), ("/studies", "studies.html")]:
    pages.get(_url)(_page(_name))
pages.get("/studies/{name}")(_page("studies.html"))


@pages.get("/jobs/{job_id}")
def job_page(job_id: int) -> FileResponse:
    """The job page (a job id that is not a number: 422)."""
    return _page("job.html")()


def mount_ui(app: FastAPI) -> None:
    """Add the pages (``/``, ``/jobs/{job_id}``, ``/compare``, ``/studies[/{name}]``, excluded from
    ``/docs``), the study API and ``/static`` to ``app``."""
    app.include_router(pages)
    mount_studies(app)
    app.mount("/static", _RevalidatedStaticFiles(directory=STATIC_DIR), name="static")
