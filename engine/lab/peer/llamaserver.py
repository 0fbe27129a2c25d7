"""llama.cpp's server as the prebuilt PyPI wheel `xllamacpp` runs it, for the serving load.

    python3 llamaserver.py GGUF THREADS PARALLEL CTX_PER_SLOT

Starts llama.cpp's OpenAI-compatible HTTP server on 127.0.0.1 (a free port), continuous
batching on, PARALLEL slots of CTX_PER_SLOT tokens each, THREADS threads for decode and for
batches, prints one JSON line `{"base_url": ..., "system_info": ...}` and serves until killed.
Only the packages installed beside this file are imported (the bench puts them on PYTHONPATH).
"""

import json
import signal
import sys
import time


def main():
    import xllamacpp as xlc

    path, threads, parallel, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    p = xlc.CommonParams()
    p.model.path = path
    p.n_parallel = parallel
    p.n_ctx = parallel * ctx
    p.cont_batching = True
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    p.hostnames = ["127.0.0.1"]
    p.port = 0
    p.use_jinja = True
    server = xlc.Server(p)
    addr = server.listening_address
    base = addr if addr.startswith("http") else "http://" + addr
    print(json.dumps({
        "base_url": base.rstrip("/") + "/v1",
        "system_info": xlc.get_system_info().strip(),
    }), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
