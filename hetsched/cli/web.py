"""``hetsched web``: serve the placement planner (REST API and page) on the store."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from hetsched.cli.output import console_err
from hetsched.cli.settings import overridden
from hetsched.errors import BackendUnavailableError, InputError
from hetsched.server.bind import bind_address, check_exposure
from hetsched.settings import Settings, WebSettings


def register(app: typer.Typer) -> None:
    app.command("web")(web_command)


def web_command(
    host: Annotated[str | None, typer.Option(
        "--host", help=f"interface to listen on (default: {WebSettings.host})")] = None,
    port: Annotated[int | None, typer.Option("--port", min=1, max=65535,
                                             help=f"TCP port (default: {WebSettings.port})")] = None,
    database_url: Annotated[str | None, typer.Option(
        "--database-url", help="SQLAlchemy URL of the store; default HETSCHED_DATABASE_URL, else the embedded SQLite "
                               "file (share it with the operator to see its plans)")] = None,
    insecure: Annotated[bool, typer.Option(
        "--insecure", help="listen beyond loopback without HETSCHED_WEB_TOKEN anyway (anyone who reaches the port "
                           "may read and change plans)")] = False,
) -> None:
    """Serve the web placement planner: choose models, load, SLOs and inventory; solve; compare what-ifs; export."""
    try:
        import uvicorn

        from hetsched.server.serve import uvicorn_options
        from hetsched.store.db import shown_url
        from hetsched.web import create_app
    except ImportError as exc:
        raise BackendUnavailableError(f"the web planner needs the 'web' extra: pip install 'hetsched[web]' ({exc})") from exc
    if database_url is not None:
        try:
            make_url(database_url)
        except ArgumentError as exc:
            raise InputError(f"expected an SQLAlchemy URL such as sqlite:///plans.sqlite or "
                             f"postgresql+psycopg://user@host/db, got {shown_url(database_url)!r}", field="--database-url") from exc
    settings = Settings.from_env()
    settings = replace(settings, web=overridden(settings.web, host=host, port=port),
                       store=replace(settings.store, database_url=database_url or settings.store.database_url))
    host, port = settings.web.host, settings.web.port
    warning = check_exposure(host, has_token=bool(settings.web.token), insecure=insecure,
                             exposes="read and change its plans and uploaded models",
                             token_hint="set HETSCHED_WEB_TOKEN")
    app = create_app(settings)
    if warning:
        console_err.print(warning, style="bold red", markup=False)
    console_err.print(f"hetsched planner listening on {bind_address(host, port)}: open {planner_url(host, port)}  "
                      f"(store {shown_url(settings.store.resolved_url())}; Ctrl-C stops)", markup=False)
    uvicorn.run(app, host=host, port=port, log_level="warning", **uvicorn_options(settings.web.limits()))


def planner_url(host: str, port: int) -> str:
    """The address a browser opens: a wildcard interface is reached on localhost."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://[{shown}]:{port}/" if ":" in shown else f"http://{shown}:{port}/"
