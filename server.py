"""The tts server: streams speech to many clients at once from one shared engine.

Endpoints (the WebSocket protocol and the HTTP API are specified in docs/protocol.md):
  WS   /v1/stream          JSON control messages in, audio out; several utterances (contexts) on one socket
  POST /v1/audio/speech    OpenAI-compatible speech API; the body (raw audio or SSE) streams as it is generated
  GET  /v1/models          OpenAI's model list;  GET /v1/audio/models  the same in Open WebUI's shape
  GET  /v1/voices          the shipped voices and their OpenAI aliases
  GET  /v1/audio/voices    the same in the shape Open WebUI and Kokoro-FastAPI clients read
  GET  /health             liveness, load and the engine's live figures
  GET  /                   the browser demo (static files of demo/)

Starlette routes the requests and uvicorn serves them; uvicorn's WebSocket side is the `websockets`
package (its sans-I/O protocol, which waits for the socket to drain before each send: that wait is
the backpressure that stops a slow reader from making the server buffer audio without bound).
Here: the entry point only. The WebSocket sessions are `serving.session`; the app, `serving.app`; running it,
`serving.launch`. Admission (connection caps, the FIFO queue for engine slots, per-client caps) is
`serving.admission`; what connections share, `serving.context`; the HTTP endpoints and the access checks,
`serving.http_api`.
"""

from __future__ import annotations

from serving.app import build_app
from serving.launch import ServerProcesses, ServerThread, run_server
from serving.limits import Limits

__all__ = ["Limits", "ServerProcesses", "ServerThread", "create_app", "serve"]


def create_app(engine=None, limits: Limits | None = None, **options):
    """The ASGI app (`serving.app.build_app`); ``engine`` None: the process-wide engine on the shipped voices,
    loaded on first use."""
    from tts.api import get_engine

    return build_app(engine, limits, load_engine=get_engine, **options)


def serve(host: str = "127.0.0.1", port: int = 8000, engine=None, **options) -> None:
    """Serve until interrupted (`serving.launch.run_server`; its options and `Limits`' fields); ``engine`` None:
    the process-wide engine on the shipped voices, loaded and compiled before the socket opens."""
    from tts.api import get_engine

    run_server(host, port, engine, load_engine=get_engine, **options)
