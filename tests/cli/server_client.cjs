// Talks to a running moe-server with the official `openai` client. Environment: MOE_URL (the
// server's base URL), MOE_MODEL (its model id), MOE_EXPECT (a JSON file of
// [{prompt, n, chat, text}], the text moe-cli generate printed for each prompt alone).
// Prints one line per check and exits non-zero when any fails.
const OpenAI = require('openai');
const fs = require('fs');

const client = new OpenAI({ baseURL: process.env.MOE_URL + '/v1', apiKey: 'unused', maxRetries: 0 });
const model = process.env.MOE_MODEL;
const expected = JSON.parse(fs.readFileSync(process.env.MOE_EXPECT, 'utf8'));
let failures = 0;
function check(name, ok, detail) {
  console.log(`${ok ? 'ok  ' : 'FAIL'} ${name}${ok ? '' : ': ' + detail}`);
  if (!ok) failures++;
}

async function complete(e, stream) {
  const params = { model, max_tokens: e.n, temperature: 0, stream };
  if (e.chat) {
    const messages = [{ role: 'user', content: e.prompt }];
    if (!stream) {
      const r = await client.chat.completions.create({ ...params, messages });
      return { text: r.choices[0].message.content, finish: r.choices[0].finish_reason };
    }
    let text = '', finish = null;
    for await (const chunk of await client.chat.completions.create({ ...params, messages })) {
      text += chunk.choices[0].delta.content ?? '';
      finish = chunk.choices[0].finish_reason ?? finish;
    }
    return { text, finish };
  }
  if (!stream) {
    const r = await client.completions.create({ ...params, prompt: e.prompt });
    return { text: r.choices[0].text, finish: r.choices[0].finish_reason };
  }
  let text = '', finish = null;
  for await (const chunk of await client.completions.create({ ...params, prompt: e.prompt })) {
    text += chunk.choices[0].text;
    finish = chunk.choices[0].finish_reason ?? finish;
  }
  return { text, finish };
}

(async () => {
  const models = await client.models.list();
  check('models lists the served model', models.data.length === 1 && models.data[0].id === model,
        JSON.stringify(models.data));
  // Each prompt alone, streaming and not: the text moe-cli generate printed.
  for (const e of expected)
    for (const stream of [false, true]) {
      const r = await complete(e, stream);
      check(`${e.chat ? 'chat' : 'completion'} ${stream ? 'stream' : 'plain'} "${e.prompt}"`,
            r.text === e.text && ['length', 'stop'].includes(r.finish),
            `got ${JSON.stringify(r)}, want ${JSON.stringify(e.text)}`);
    }
  // 64 streams at once, mixed prompts and lengths: each gets its own text.
  const jobs = [];
  for (let i = 0; i < 64; i++) jobs.push(expected[i % expected.length]);
  const results = await Promise.all(jobs.map((e) => complete(e, true)));
  const wrong = results.filter((r, i) => r.text !== jobs[i].text).length;
  check('64 concurrent streams each match their prompt alone', wrong === 0, `${wrong} of 64 differ`);
  // A bad request is an APIError with the status and message of an OpenAI error body.
  try {
    await client.completions.create({ model: 'no-such-model', prompt: 'x', max_tokens: 2 });
    check('unknown model is refused', false, 'no error');
  } catch (err) {
    check('unknown model is refused', err.status === 404 && /does not exist/.test(err.message), err.message);
  }
  process.exit(failures ? 1 : 0);
})().catch((err) => {
  console.log('FAIL client: ' + err);
  process.exit(1);
});
