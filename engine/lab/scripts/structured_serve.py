#!/usr/bin/env python3
"""JSON-schema requests against a running `tl serve`: every answer must parse and validate.

    python3 structured_serve.py BASE_URL MODEL OUT.json [--seeds 9]

The five schemas and questions of engine/tests/fixtures/schemas.json, each asked greedy once
and seeded `--seeds` times (temperature 0.8, seeds 1..N), through /v1/chat/completions with
`response_format: json_schema`. Validates each answer with the `jsonschema` package (an
independent validator), writes every answer's exact bytes to OUT.json, and prints one JSON line:
requests, parsed, valid, finish reasons. Run it against `tl serve` (1 prefill + 2 decode) and
against `tl serve --colocated`, then compare the two OUT files byte for byte.
"""

import argparse
import json
import pathlib
import urllib.request

import jsonschema

HERE = pathlib.Path(__file__).resolve().parent
FIXTURES = HERE.parent.parent / "tests" / "fixtures" / "schemas.json"


def ask(base, model, question, schema, temperature, seed):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 96,
        "temperature": temperature,
        "seed": seed,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
    }
    req = urllib.request.Request(
        base + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)["choices"][0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("base")
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--seeds", type=int, default=9)
    a = p.parse_args()
    cases = json.loads(FIXTURES.read_text())
    answers, parsed, valid, finish = [], 0, 0, {}
    for c in cases:
        for t, seed in [(0.0, 0)] + [(0.8, s) for s in range(1, a.seeds + 1)]:
            ch = ask(a.base, a.model, c["question"], c["schema"], t, seed)
            text = ch["message"]["content"]
            answers.append({"question": c["question"], "temperature": t, "seed": seed,
                            "content": text, "tokens": ch.get("tokens")})
            finish[ch["finish_reason"]] = finish.get(ch["finish_reason"], 0) + 1
            try:
                doc = json.loads(text)
                parsed += 1
                jsonschema.validate(doc, c["schema"])
                valid += 1
            except (ValueError, jsonschema.ValidationError) as e:
                print(f"invalid: {c['question']!r} t={t} seed={seed}: {text!r}: {e}")
    pathlib.Path(a.out).write_text(json.dumps(answers, indent=1))
    print(json.dumps({"requests": len(answers), "parsed": parsed, "valid": valid,
                      "finish_reasons": finish}))


if __name__ == "__main__":
    main()
