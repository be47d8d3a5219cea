"""`lazyserve gateway`: the REST gateway and router, served by uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import logging

import uvicorn

from services.router.app import create_app
from services.router.settings import GatewaySettings
from shared.models.text import load_text_model
from shared.net.telemetry import setup_logging, setup_tracing, shutdown_tracing

log = logging.getLogger(__name__)


def serve(settings: GatewaySettings) -> int:
    setup_logging()
    setup_tracing("lazyserve-gateway")
    text = load_text_model(settings.engine.model, settings.engine.cache_dir, settings.engine.chat_template)
    text.default_preset = settings.engine.pruning_preset
    app = create_app(settings, text)
    # log_config=None: uvicorn keeps our JSON log lines instead of installing its own format.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=False)
    server = uvicorn.Server(config)
    # uvicorn handles SIGINT/SIGTERM itself: in-flight requests finish, then it returns.
    server.run()
    shutdown_tracing()
    return 0
