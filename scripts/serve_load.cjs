// A bounded load test of a running moe-server: REQUESTS streaming completions, CONCURRENCY of
// them in flight at once, prompts of mixed lengths. Prints requests/s, generated tokens/s, and
// time-to-first-token and inter-token-latency percentiles measured at the client from the
// arrival of each server-sent event.
//   node scripts/serve_load.cjs URL [REQUESTS=64] [CONCURRENCY=16] [MAX_TOKENS=32]
const [url, requests = 64, concurrency = 16, maxTokens = 32] = process.argv.slice(2);
if (!url) {
  console.error('usage: node scripts/serve_load.cjs URL [REQUESTS] [CONCURRENCY] [MAX_TOKENS]');
  process.exit(2);
}
const words = 'the quick brown fox jumps over a lazy dog while experts route tokens'.split(' ');

async function one(i) {
  const prompt = Array.from({ length: 4 + ((i * 37) % 120) }, (_, j) => words[(i + j) % words.length]).join(' ');
  const t0 = performance.now();
  const res = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ prompt, max_tokens: +maxTokens, temperature: 0, stream: true }),
  });
  if (!res.ok) throw new Error(`status ${res.status}: ${await res.text()}`);
  const times = [];
  const decoder = new TextDecoder();
  let buffer = '';
  for await (const bytes of res.body) {
    buffer += decoder.decode(bytes, { stream: true });
    let cut;
    while ((cut = buffer.indexOf('\n\n')) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (event.startsWith('data: {')) times.push(performance.now());
    }
  }
  return { ttft: times[0] - t0, gaps: times.slice(1).map((t, k) => t - times[k]), tokens: times.length };
}

function percentiles(xs) {
  const s = [...xs].sort((a, b) => a - b);
  const p = (q) => s[Math.min(s.length - 1, Math.floor(q * s.length))].toFixed(1);
  return `p50 ${p(0.5)}  p90 ${p(0.9)}  p99 ${p(0.99)}  max ${s[s.length - 1].toFixed(1)} ms`;
}

(async () => {
  const results = [];
  let next = 0;
  const t0 = performance.now();
  await Promise.all(Array.from({ length: +concurrency }, async () => {
    while (next < +requests) results.push(await one(next++));
  }));
  const seconds = (performance.now() - t0) / 1000;
  const tokens = results.reduce((a, r) => a + r.tokens, 0);
  console.log(`requests ${results.length}, concurrency ${concurrency}, max_tokens ${maxTokens}, ${seconds.toFixed(2)} s`);
  console.log(`requests/s ${(results.length / seconds).toFixed(2)}, streamed events/s ${(tokens / seconds).toFixed(1)}`);
  console.log(`time to first token: ${percentiles(results.map((r) => r.ttft))}`);
  console.log(`inter-token latency: ${percentiles(results.flatMap((r) => r.gaps))}`);
})().catch((e) => {
  console.error('error: ' + e.message);
  process.exit(1);
});
