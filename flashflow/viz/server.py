"""`flashflow viz`: serve the dataflow explorer on 127.0.0.1 with the standard library's
http.server. GET / and /static/* return the page's files (package data); GET /api/orders and
POST /api/{simulate,order,search} run :mod:`flashflow.viz.api`."""
from __future__ import annotations

import argparse
import json
import logging
import threading
import webbrowser
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

from flashflow.viz import api

log = logging.getLogger(__name__)

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
MAX_BODY = 1 << 20


def _static_files() -> dict[str, bytes]:
    folder = resources.files("flashflow.viz") / "static"
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


class Handler(BaseHTTPRequestHandler):
    server_version = "flashflow-viz"
    static: dict[str, bytes] = {}

    def log_message(self, fmt, *args):  # route http.server's access log to logging
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, body: bytes, content_type: str):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path == "/api/orders":
            return self._json(HTTPStatus.OK, api.list_orders())
        if path == "/favicon.ico":   # browsers ask for it; there is none
            self.send_response(HTTPStatus.NO_CONTENT)
            self.end_headers()
            return None
        name = "index.html" if path in ("/", "/index.html") else (
            path[len("/static/"):] if path.startswith("/static/") else None)
        if name in self.static:   # only files shipped in static/: no path traversal
            ext = name[name.rfind("."):]
            return self._send(HTTPStatus.OK, self.static[name],
                              _TYPES.get(ext, "application/octet-stream"))
        self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {path}"})

    def do_POST(self):
        route = api.ROUTES.get(self.path.split("?", 1)[0])
        if route is None:
            return self._json(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: {self.path}"})
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            return self._json(HTTPStatus.BAD_REQUEST, {"error": "bad or too long request body"})
        try:
            req = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(req, dict):
                raise ValueError("request body must be a JSON object")
            return self._json(HTTPStatus.OK, route(req))
        except ValueError as e:   # json.JSONDecodeError is a ValueError too
            return self._json(HTTPStatus.BAD_REQUEST, {"error": str(e)})
        except Exception as e:  # keep serving; the page shows the message
            log.exception("request %s failed", self.path)
            return self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": repr(e)})


def make_server(host: str = "127.0.0.1", port: int = 8765) -> ThreadingHTTPServer:
    """A server bound to (host, port); port 0 picks a free one (see ``server_address``)."""
    handler = type("ExplorerHandler", (Handler,), {"static": _static_files()})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def serve_in_thread(host: str = "127.0.0.1", port: int = 0):
    """Start a server on a background thread; return (server, url). Stop with server.shutdown()."""
    server = make_server(host, port)
    thread = threading.Thread(target=server.serve_forever, name="flashflow-viz", daemon=True)
    thread.start()
    h, p = server.server_address[:2]
    return server, f"http://{h}:{p}/"


def cmd_viz(args) -> int:
    try:
        server = make_server(args.host, args.port)
    except OSError as e:   # port taken, address not on this machine, no permission
        args.parser.error(f"cannot serve on {args.host}:{args.port}: {e.strerror or e}")
    h, p = server.server_address[:2]
    url = f"http://{h}:{p}/"
    print(f"dataflow explorer at {url} (Ctrl-C to stop)", flush=True)
    if args.open:
        webbrowser.open(url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535] (0 picks a free port), "
                                         f"got {value}")
    return value


DESCRIPTION = ("Serve the dataflow explorer, a web page to build tile orders by hand and watch "
               "the cache model's traffic, on this machine (the standard library's http.server; "
               "nothing to build or install). Ctrl-C stops it.")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("viz", help="dataflow explorer web page on 127.0.0.1",
                              description=DESCRIPTION,
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (127.0.0.1: reachable from this machine only)")
    p.add_argument("--port", type=_port, default=8765, help="TCP port; 0 picks a free one")
    p.add_argument("--open", action="store_true", help="open the page in a browser")
    p.set_defaults(func=cmd_viz, parser=p)
