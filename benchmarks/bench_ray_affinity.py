"""Prefix-cache hit rate of a multi-turn workload on firsttoken replicas on Ray Serve, per routing policy.

    python benchmarks/bench_ray_affinity.py [--model DIR] [--conversations 20] [--turns 3] [--replicas 2]

Each policy gets a fresh application on one local Ray cluster (the same replicas, flags and workload): C
conversations of T turns, each conversation opening with its own system prompt; turn t of every conversation is
sent (4 at a time) before turn t+1 of any, so follow-ups interleave with other conversations as they would in
production. A follow-up re-sends the whole conversation; what the replica finds of it in its prefix cache is
``usage.prompt_tokens_details.cached_tokens``. Printed per policy: cached tokens / prompt tokens over all turns and
over follow-up turns only (turn 1 can only hit the shared chat-template head).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

POLICIES = ("affinity", "p2c", "round-robin")
TOPICS = ("tides", "lighthouses", "harbours", "sailing knots", "storms", "reefs", "whales", "ferries", "buoys",
          "compasses", "anchors", "currents", "islands", "fishing boats", "sea charts", "cliffs", "beaches",
          "canals", "icebergs", "ports")  # fmt: skip
QUESTIONS = ("Tell me about {t}.", "What should a beginner know about {t}?", "And what is surprising about {t}?",
             "Summarise {t} in one line.", "Which book about {t} would you suggest?")  # fmt: skip


def run_workload(base_url: str, conversations: int, turns: int, seed: int) -> dict[str, int]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    chats = []
    for i in range(conversations):
        topic = TOPICS[i % len(TOPICS)]
        system = (f"[conversation {i} of run {seed}] You are a patient guide on {topic}; answer in two sentences, "
                  "plainly, and say when you are unsure.")
        chats.append({"index": i, "topic": topic, "messages": [{"role": "system", "content": system}]})
    totals = {"prompt_tokens": 0, "cached_tokens": 0, "follow_up_prompt_tokens": 0, "follow_up_cached_tokens": 0}

    def one_turn(chat: dict, turn: int) -> tuple[int, int, int]:
        rng = random.Random(f"{seed}/{chat['index']}/{turn}")  # the same questions for every policy
        question = rng.choice(QUESTIONS).format(t=chat["topic"])
        chat["messages"].append({"role": "user", "content": question})
        r = client.chat.completions.create(model="m", messages=chat["messages"], max_tokens=24, temperature=0)
        chat["messages"].append({"role": "assistant", "content": r.choices[0].message.content})
        return turn, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

    with ThreadPoolExecutor(4) as pool:
        for turn in range(turns):
            for t, prompt, cached in pool.map(one_turn, chats, [turn] * len(chats)):
                totals["prompt_tokens"] += prompt
                totals["cached_tokens"] += cached
                if t > 0:
                    totals["follow_up_prompt_tokens"] += prompt
                    totals["follow_up_cached_tokens"] += cached
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: the tiny random one, built once)")
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    import ray
    from ray import serve

    from firsttoken.cli.serve import serve_config
    from firsttoken.models.checkpoint import make_model
    from firsttoken.serving.app import build_application
    from firsttoken.serving.options import FleetOptions

    model = args.model
    if model is None:
        model = "/tmp/bench-ray-tiny"
        if not (Path(model) / "config.json").exists():
            make_model(Path(model), size="tiny", seed=0, layout="transformers")
    with socket.socket() as s:  # an ephemeral port: above every fixed one other servers here use
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = serve_config(model=model, dtype="float32", kv_cache_memory=64 * 2**20, served_model_name="m",
                          step_time_target="off", num_threads=1)
    print(f"workload: {args.conversations} conversations x {args.turns} turns, {args.replicas} replicas, "
          f"model {model}, seed {args.seed}")
    results = {}
    try:
        for policy in args.policies.split(","):
            name = f"bench-{policy}"
            options = FleetOptions(replicas=args.replicas, routing=policy, replica_cpus=0.25, ingress_cpus=0.25)
            serve.run(build_application(config, options), name=name, route_prefix=f"/{name}")
            start = time.monotonic()
            totals = run_workload(f"http://127.0.0.1:{port}/{name}", args.conversations, args.turns, args.seed)
            totals["wall_s"] = round(time.monotonic() - start, 1)
            results[policy] = totals
            serve.delete(name)
            share = totals["cached_tokens"] / totals["prompt_tokens"]
            follow = totals["follow_up_cached_tokens"] / max(1, totals["follow_up_prompt_tokens"])
            print(f"{policy:12s} cached/prompt tokens: all turns {share:6.1%} ({totals['cached_tokens']}/"
                  f"{totals['prompt_tokens']})   follow-up turns {follow:6.1%}")
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
