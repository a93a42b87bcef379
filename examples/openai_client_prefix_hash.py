"""Send X-Prefix-Hash from the official `openai` client.

Behind nginx's `hash $http_x_prefix_hash consistent` upstream (see nginx/), every
request carrying the same header value reaches the same replica, which then
serves the shared system prompt from its prefix cache. The header is
`prefixserve.router.routing_key.prefix_hash(system_prompt, tools=tools)`: the first 16 hex digits
of SHA-256 over the prompt's UTF-8 bytes, then (for a request with tools) a 0x00 byte and
the tools' canonical JSON (see nginx/README.md for other languages); a request for a LoRA
adapter keys by `adapter_key(that key, adapter name)` (docs/routing.md, rule 7).

Two ways to attach it:

* `default_headers=` on a client dedicated to one system prompt (one tenant,
  one agent);
* `extra_headers=` per request on a shared client, computed from the messages.

Run against nginx in front of `prefixserve replica` servers:

    python examples/openai_client_prefix_hash.py --base-url http://localhost:8080/v1
"""

from __future__ import annotations

import argparse

from openai import OpenAI

from prefixserve.router.routing_key import PREFIX_HASH_HEADER, prefix_hash, routing_key

SYSTEM_PROMPT = (
    "You are the support assistant of a small bicycle shop. Answer in two sentences, "
    "name the part the customer needs, and never invent prices."
)


def prefix_headers(
    messages: list[dict],
    cache_salt: str | None = None,
    tools: list[dict] | None = None,
    adapter: str | None = None,
) -> dict[str, str]:
    """The X-Prefix-Hash header for a chat request ({} when it has no system prompt, no tools and no
    adapter). ``adapter``: the LoRA adapter the request's ``model`` names, when it names one."""
    body: dict = {"messages": messages}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if tools:
        body["tools"] = tools
    key = routing_key(body, adapter=adapter)
    return {} if key is None else {PREFIX_HASH_HEADER: key}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://localhost:8080/v1", help="nginx's OpenAI endpoint")
    parser.add_argument("--api-key", default="unused", help="API key, if the replicas require one")
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args(argv)

    # 1. A client for one system prompt: the header goes on every request it sends.
    tenant = OpenAI(
        base_url=args.base_url,
        api_key=args.api_key,
        default_headers={PREFIX_HASH_HEADER: prefix_hash(SYSTEM_PROMPT)},
    )
    for question in ("My chain skips on the smallest cog.", "The rear brake squeals."):
        raw = tenant.chat.completions.with_raw_response.create(
            model=args.model,
            messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
            max_tokens=48,
        )
        reply = raw.parse()
        details = reply.usage.prompt_tokens_details if reply.usage else None
        cached = details.cached_tokens if details else None
        replica = raw.headers.get("X-Prefixserve-Upstream")
        print(f"replica={replica} cached_tokens={cached} reply={reply.choices[0].message.content!r}")

    # 2. A shared client: compute the header per request from its messages.
    shared = OpenAI(base_url=args.base_url, api_key=args.api_key)
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Which tyre fits a 700x28c rim?"},
    ]
    raw = shared.chat.completions.with_raw_response.create(
        model=args.model, messages=messages, max_tokens=48, extra_headers=prefix_headers(messages)
    )
    print(f"replica={raw.headers.get('X-Prefixserve-Upstream')} reply={raw.parse().choices[0].message.content!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
