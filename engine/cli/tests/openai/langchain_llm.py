"""Drives a tl gateway with langchain-openai's completions LLM (`langchain_openai.OpenAI`),
which sends `"prompt": [...]` lists: invoke, batch and generate, whole and streamed.

Reads {"base_url", "model", "prompts": [...], "max_tokens"} on stdin; prints one JSON object:
{"invoke": text, "stream": [chunk texts], "batch": [texts], "generate": [[{"text",
"finish_reason"}]], "token_usage": {...}} from langchain's own result objects.
"""

import json
import sys

from langchain_openai import OpenAI


def main() -> None:
    plan = json.load(sys.stdin)
    llm = OpenAI(
        base_url=plan["base_url"],
        api_key="unused",
        model=plan["model"],
        max_tokens=plan["max_tokens"],
        temperature=0,
        max_retries=0,
        timeout=60,
    )
    prompts = plan["prompts"]
    out = {
        "invoke": llm.invoke(prompts[0]),
        "stream": list(llm.stream(prompts[0])),
        "batch": llm.batch(prompts),
    }
    result = llm.generate(prompts)
    out["generate"] = [
        [{"text": g.text, "finish_reason": (g.generation_info or {}).get("finish_reason")} for g in gens]
        for gens in result.generations
    ]
    out["token_usage"] = (result.llm_output or {}).get("token_usage")
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
