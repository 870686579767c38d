#!/usr/bin/env python3
"""A bounded load test of a running moe-server, with the Python standard library only (for GPU
hosts without Node): the same workload and output as scripts/serve_load.cjs. REQUESTS streaming
completions, CONCURRENCY of them in flight at once, prompts of mixed lengths; prints requests/s,
streamed events/s, and time-to-first-token and inter-token-latency percentiles measured at the
client from the arrival of each server-sent event.

    python3 scripts/serve_load.py URL [REQUESTS=64] [CONCURRENCY=16] [MAX_TOKENS=32] [TEMPERATURE=0]

A TEMPERATURE above 0 samples, with the request's index as its seed so that runs repeat; a
sampled request may draw an EOS early, so events/s counts the tokens that arrived.
"""
import http.client
import json
import sys
import threading
import time
import urllib.parse

WORDS = "the quick brown fox jumps over a lazy dog while experts route tokens".split()


def one(url, i, max_tokens, temperature):
    prompt = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(4 + (i * 37) % 120))
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": i,
                       "stream": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    res = conn.getresponse()
    if res.status != 200:
        raise RuntimeError(f"status {res.status}: {res.read().decode()}")
    times = []
    while True:
        line = res.readline()
        if not line:
            break
        if line.startswith(b"data: {"):
            times.append(time.perf_counter())
    conn.close()
    return {"ttft": (times[0] - t0) * 1e3, "gaps": [(b - a) * 1e3 for a, b in zip(times, times[1:])],
            "tokens": len(times)}


def percentiles(xs):
    s = sorted(xs)
    p = lambda q: s[min(len(s) - 1, int(q * len(s)))]
    return f"p50 {p(0.5):.1f}  p90 {p(0.9):.1f}  p99 {p(0.99):.1f}  max {s[-1]:.1f} ms"


def main():
    if len(sys.argv) < 2:
        print("usage: python3 scripts/serve_load.py URL [REQUESTS] [CONCURRENCY] [MAX_TOKENS] [TEMPERATURE]",
              file=sys.stderr)
        sys.exit(2)
    url = sys.argv[1]
    requests, concurrency, max_tokens = (int(a) for a in (sys.argv[2:] + ["64", "16", "32"][len(sys.argv) - 2:])[:3])
    temperature = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    results, errors, lock = [], [], threading.Lock()
    counter = iter(range(requests))

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            try:
                r = one(url, i, max_tokens, temperature)
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
    print(f"requests/s {len(results) / seconds:.2f}, streamed events/s {tokens / seconds:.1f}")
    print(f"time to first token: {percentiles([r['ttft'] for r in results])}")
    print(f"inter-token latency: {percentiles([g for r in results for g in r['gaps']])}")


if __name__ == "__main__":
    main()
