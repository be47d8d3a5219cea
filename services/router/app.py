"""The OpenAI-compatible REST gateway as a FastAPI app: the Gateway's state, its routes, its
error handlers and the page.

Errors leave in OpenAI's format, translated in one place (errors.status_of): 400 bad input,
context overflow or more choices than any worker holds, 401 key, 404 model, 408 and 413 body,
429 a full admission queue, 503 no worker or Redis down, 504 deadline (waiting in the queue
included). Anything unexpected is logged and answered 500 without internals.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from services.router import admin, completions
from services.router.errors import install_handlers
from services.router.gateway import Gateway
from services.router.openapi import build_openapi
from services.router.page import mount_page
from services.router.settings import GatewaySettings
from services.router.workers import Workers
from shared.models.text import TextModel


def create_app(settings: GatewaySettings, text: TextModel, workers: Workers | None = None) -> FastAPI:
    gateway = Gateway(settings, text, workers)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await gateway.close()

    app = FastAPI(title="lazyserve", version="0.1.0", lifespan=lifespan)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi
    app.state.gateway, app.state.keys = gateway, gateway.keys
    app.state.metrics, app.state.dispatcher, app.state.workers = gateway.metrics, gateway.dispatcher, gateway.workers
    install_handlers(app)
    app.include_router(completions.router)
    app.include_router(admin.router)
    mount_page(app)
    return app
