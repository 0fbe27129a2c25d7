"""Drives a tl gateway with the official `openai` Python client, as a new user would.

Reads a JSON plan on stdin: {"base_url": ..., "requests": [{"name", "api", "stream", "kwargs"}]}
with api one of "models", "completions", "chat". Prints one JSON object mapping each name to what
the client returned, dumped from the client's own typed objects (so every field went through its
parsing): {"body": {...}} for a whole response, {"chunks": [...]} for a stream, {"error":
{"status", "message"}} when the client raised an API error.
"""

import json
import sys

import openai


def main() -> None:
    plan = json.load(sys.stdin)
    client = openai.OpenAI(
        base_url=plan["base_url"], api_key="unused", max_retries=0, timeout=60.0
    )
    out = {"openai_version": openai.__version__}
    for r in plan["requests"]:
        try:
            if r["api"] == "models":
                result = {"body": [m.model_dump(mode="json") for m in client.models.list()]}
            else:
                api = client.completions if r["api"] == "completions" else client.chat.completions
                got = api.create(stream=r["stream"], **r["kwargs"])
                if r["stream"]:
                    result = {"chunks": [c.model_dump(mode="json") for c in got]}
                else:
                    result = {"body": got.model_dump(mode="json")}
        except openai.APIStatusError as e:
            result = {"error": {"status": e.status_code, "message": str(e)}}
        out[r["name"]] = result
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
