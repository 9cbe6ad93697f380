// A webhook receiver built on the official Node.js verifier (npm
// `standardwebhooks`), for cdc-relay's interop tests
// (tests/tests/system/interop.rs). The same protocol as receiver.py:
//
// POST /inbox   204 when Webhook(secret).verify accepts the request, 401
//               (with the verifier's message) otherwise
// POST /switch  from now on verify with RECEIVER_NEXT_SECRET instead
// POST /release answer the /inbox requests held since the start
//               (RECEIVER_HOLD=1)
// GET  /counts  {"accepted", "rejected", "accepted_by_secret": [first, next],
//                "ids": distinct webhook-ids accepted, "events": events in the
//                accepted requests (a batch's array counts each element),
//                "held": /inbox requests waiting for /release,
//                "rejections": first reasons}
//
// Environment: RECEIVER_SECRET (whsec_...), RECEIVER_NEXT_SECRET (optional),
// RECEIVER_HOLD (1: hold every /inbox request until POST /release);
// NODE_PATH must reach the installed package (tests/interop/install.sh).
// Prints `listening on http://127.0.0.1:PORT` once bound.
"use strict";

const http = require("http");
const { Webhook } = require("standardwebhooks");

const secrets = [process.env.RECEIVER_SECRET, process.env.RECEIVER_NEXT_SECRET];
const state = {
  phase: 0,
  verifier: new Webhook(secrets[0]),
  accepted: 0,
  rejected: 0,
  acceptedBySecret: [0, 0],
  ids: new Set(),
  events: 0,
  held: [],
  rejections: [],
};
let released = process.env.RECEIVER_HOLD !== "1";

function answer(res, status, body) {
  const bytes = body === undefined ? "" : JSON.stringify(body);
  res.writeHead(status, {
    "Content-Length": Buffer.byteLength(bytes),
    "Content-Type": "application/json",
  });
  res.end(bytes);
}

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", () => {
    const body = Buffer.concat(chunks);
    if (req.method === "POST" && req.url === "/switch") {
      state.phase = 1;
      state.verifier = new Webhook(secrets[1]);
      return answer(res, 204);
    }
    if (req.method === "POST" && req.url === "/release") {
      released = true;
      state.held.splice(0).forEach((go) => go());
      return answer(res, 204);
    }
    if (req.method === "GET" && req.url === "/counts") {
      return answer(res, 200, {
        accepted: state.accepted,
        rejected: state.rejected,
        accepted_by_secret: state.acceptedBySecret,
        ids: state.ids.size,
        events: state.events,
        held: state.held.length,
        rejections: state.rejections,
      });
    }
    if (req.method !== "POST" || req.url !== "/inbox") {
      return answer(res, 404);
    }
    if (!released) {
      state.held.push(() => inbox(req, res, body));
      return;
    }
    inbox(req, res, body);
  });
});

function inbox(req, res, body) {
  const phase = state.phase;
  let payload;
  try {
    payload = state.verifier.verify(body, req.headers);
  } catch (e) {
    state.rejected += 1;
    if (state.rejections.length < 5) {
      state.rejections.push(`${e.name}: ${e.message}`);
    }
    return answer(res, 401, { error: e.message });
  }
  state.accepted += 1;
  state.acceptedBySecret[phase] += 1;
  state.ids.add(req.headers["webhook-id"]);
  state.events += Array.isArray(payload) ? payload.length : 1;
  answer(res, 204);
}

server.keepAliveTimeout = 60000;
server.listen(0, "127.0.0.1", () => {
  const { address, port } = server.address();
  console.log(`listening on http://${address}:${port}`);
});
