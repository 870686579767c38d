#!/usr/bin/env python3
"""A bounded load test of a running moe-server, with the Python standard library only (for GPU
hosts without Node): the same workload and output as scripts/serve_load.cjs. REQUESTS streaming
completions, CONCURRENCY of them in flight at once, prompts of mixed lengths; prints requests/s,
streamed events/s, and time-to-first-token and inter-token-latency percentiles measured at the
client from the arrival of each server-sent event.

    python3 scripts/serve_load.py URL [REQUESTS=64] [CONCURRENCY=16] [MAX_TOKENS=32] [TEMPERATURE=0]
        [--prompt-ids N [--vocab V]]

A TEMPERATURE above 0 samples, with the request's index as its seed so that runs repeat; a
sampled request may draw an EOS early, so events/s counts the tokens that arrived.

--prompt-ids N is the fixed-length workload that serving benchmarks use (vLLM's "random"
dataset): each prompt is N token ids drawn uniformly from [0, V) with the request's index as the
seed (V defaults to 151643, the Qwen3 ids below its special tokens), and every request sends
"ignore_eos" so that it runs to MAX_TOKENS. It adds output tokens/s, mean time to first token and
mean time per output token (a request's last event minus its first, over its tokens less one).
"""
import random
import http.client
import json
import sys
import threading
import time
import urllib.parse

WORDS = "the quick brown fox jumps over a lazy dog while experts route tokens".split()


def one(url, i, max_tokens, temperature, prompt_ids, vocab):
    request = {"max_tokens": max_tokens, "temperature": temperature, "seed": i, "stream": True}
    if prompt_ids:
        draw = random.Random(i)
        request["prompt"] = [draw.randrange(vocab) for _ in range(prompt_ids)]
        request["ignore_eos"] = True
        # Events skip tokens that end inside a UTF-8 character: count tokens from the usage.
        request["stream_options"] = {"include_usage": True}
    else:
        request["prompt"] = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(4 + (i * 37) % 120))
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps(request)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    res = conn.getresponse()
    if res.status != 200:
        raise RuntimeError(f"status {res.status}: {res.read().decode()}")
    times, usage = [], None
    while True:
        line = res.readline()
        if not line:
            break
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            else:
                times.append(time.perf_counter())
    conn.close()
    if not times:
        raise RuntimeError("the stream ended without a token")
    return {"ttft": (times[0] - t0) * 1e3, "gaps": [(b - a) * 1e3 for a, b in zip(times, times[1:])],
            "tokens": usage if usage is not None else len(times),
            "span": (times[-1] - times[0]) * 1e3}


def percentiles(xs):
    s = sorted(xs)
    p = lambda q: s[min(len(s) - 1, int(q * len(s)))]
    return f"p50 {p(0.5):.1f}  p90 {p(0.9):.1f}  p99 {p(0.99):.1f}  max {s[-1]:.1f} ms"


def take_flag(args, name, fallback):
    if name not in args:
        return fallback
    at = args.index(name)
    if at + 1 >= len(args) or not args[at + 1].isdigit() or int(args[at + 1]) < 1:
        print(f"error: {name} needs a positive integer", file=sys.stderr)
        sys.exit(2)
    value = int(args[at + 1])
    del args[at:at + 2]
    return value


def main():
    args = sys.argv[1:]
    prompt_ids = take_flag(args, "--prompt-ids", 0)
    vocab = take_flag(args, "--vocab", 151643)
    if not args or any(a.startswith("--") for a in args):
        print("usage: python3 scripts/serve_load.py URL [REQUESTS] [CONCURRENCY] [MAX_TOKENS] [TEMPERATURE] "
              "[--prompt-ids N [--vocab V]]", file=sys.stderr)
        sys.exit(2)
    url = args[0]
    requests, concurrency, max_tokens = (int(a) for a in (args[1:] + ["64", "16", "32"][len(args) - 1:])[:3])
    temperature = float(args[4]) if len(args) > 4 else 0.0
    results, errors, lock = [], [], threading.Lock()
    counter = iter(range(requests))

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            try:
                r = one(url, i, max_tokens, temperature, prompt_ids, vocab)
                with lock:
                    results.append(r)
            except Exception as e:  # reported below; the run fails
                with lock:
                    errors.append(str(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        print("error: " + errors[0], file=sys.stderr)
        sys.exit(1)
    tokens = sum(r["tokens"] for r in results)
    print(f"requests {len(results)}, concurrency {concurrency}, max_tokens {max_tokens}, temperature {temperature}, "
          f"{seconds:.2f} s")
    print(f"requests/s {len(results) / seconds:.2f}, streamed {'tokens' if prompt_ids else 'events'}/s "
          f"{tokens / seconds:.1f}")
    print(f"time to first token: {percentiles([r['ttft'] for r in results])}")
    print(f"inter-token latency: {percentiles([g for r in results for g in r['gaps']])}")
    if prompt_ids:
        short = [r["tokens"] for r in results if r["tokens"] != max_tokens]
        if short:
            print(f"error: {len(short)} requests streamed other than {max_tokens} tokens (e.g. {short[0]})",
                  file=sys.stderr)
            sys.exit(1)
        tpot = [r["span"] / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
        print(f"prompt ids {prompt_ids}: output tokens/s {tokens / seconds:.1f}, "
              f"mean TTFT {sum(r['ttft'] for r in results) / len(results):.1f} ms, "
              f"mean TPOT {sum(tpot) / len(tpot):.2f} ms")


if __name__ == "__main__":
    main()
