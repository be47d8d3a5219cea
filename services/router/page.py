"""The page at `/`: static files in the package (services/router/web), handed out as they are.

No build step and nothing fetched from another host: plain HTML, CSS and JavaScript modules that
call this gateway's own API (the same routes any client uses, with the key the person typed).
A Content-Security-Policy says so to the browser: scripts, styles and requests from this origin
only, no inline script, no framing.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEB = Path(__file__).with_name("web")
PAGE_URL = "/ui"  # the page's own files: /ui/app.js, /ui/style.css, ...

HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # The files change with the package, not while it runs; a browser asks again each time.
    "Cache-Control": "no-cache",
}


class PageFiles(StaticFiles):
    async def get_response(self, path, scope):
        response = await super().get_response(path, scope)
        response.headers.update(HEADERS)
        return response


async def index() -> FileResponse:
    return FileResponse(WEB / "index.html", headers=HEADERS)


def mount_page(app: FastAPI) -> None:
    """`/` serves the page and `/ui/...` its files; neither is in the OpenAPI schema."""
    app.get("/", include_in_schema=False)(index)
    app.head("/", include_in_schema=False)(index)
    app.mount(PAGE_URL, PageFiles(directory=WEB), name="page")
