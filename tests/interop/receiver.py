"""A webhook receiver built on the official Python verifier (PyPI
`standardwebhooks`), for cdc-relay's interop tests (tests/tests/system/interop.rs).

POST /inbox   204 when standardwebhooks' Webhook(secret).verify accepts the
              request, 401 (with the verifier's message) otherwise
POST /switch  from now on verify with RECEIVER_NEXT_SECRET instead (a
              receiver switching secrets at an instant of the test's choosing)
POST /release answer the /inbox requests held since the start (RECEIVER_HOLD=1:
              a receiver that is slow until the test says otherwise)
GET  /counts  {"accepted", "rejected", "accepted_by_secret": [first, next],
               "ids": distinct webhook-ids accepted, "events": events in the
               accepted requests (a batch's array counts each element),
               "held": /inbox requests waiting for /release,
               "rejections": first reasons}

Environment: RECEIVER_SECRET (whsec_...), RECEIVER_NEXT_SECRET (optional),
RECEIVER_HOLD (1: hold every /inbox request until POST /release).
Prints `listening on http://127.0.0.1:PORT` once bound (port 0: any free one).
"""

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks import Webhook

SECRETS = [os.environ["RECEIVER_SECRET"], os.environ.get("RECEIVER_NEXT_SECRET")]
LOCK = threading.Lock()
RELEASED = threading.Event()
if os.environ.get("RECEIVER_HOLD") != "1":
    RELEASED.set()
STATE = {
    "phase": 0,
    "verifier": Webhook(SECRETS[0]),
    "accepted": 0,
    "rejected": 0,
    "accepted_by_secret": [0, 0],
    "ids": set(),
    "events": 0,
    "held": 0,
    "rejections": [],
}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - quiet access log
        pass

    def answer(self, status, body=b""):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        if body:
            self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length)
        if self.path == "/switch":
            with LOCK:
                STATE["phase"] = 1
                STATE["verifier"] = Webhook(SECRETS[1])
            return self.answer(204)
        if self.path == "/release":
            RELEASED.set()
            return self.answer(204)
        if self.path != "/inbox":
            return self.answer(404)
        if not RELEASED.is_set():
            with LOCK:
                STATE["held"] += 1
            RELEASED.wait()
            with LOCK:
                STATE["held"] -= 1
        with LOCK:
            phase, verifier = STATE["phase"], STATE["verifier"]
        try:
            payload = verifier.verify(body, dict(self.headers.items()))
        except Exception as e:  # the verifier's refusal, whatever its class
            with LOCK:
                STATE["rejected"] += 1
                if len(STATE["rejections"]) < 5:
                    STATE["rejections"].append(f"{type(e).__name__}: {e}")
            return self.answer(401, json.dumps({"error": str(e)}).encode())
        with LOCK:
            STATE["accepted"] += 1
            STATE["accepted_by_secret"][phase] += 1
            STATE["ids"].add(self.headers.get("webhook-id"))
            STATE["events"] += len(payload) if isinstance(payload, list) else 1
        self.answer(204)

    def do_GET(self):
        if self.path != "/counts":
            return self.answer(404)
        with LOCK:
            counts = {
                "accepted": STATE["accepted"],
                "rejected": STATE["rejected"],
                "accepted_by_secret": list(STATE["accepted_by_secret"]),
                "ids": len(STATE["ids"]),
                "events": STATE["events"],
                "held": STATE["held"],
                "rejections": list(STATE["rejections"]),
            }
        self.answer(200, json.dumps(counts).encode())


def main():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
