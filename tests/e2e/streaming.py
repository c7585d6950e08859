"""Read a streamed HTTP answer on a background thread, so a test can break the server meanwhile."""

from __future__ import annotations

import threading
from typing import Callable, ContextManager

import httpx


def stream_in_background(open_stream: Callable[[], ContextManager[httpx.Response]]
                         ) -> tuple[dict, threading.Event, threading.Thread]:
    """Start reading ``open_stream()``'s lines on a daemon thread.

    Returns ``(result, started, thread)``: ``result["lines"]`` collects the lines,
    ``result["exception"]`` holds a transport error; ``started`` is set at the first
    line, or when the stream ends or fails before one.
    """
    result: dict = {}
    started = threading.Event()

    def consume():
        try:
            with open_stream() as stream:
                result["lines"] = []
                for line in stream.iter_lines():
                    started.set()
                    result["lines"].append(line)
        except httpx.HTTPError as err:
            result["exception"] = repr(err)
        finally:
            started.set()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    return result, started, thread
