"""The server's limits, one definition: keywords of `serve()` / `ServerThread()` and flags of `tts serve`.
Standard library only, so the command line can build its flags without loading the server."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields


def _limit(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Limits:
    """The server's limits (docs/protocol.md, Limits): what each bounds, and its default."""

    max_connections: int = _limit(64, "open WebSockets plus speech requests in flight, together")
    max_connections_per_client: int = _limit(16, "the same, for one remote address (or API key, when keys are set)")
    max_streams_per_client: int = _limit(16, "utterances one client has speaking or queued, together")
    max_queue: int = _limit(32, "utterances waiting for an engine slot, all clients together")
    queue_timeout_s: float = _limit(30.0, "the longest an utterance waits in the queue before server_full")
    max_contexts: int = _limit(4, "utterances open at once on one WebSocket (context_id)")
    max_text_chars: int = _limit(4096, "text of one utterance (OpenAI's own limit is 4096)")
    idle_timeout_s: float = _limit(30.0, "a WebSocket that sends no text and receives no audio this long is closed")
    send_buffer_bytes: int = _limit(65536, "kernel send buffer of each connection; audio beyond it waits in the engine")
    max_message_bytes: int = _limit(65536, "largest client message or request body")
    resume_window_s: float = _limit(
        30.0,
        "how long a WebSocket session whose connection dropped waits for its "
        "client to resume it, holding its streams and its place in max_connections "
        "but not in its client's caps (0: no resume)",
    )
    resume_buffer_bytes: int = _limit(
        1 << 20, "output of one context kept for a resume until the client acknowledges it"
    )

    def __post_init__(self):
        for name, value in vars(self).items():
            least = 0 if name in _MAY_BE_ZERO else 1e-9
            if not (isinstance(value, (int, float)) and value >= least):
                raise ValueError(
                    f"limit {name} must be a {'non-negative' if least == 0 else 'positive'} number, not {value!r}"
                )


_MAY_BE_ZERO = ("resume_window_s",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per limit, named after it: --max-connections, --queue-timeout-s, ..."""
    for f in fields(Limits):
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(f.default),
            default=f.default,
            metavar=type(f.default).__name__.upper(),
            help=f"{f.metadata['help']} (default {f.default})",
        )


def limits_from(args: argparse.Namespace) -> dict:
    """The limit keywords of parsed `add_arguments` flags, for `serve(**limits_from(args))`."""
    return {f.name: getattr(args, f.name) for f in fields(Limits)}
