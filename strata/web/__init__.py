"""The web page at `/` of `strata serve` and `strata router`: a chat playground and a live dashboard.

    GET /                 static/index.html
    GET /ui/app.js        static/app.js   (the playground and the dashboard)
    GET /ui/app.css       static/app.css

Plain HTML, CSS and JavaScript shipped as package data; the page loads nothing from anywhere
else (its Content-Security-Policy says so: 'self' only). It is public and holds no secret: the
API calls it makes (/v1/*, /metrics, /get_server_info, /workers) carry the key the user types,
which the browser keeps in sessionStorage, so `--api-key` guards them as it guards any client.
The dashboard reads only existing endpoints: /metrics (Prometheus text) and /get_server_info,
and on a router /workers.

Never imports torch: both HTTP frontends mount it.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI, Response

ASSETS = {
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}
# served without the API key (the guards of both apps add these to their public paths)
PAGE_PATHS = frozenset({"/", *(f"/ui/{name}" for name in ASSETS)})
HEADERS = {
    "Cache-Control": "no-cache",
    # nothing but this server: no CDN, font or script from elsewhere, no inline script
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


def read_asset(name: str) -> bytes:
    return (files(__package__) / "static" / name).read_bytes()


def add_page_routes(app: FastAPI) -> None:
    """Mount the page's three routes (read from the package once, at start-up)."""
    pages = {
        "index.html": read_asset("index.html"),
        **{name: read_asset(name) for name in ASSETS},
    }

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return Response(
            pages["index.html"], media_type="text/html; charset=utf-8", headers=HEADERS
        )

    for name, media_type in ASSETS.items():
        app.add_api_route(
            f"/ui/{name}",
            _serve(pages[name], media_type),
            methods=["GET"],
            include_in_schema=False,
        )


def _serve(body: bytes, media_type: str):
    async def asset() -> Response:
        return Response(body, media_type=media_type, headers=HEADERS)

    return asset
