"""A tool-calling round trip against `tl serve`, with the official `openai` client or with
langchain-openai's `ChatOpenAI.bind_tools`: the model is made to call `get_weather` (a named
`tool_choice`, which the server enforces with a grammar), the call is parsed by the library,
the tool runs here, its answer goes back as a `tool` message, and the model answers in text.

Reads {"base_url", "model", "framework": "openai" | "langchain", "stream": bool} on stdin;
prints one JSON object: {"call": {"name", "arguments"}, "finish_reason" (openai only),
"answer": text}.
"""

import json
import sys

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
QUESTION = "What is the weather like in Paris today?"


def weather(city: str) -> str:
    return f"Sunny and 21 degrees in {city}."


def with_openai(plan):
    from openai import OpenAI

    client = OpenAI(base_url=plan["base_url"], api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": QUESTION}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=plan["model"], messages=messages, tools=[WEATHER], tool_choice=forced,
                  max_tokens=48, temperature=0)
    if plan["stream"]:
        # The library's own accumulation of the deltas.
        calls, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for ch in chunk.choices:
                for tc in ch.delta.tool_calls or []:
                    c = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
                finish = ch.finish_reason or finish
        call = calls[0]
        call_id, name, arguments = call["id"], call["name"], call["arguments"]
    else:
        r = client.chat.completions.create(**kwargs)
        tc = r.choices[0].message.tool_calls[0]
        call_id, name, arguments = tc.id, tc.function.name, tc.function.arguments
        finish = r.choices[0].finish_reason
    args = json.loads(arguments)
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]})
    messages.append({"role": "tool", "tool_call_id": call_id, "content": weather(args["city"])})
    final = client.chat.completions.create(model=plan["model"], messages=messages, max_tokens=32,
                                           temperature=0)
    return {"call": {"name": name, "arguments": args}, "finish_reason": finish,
            "answer": final.choices[0].message.content}


def with_langchain(plan):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=plan["base_url"], api_key="unused", model=plan["model"],
                     max_tokens=48, temperature=0, max_retries=0, timeout=120)
    forced = llm.bind_tools([WEATHER], tool_choice="get_weather")
    messages = [HumanMessage(QUESTION)]
    ai = forced.invoke(messages)
    call = ai.tool_calls[0]
    messages += [ai, ToolMessage(weather(call["args"]["city"]), tool_call_id=call["id"])]
    final = llm.invoke(messages)
    return {"call": {"name": call["name"], "arguments": call["args"]}, "answer": final.content}


def main() -> None:
    plan = json.load(sys.stdin)
    run = with_openai if plan["framework"] == "openai" else with_langchain
    json.dump(run(plan), sys.stdout)


if __name__ == "__main__":
    main()
