"""llama.cpp's own tokenizer on a GGUF file, as its server answers `/tokenize`.

    python3 tokenize.py FILE.gguf < texts.json

reads a JSON list of texts and prints a JSON list of token-id lists, one a text: no BOS
(`add_special` false), control pieces in the text read as tokens (`parse_special` true). The
server runs from the prebuilt PyPI wheel `xllamacpp` on 127.0.0.1, a free port, and stops with
this script. Only the packages on PYTHONPATH are imported.
"""

import json
import sys
import urllib.request


def main():
    import xllamacpp as xlc

    texts = json.load(sys.stdin)
    p = xlc.CommonParams()
    p.model.path = sys.argv[1]
    p.n_ctx = 512
    p.n_parallel = 1
    p.cpuparams.n_threads = 1
    p.cpuparams_batch.n_threads = 1
    p.hostnames = ["127.0.0.1"]
    p.port = 0
    server = xlc.Server(p)
    addr = server.listening_address
    base = (addr if addr.startswith("http") else "http://" + addr).rstrip("/")
    out = []
    for t in texts:
        body = json.dumps({"content": t, "add_special": False, "parse_special": True}).encode()
        req = urllib.request.Request(base + "/tokenize", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out.append(json.load(r)["tokens"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
