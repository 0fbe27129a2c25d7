"""A recording HTTP proxy: what a benchmark tool sends, captured as fixtures.

    python3 record.py LISTEN_PORT UPSTREAM_HOST:PORT OUT.jsonl

Forwards every request to the upstream (a `tl gateway`) and streams its answer back unchanged,
so the tool runs as it would against the gateway itself. Each request is appended to OUT.jsonl
as {"method", "path", "headers", "body"}, with `authorization` redacted and the per-connection
headers (host, content-length) left out. Only the project's own gateway on loopback is ever the
upstream. Standard library only.
"""

import http.client
import http.server
import json
import sys
import threading

SKIP = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


def main() -> None:
    port, upstream, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _proxy(self):
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            rec = {k: ("<redacted>" if k == "authorization" else v)
                   for k, v in headers.items() if k not in SKIP}
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode("utf-8", "replace")
            with lock, open(out, "a") as f:
                f.write(json.dumps({"method": self.command, "path": self.path,
                                    "headers": rec, "body": body}) + "\n")
            host, _, p = upstream.partition(":")
            conn = http.client.HTTPConnection(host, int(p), timeout=600)
            fwd = {k: v for k, v in headers.items() if k not in SKIP}
            conn.request(self.command, self.path, body=raw or None, headers=fwd)
            resp = conn.getresponse()
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in SKIP:
                    self.send_header(k, v)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            conn.close()

        do_GET = do_POST = do_DELETE = _proxy

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    srv.daemon_threads = True
    srv.serve_forever()


if __name__ == "__main__":
    main()
