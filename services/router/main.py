"""`lazyserve gateway`: the REST gateway and router, served by uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import logging

import uvicorn

from services.router.gateway import create_app
from services.router.settings import GatewaySettings
from shared.text import load_text_model

log = logging.getLogger(__name__)


def serve(settings: GatewaySettings) -> int:
    text = load_text_model(settings.engine.model, settings.engine.cache_dir)
    app = create_app(settings, text)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info", access_log=False)
    server = uvicorn.Server(config)
    # uvicorn handles SIGINT/SIGTERM itself: in-flight requests finish, then it returns.
    server.run()
    return 0
